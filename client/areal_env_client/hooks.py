"""Tagging an agent's HTTP requests with its session, without changing the agent's code.

A ``ContextVar`` holds the sessions active in the current context (each asyncio task and each
thread has its own), and the ``send`` of the HTTP clients agents use is wrapped once to add the
``X-Areal-Session`` header to requests bound for a service that has an active session there:
``httpx`` (the openai and anthropic SDKs; anthropic's fork ``httpx2`` too), ``aiohttp`` and
``requests`` (the latter two when they are installed). Anything else (a raw socket, another
language, a subprocess) names its session by URL instead: ``AgentSession.base_url``.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
import threading
from typing import Any

import httpx

SESSION_HEADER = "X-Areal-Session"
"""Header naming the session of a request (the gateway routes and records by it)."""

SESSION_PATH = "/s/"
"""Session-scoped URLs: ``{service}/s/{session_id}/v1`` names the session in the path."""

# (service URL, session id) pairs active in the current context, innermost last.
ACTIVE_SESSIONS: contextvars.ContextVar[tuple[tuple[httpx.URL, str], ...]] = contextvars.ContextVar(
    "areal_env_active_sessions", default=()
)
_lock = threading.Lock()
_patched: set[str] = set()


def _matches(url: Any, service: httpx.URL) -> bool:
    if not isinstance(url, httpx.URL):
        try:
            url = httpx.URL(str(url))
        except Exception:  # noqa: BLE001 - not a URL we know: leave the request alone
            return False
    return (
        url.scheme == service.scheme
        and url.host == service.host
        and url.port == service.port
        and url.path.startswith(service.path.rstrip("/") + "/")
    )


def session_for(url: Any) -> str | None:
    """The innermost active session (this context) whose service ``url`` points at."""
    for service, session_id in reversed(ACTIVE_SESSIONS.get()):
        if _matches(url, service):
            return session_id
    return None


def _tag(request: Any) -> None:
    """httpx / requests: add the header unless the request names a session already."""
    if not ACTIVE_SESSIONS.get() or SESSION_HEADER in request.headers:
        return
    session_id = session_for(request.url)
    if session_id is not None:
        request.headers[SESSION_HEADER] = session_id


def _wrap_send(cls: Any) -> None:
    original = cls.send
    if getattr(original, "_areal_session_hook", False):
        return
    if inspect.iscoroutinefunction(original):

        @functools.wraps(original)
        async def send(self: Any, request: Any, *a: Any, **k: Any) -> Any:
            _tag(request)
            return await original(self, request, *a, **k)

    else:

        @functools.wraps(original)
        def send(self: Any, request: Any, *a: Any, **k: Any) -> Any:
            _tag(request)
            return original(self, request, *a, **k)

    send._areal_session_hook = True  # type: ignore[attr-defined]
    cls.send = send  # type: ignore[method-assign]


def _wrap_aiohttp(module: Any) -> None:
    cls = module.ClientSession
    original = cls._request
    if getattr(original, "_areal_session_hook", False):
        return

    @functools.wraps(original)
    async def _request(self: Any, method: str, str_or_url: Any, *a: Any, **k: Any) -> Any:
        if ACTIVE_SESSIONS.get():
            build = getattr(self, "_build_url", None)  # applies the session's base_url
            try:
                target = str(build(str_or_url)) if build else str(str_or_url)
            except Exception:  # noqa: BLE001 - aiohttp will report a bad URL itself
                target = str(str_or_url)
            session_id = session_for(target)
            if session_id is not None:
                headers = dict(k.get("headers") or {})
                if not any(h.lower() == SESSION_HEADER.lower() for h in headers):
                    headers[SESSION_HEADER] = session_id
                    k["headers"] = headers
        return await original(self, method, str_or_url, *a, **k)

    _request._areal_session_hook = True  # type: ignore[attr-defined]
    cls._request = _request  # type: ignore[method-assign]


def install_session_hook() -> None:
    """Wrap the HTTP clients once (idempotent; called by ``AgentSession``). ``aiohttp`` and
    ``requests`` are wrapped when they are installed (they are imported here to do so)."""
    with _lock:
        for name in ("httpx", "httpx2"):
            if name in _patched:
                continue
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            for cls_name in ("AsyncClient", "Client"):
                cls = getattr(module, cls_name, None)
                if cls is not None:
                    _wrap_send(cls)
            _patched.add(name)
        if "aiohttp" not in _patched:
            try:
                _wrap_aiohttp(importlib.import_module("aiohttp"))
                _patched.add("aiohttp")
            except (ImportError, AttributeError):
                pass
        if "requests" not in _patched:
            try:
                _wrap_send(importlib.import_module("requests").Session)
                _patched.add("requests")
            except (ImportError, AttributeError):
                pass
