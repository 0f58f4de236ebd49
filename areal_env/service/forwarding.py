"""The gateway's HTTP calls to its backends: forwarding model calls to the backend that owns the
session, the admin and session calls of the RL routes, and the health probes.

Forwarding is a thin streaming pass-through over ``httpx`` (bodies and SSE streams are relayed
chunk by chunk, never buffered) that swaps the user's key for the session's, caps completion
lengths and counts the tokens the answers report. A generic reverse proxy library would not know
how to swap keys per session, which is the one thing needed here. A transport failure marks the
backend down in the gateway's ``SessionBook``.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from areal_env_client import SESSION_HEADER
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from areal_env.http import routes
from areal_env.http.body import read_body
from areal_env.http.client import default_ssl_context
from areal_env.service.auth import UserKey
from areal_env.service.backends import Backend
from areal_env.service.sessions import GatewaySession, ServiceError, SessionBook

logger = logging.getLogger(__name__)

_DROP_REQUEST_HEADERS = {
    "host",
    "content-length",
    "authorization",
    "x-api-key",
    SESSION_HEADER.lower(),
    "x-areal-path-session",
    "connection",
    "keep-alive",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "accept-encoding",
    "cookie",
}
_DROP_RESPONSE_HEADERS = {
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "content-encoding",
    "date",
    "server",
}
_USAGE_HEAD = 8192
_USAGE_RE = re.compile(rb'"usage"\s*:\s*(\{[^{}]*\})')
_USAGE_TAIL = 65536
_MODEL_POSTS = {
    routes.CHAT_COMPLETIONS: ("max_tokens", "max_completion_tokens"),
    routes.OPENAI_PREFIX + "/completions": ("max_tokens",),
    routes.RESPONSES: ("max_output_tokens",),
    routes.MESSAGES: ("max_tokens",),
}


def _usage_of(obj: Any) -> int:
    """Tokens in one ``usage`` object (OpenAI chat/responses or Anthropic field names)."""
    if not isinstance(obj, dict):
        return 0
    total = 0
    for name in ("prompt_tokens", "completion_tokens", "input_tokens", "output_tokens"):
        value = obj.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            total += value
    return total


def usage_tokens(content_type: str, head: bytes, tail: bytes, *, whole: bool = False) -> int:
    """Tokens an answer reports in its ``usage`` (a JSON body, or the events of an SSE stream:
    OpenAI's final chunk, Responses' ``response.completed``, Anthropic's ``message_start`` +
    ``message_delta``). ``head``/``tail``: the first and last bytes of the body (``whole``:
    ``tail`` is all of it). 0 when it reports none (the export reconciles at finalize)."""
    if "text/event-stream" not in content_type:
        if whole:
            try:
                data = json.loads(tail)
            except ValueError:
                return 0
            return _usage_of(data.get("usage")) if isinstance(data, dict) else 0
        found = _USAGE_RE.search(tail)  # a huge body: usage is near its end
        if found is None:
            return 0
        try:
            return _usage_of(json.loads(found.group(1)))
        except ValueError:
            return 0
    total = 0
    seen: set[bytes] = set()
    for chunk in (head, tail):
        for line in chunk.split(b"\n"):
            if not line.startswith(b"data:") or b"usage" not in line or line in seen:
                continue
            seen.add(line)
            try:
                event = json.loads(line[5:])
            except ValueError:
                continue
            if not isinstance(event, dict):
                continue
            if event.get("type") == "message_start":
                total += _usage_of((event.get("message") or {}).get("usage"))
            elif event.get("type") == "response.completed":
                total += _usage_of((event.get("response") or {}).get("usage"))
            else:
                total += _usage_of(event.get("usage"))
    return total


class Forwarder:
    """The gateway's side toward its backends: one shared ``httpx`` client (made on first use,
    on the serving loop) for model calls (``forward``), the RL routes' backend calls and the
    health probes. Failures and token counts go into ``book``."""

    def __init__(self, book: SessionBook, *, max_new_tokens: int | None = None) -> None:
        self.book = book
        self.max_new_tokens = max_new_tokens
        """Cap (and default) of every model call's completion length: the trainer's
        ``gconfig.max_new_tokens`` governs sampling, whatever an agent asks for."""
        self._http: httpx.AsyncClient | None = None

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(
                timeout=httpx.Timeout(
                    connect=5.0, read=self.book.config.request_timeout, write=60.0, pool=None
                ),
                limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
                verify=default_ssl_context(),
            )
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    # -- the RL routes' backend calls ------------------------------------------------------

    async def _post(
        self, backend: Backend, path: str, payload: dict, bearer: str, unreachable: str
    ) -> httpx.Response:
        """POST to a backend; a transport failure marks it down and answers 503."""
        try:
            return await self.http.post(
                backend.base_url + path,
                json=payload,
                headers={"Authorization": f"Bearer {bearer}"},
            )
        except httpx.TransportError as e:
            self.book.backend_down(
                backend,
                f"{type(e).__name__} on {path}",
                conclusive=isinstance(e, httpx.ConnectError),
            )
            raise ServiceError(503, unreachable) from e

    async def admin_post(self, backend: Backend, path: str, payload: dict) -> httpx.Response:
        """POST with the backend's admin key (starting sessions, exports)."""
        unreachable = f"backend {backend.name} is unreachable"
        return await self._post(backend, path, payload, backend.admin_key, unreachable)

    async def session_post(self, sess: GatewaySession, path: str, payload: dict) -> httpx.Response:
        """POST as ``sess`` (its session key) to the backend that owns it."""
        backend = sess.backend
        assert backend is not None, "closed sessions have no backend"
        unreachable = f"the backend of session {sess.id} is unreachable"
        return await self._post(backend, path, payload, sess.session_key, unreachable)

    async def probe(self, backend: Backend) -> None:
        """One health check of ``backend``, recorded in the pool."""
        try:
            resp = await self.http.get(
                backend.base_url + routes.HEALTH, timeout=self.book.config.health_timeout
            )
            ok = resp.status_code == 200
            error = f"/health answered {resp.status_code}"
        except httpx.HTTPError as e:
            ok, error = False, f"/health: {type(e).__name__}"
        if ok:
            self.book.pool.mark_ok(backend)
        else:
            self.book.backend_down(backend, error, conclusive=False)

    # -- model calls -----------------------------------------------------------------------

    def _capped_body(self, path: str, body: bytes) -> bytes:
        """The request body with its completion length capped at ``max_new_tokens`` (and set
        to it when the agent gave none)."""
        fields = _MODEL_POSTS.get(path)
        if self.max_new_tokens is None or fields is None or not body:
            return body
        try:
            data = json.loads(body)
        except ValueError:
            return body  # the proxy answers the parse error in the protocol's own format
        if not isinstance(data, dict):
            return body
        changed = False
        present = [f for f in fields if isinstance(data.get(f), int)]
        for name in present:
            if data[name] > self.max_new_tokens:
                data[name] = self.max_new_tokens
                changed = True
        if not present:
            data[fields[0]] = self.max_new_tokens
            changed = True
        return json.dumps(data).encode() if changed else body

    async def forward(
        self,
        request: Request,
        sess: GatewaySession | None,
        backend: Backend,
        key: str,
        on_close: Callable[[], Awaitable[None]] | None = None,
        user: UserKey | None = None,
    ) -> Response:
        path = request.url.path
        url = backend.base_url + path
        if request.url.query:
            url += "?" + request.url.query
        headers = {
            k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST_HEADERS
        }
        headers["authorization"] = f"Bearer {key}"
        headers["x-api-key"] = key
        headers["accept-encoding"] = "identity"
        body = await read_body(request)
        if request.method == "POST":
            body = self._capped_body(path, body)
        upstream = self.http.build_request(request.method, url, headers=headers, content=body)
        if sess is not None:
            sess.inflight += 1
        try:
            resp = await self.http.send(upstream, stream=True)
        except httpx.TransportError as e:
            if sess is not None:
                sess.inflight -= 1
            self.book.backend_down(
                backend,
                f"{type(e).__name__} forwarding {path}",
                conclusive=isinstance(e, httpx.ConnectError),
            )
            who = f"session {sess.id}" if sess else "this request"
            raise ServiceError(
                503,
                f"the backend of {who} is unavailable ({type(e).__name__}); "
                "the session has failed, start a new session",
            ) from e
        self.book.counters["requests_forwarded"] += 1
        out_headers = {
            k: v for k, v in resp.headers.items() if k.lower() not in _DROP_RESPONSE_HEADERS
        }
        content_type = resp.headers.get("content-type", "")
        head = bytearray()
        tail = bytearray()
        size = 0
        closed = False

        async def done() -> None:
            # Idempotent: runs when the stream ends, and again as the background task; the
            # generator's ``finally`` covers clients that disconnect mid-stream.
            nonlocal closed
            if closed:
                return
            closed = True
            if sess is not None:
                sess.inflight -= 1
                sess.last_used = time.monotonic()
            await resp.aclose()
            if user is not None and resp.status_code < 400:
                tokens = usage_tokens(
                    content_type, bytes(head), bytes(tail), whole=size == len(tail)
                )
                self.book.count_tokens(sess, user, tokens)
            if on_close is not None:
                await on_close()

        async def body_iter():
            nonlocal size
            try:
                async for chunk in resp.aiter_raw():
                    size += len(chunk)
                    if len(head) < _USAGE_HEAD:
                        head.extend(chunk[: _USAGE_HEAD - len(head)])
                    tail.extend(chunk)
                    if len(tail) > 2 * _USAGE_TAIL:
                        del tail[:-_USAGE_TAIL]
                    yield chunk
            except httpx.TransportError as e:
                logger.warning("stream from %s broke: %s", backend.name, type(e).__name__)
                self.book.backend_down(
                    backend, f"stream broke: {type(e).__name__}", conclusive=False
                )
            finally:
                await done()

        return StreamingResponse(
            body_iter(),
            status_code=resp.status_code,
            headers=out_headers,
            background=BackgroundTask(done),
        )
