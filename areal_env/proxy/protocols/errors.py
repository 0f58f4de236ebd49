"""One exception type for every client-visible failure, rendered in each protocol's own format.

Handlers raise :class:`ProxyError` with an HTTP status; the app turns it into OpenAI's
``{"error": {...}}`` or Anthropic's ``{"type": "error", "error": {...}}`` body depending on the
route, so SDKs raise their usual typed exceptions (``openai.NotFoundError``,
``anthropic.RateLimitError``, ...).
"""

from __future__ import annotations

from typing import Any

# OpenAI "type" strings per status (what api.openai.com sends).
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    410: "gone_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}

# Anthropic error "type" strings per status (docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    410: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class ProxyError(Exception):
    """A failure the client should see, with its HTTP status.

    ``param`` names the offending request field where there is one (OpenAI clients show it).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def bad_request(message: str, param: str | None = None) -> ProxyError:
    return ProxyError(400, message, param=param, code="invalid_value" if param else None)


def openai_error_body(err: ProxyError) -> dict[str, Any]:
    return {
        "error": {
            "message": err.message,
            "type": _OPENAI_TYPES.get(err.status, "invalid_request_error"),
            "param": err.param,
            "code": err.code,
        }
    }


def anthropic_error_body(err: ProxyError) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {
            "type": _ANTHROPIC_TYPES.get(err.status, "invalid_request_error"),
            "message": err.message,
        },
    }
