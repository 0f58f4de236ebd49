"""What clients of the package's servers share. Light: httpx only (no server stack), so the
agent-side clients can use it."""

from __future__ import annotations

from typing import Any

import httpx


def error_message(data: Any, fallback: str) -> str:
    """The human message of an error body in any shape the servers send (OpenAI's, Anthropic's,
    SGLang's, FastAPI's ``detail``)."""
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str) and err:
            return err
        if data.get("detail"):
            return str(data["detail"])
    return fallback


def response_error_message(resp: httpx.Response, limit: int = 500) -> str:
    """The message of a failed response: from its JSON error body, else its text."""
    try:
        data = resp.json()
    except ValueError:
        return resp.text[:limit]
    return error_message(data, str(data)[:limit])
