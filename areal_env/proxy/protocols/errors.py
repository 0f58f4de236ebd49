"""The proxy's client-visible failures: :class:`~areal_env.http.errors.HTTPError` under the
name handlers raise (``ProxyError``), rendered in each protocol's own format by the toolkit."""

from __future__ import annotations

from areal_env.http.errors import (
    HTTPError as ProxyError,
)
from areal_env.http.errors import (
    anthropic_error_body,
    bad_request,
    openai_error_body,
)

__all__ = ["ProxyError", "anthropic_error_body", "bad_request", "openai_error_body"]
