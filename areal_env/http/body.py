"""Request bodies and keys: JSON with a size limit, the caller's API key."""

from __future__ import annotations

from typing import Any

from starlette.requests import ClientDisconnect, Request

from areal_env.http.codec import loads
from areal_env.http.errors import HTTPError, bad_request

# Agents resend whole conversations each turn; 32 MiB is far above any real one and still
# stops a runaway client before it fills memory.
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


async def read_body(request: Request, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> bytes:
    """The raw body, refused with a 413 :class:`HTTPError` past ``max_bytes``.

    A client that hangs up before its body is complete gets a 400 (nobody reads it) instead of
    an unexpected-error 500 and a traceback in the server's log for each such request.
    """
    try:
        return await _read_body(request, max_bytes)
    except ClientDisconnect:
        raise HTTPError(400, "the client disconnected before sending the whole body") from None


async def _read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        if declared.isdigit() and int(declared) > max_bytes:
            raise HTTPError(413, f"request body of {declared} bytes exceeds {max_bytes} bytes")
        raw = await request.body()
    else:  # chunked: count while reading
        parts: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise HTTPError(413, f"request body exceeds {max_bytes} bytes")
            parts.append(chunk)
        raw = b"".join(parts)
    if len(raw) > max_bytes:
        raise HTTPError(413, f"request body of {len(raw)} bytes exceeds {max_bytes} bytes")
    return raw


async def read_json(
    request: Request,
    *,
    empty_ok: bool = False,
    object_only: bool = False,
    max_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> Any:
    """The parsed JSON body. ``empty_ok``: an empty body reads as ``{}``; ``object_only``: any
    other JSON value than an object is refused. Failures raise :class:`HTTPError` (400, 413)."""
    raw = await read_body(request, max_bytes)
    if not raw.strip():
        if empty_ok:
            return {}
        raise bad_request("request body is empty; expected a JSON object")
    try:
        data = loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    if object_only and not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    return data


def request_key(request: Request) -> str | None:
    """The caller's key from ``Authorization: Bearer`` or ``x-api-key`` (OpenAI / Anthropic)."""
    auth = request.headers.get("authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    key = request.headers.get("x-api-key")
    return key.strip() if key else None
