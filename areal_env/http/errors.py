"""One error vocabulary for every HTTP app of the package (proxy, ``areal-env serve``, gateway).

Handlers raise :class:`HTTPError` with a status; the app renders it in the wire format its
clients expect: OpenAI's ``{"error": {...}}`` (also used for the RL and service routes) or, on
Anthropic routes, ``{"type": "error", "error": {...}}``. Each format has ONE status -> type
table here, so an SDK raises the same typed exception (``openai.NotFoundError``,
``anthropic.RateLimitError``, ...) whichever app answered.
"""

from __future__ import annotations

import logging
from dataclasses import KW_ONLY, dataclass
from typing import Any

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from areal_env.http.codec import dumps
from areal_env.http.ratelimit import retry_after_headers
from areal_env.http.routes import is_anthropic_route

logger = logging.getLogger(__name__)

# OpenAI "type" strings per status (what api.openai.com sends).
OPENAI_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    410: "gone_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "bad_gateway_error",
    503: "service_unavailable_error",
}

# Anthropic error "type" strings per status (docs.anthropic.com/en/api/errors).
ANTHROPIC_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    410: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
}


@dataclass(eq=False)
class HTTPError(Exception):
    """A failure the client should see, with its HTTP status.

    ``param`` names the offending request field where there is one (OpenAI clients show it);
    ``code`` is a machine-readable reason (``session_ended``, ``context_length_exceeded``, ...).
    """

    status: int
    message: str
    _: KW_ONLY
    param: str | None = None
    code: str | None = None
    retry_after: float | None = None
    """Seconds after which a retry may succeed (429, 503): sent as ``Retry-After``."""

    def __post_init__(self) -> None:
        super().__init__(self.message)


def bad_request(message: str, param: str | None = None) -> HTTPError:
    return HTTPError(400, message, param=param, code="invalid_value" if param else None)


def openai_error_body(err: HTTPError) -> dict[str, Any]:
    return {
        "error": {
            "message": err.message,
            "type": OPENAI_ERROR_TYPES.get(err.status, "invalid_request_error"),
            "param": err.param,
            "code": err.code,
        }
    }


def anthropic_error_body(err: HTTPError) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {
            "type": ANTHROPIC_ERROR_TYPES.get(err.status, "invalid_request_error"),
            "message": err.message,
        },
    }


def error_body(path: str, err: HTTPError) -> dict[str, Any]:
    """The body for ``err`` in the wire format of the route at ``path``."""
    return anthropic_error_body(err) if is_anthropic_route(path) else openai_error_body(err)


def error_response(path: str, err: HTTPError) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else {}
    if err.retry_after is not None:
        headers.update(retry_after_headers(err.retry_after))
    return Response(
        dumps(error_body(path, err)),
        status_code=err.status,
        media_type="application/json",
        headers=headers,
    )


def install_error_handlers(app: FastAPI, counters: dict[str, int] | None = None) -> None:
    """Render :class:`HTTPError`, Starlette's 404/405 and unexpected exceptions in one format.

    ``counters["errors"]`` (when given) counts every error answered.
    """

    def count() -> None:
        if counters is not None:
            counters["errors"] = counters.get("errors", 0) + 1

    async def on_http_error(request: Request, err: Exception) -> Response:
        assert isinstance(err, HTTPError)
        count()
        if err.status >= 500:
            logger.warning(
                "%s %s -> %d: %s", request.method, request.url.path, err.status, err.message
            )
        return error_response(request.url.path, err)

    async def on_starlette_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        count()
        msg = str(exc.detail) if exc.detail else "error"
        if exc.status_code == 404:
            msg = f"no route {request.method} {request.url.path}"
        return error_response(request.url.path, HTTPError(exc.status_code, msg))

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        count()
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(request.url.path, HTTPError(500, "internal error"))

    app.add_exception_handler(HTTPError, on_http_error)
    app.add_exception_handler(StarletteHTTPException, on_starlette_error)
    app.add_exception_handler(Exception, on_unexpected)
