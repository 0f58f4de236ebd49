"""What clients of the package's servers share. Light: httpx only (no server stack), so the
agent-side clients can use it."""

from __future__ import annotations

import functools
import ssl
from typing import Any

import httpx


@functools.cache
def default_ssl_context() -> ssl.SSLContext:
    """httpx's default certificate verification (certifi's bundle, or ``SSL_CERT_FILE`` /
    ``SSL_CERT_DIR`` as set when first called), built once per process: every client the package
    opens takes it as ``verify=``, except the SGLang client, which ignores the environment's
    settings (``trust_env=False``) and is opened once per event loop.

    Why: httpx builds a new context for every client, even one that only talks plain HTTP, and
    loading the CA bundle costs about 50 ms of CPU (measured here). The code that opens a client
    per episode (an environment adapter, an MCP session) blocked its event loop that long for
    each episode: about 3 s of a 32-episode rollout on two cores."""
    return httpx.create_ssl_context()


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
