"""JSON in and out for the HTTP apps: orjson, with the stdlib where orjson refuses."""

from __future__ import annotations

import json
from typing import Any

import orjson
from starlette.responses import Response

JSON_MEDIA = "application/json"


def dumps(obj: Any) -> bytes:
    """Compact JSON bytes; the stdlib answers what orjson refuses (non-str keys, big ints)."""
    try:
        return orjson.dumps(obj)
    except (TypeError, orjson.JSONEncodeError):
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def loads(raw: bytes | str) -> Any:
    """Parse JSON; the stdlib takes over where orjson refuses (NaN, huge ints).

    A body nested too deeply for either parser is a ``ValueError`` (a 400), never a
    ``RecursionError`` escaping into the server (that reset the connection with no answer).
    """
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        try:
            return json.loads(raw)
        except RecursionError:
            raise ValueError("JSON nested too deeply") from None


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(content=dumps(obj), status_code=status, media_type=JSON_MEDIA, headers=headers)
