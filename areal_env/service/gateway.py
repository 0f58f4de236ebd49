"""The service gateway: the one public endpoint of the any-agent training service.

It authenticates user keys, owns the session bookkeeping, and forwards model calls to the proxy
backend that owns each session (session affinity). Users never see the proxies' admin or
session keys: the gateway substitutes them. Forwarding is a thin streaming pass-through over
``httpx`` (bodies and SSE streams are relayed chunk by chunk, never buffered); a generic reverse
proxy library would not know how to swap keys per session, which is the one thing needed here.

A call names its session with the ``X-Areal-Session`` header (``AgentSession`` adds it), the
session-scoped URL ``/s/{session_id}/...`` (any route below it: ``/s/ID/v1/chat/completions``,
``/s/ID/rl/v1/finalize``), or, for agents that can set nothing but an API key, the key
``USER_KEY:SESSION_ID``.

Durable state (keys, sessions, acknowledged trajectories) lives in the service store
(``store.py``); every store call runs in a worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from areal_env.api.service_config import ServiceConfig, is_loopback
from areal_env.http import routes
from areal_env.http.body import read_body, read_json, request_key
from areal_env.http.errors import HTTPError, error_response, install_error_handlers
from areal_env.http.net import bind_socket, url_host
from areal_env.http.runner import ServerThread
from areal_env.service.auth import KeyStore, QuotaExceededError, UserKey
from areal_env.service.backends import Backend, BackendPool, NoBackendError
from areal_env.service.client import SESSION_HEADER
from areal_env.service.store import ServiceStore, SessionRecord, open_store

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
_TOMBSTONE_SECONDS = 600.0
PATH_SESSION_HEADER = "x-areal-path-session"
"""Set by ``SessionPathApp`` from ``/s/{id}/...`` URLs (never forwarded)."""
RESTARTED = "the service restarted while the session was open; start a new session"
_USAGE_HEAD = 8192
_USAGE_RE = re.compile(rb'"usage"\s*:\s*(\{[^{}]*\})')
_USAGE_TAIL = 65536
_MODEL_POSTS = {
    routes.CHAT_COMPLETIONS: ("max_tokens", "max_completion_tokens"),
    routes.OPENAI_PREFIX + "/completions": ("max_tokens",),
    routes.RESPONSES: ("max_output_tokens",),
    routes.MESSAGES: ("max_tokens",),
}


class ServiceError(HTTPError):
    """An error answered in the route's own format (the toolkit's vocabulary); 429 and 503
    answers carry ``Retry-After`` when waiting helps."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        retry_after: float | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(status, message, code=code, retry_after=retry_after)


@dataclass
class GatewaySession:
    """A user's session, owned by one backend."""

    id: str
    user: UserKey
    backend: Backend | None
    """None for a session restored from the store (finished, or lost in a restart)."""
    backend_session_id: str
    session_key: str = field(repr=False)
    group_id: str | None = None
    task_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    state: str = "open"
    """open | finalizing | done | failed"""
    error: str | None = None
    inflight: int = 0
    rewarded: bool = False
    """A reward was set through the service (``AgentSession`` reads it on exit)."""
    tokens: int = 0
    """Tokens counted from answers' ``usage`` (reconciled with the export at finalize)."""


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


class SessionPathApp:
    """ASGI wrapper: ``/s/{session_id}/rest`` is served as ``/rest`` for that session, so an
    agent that can only be given a base URL (any HTTP client, any language) names its session."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def __getattr__(self, name: str) -> Any:  # routes, state, ... of the wrapped app
        return getattr(self.app, name)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        prefix = routes.SERVICE_SESSION_PREFIX
        if scope.get("type") == "http" and scope.get("path", "").startswith(prefix):
            sid, slash, tail = scope["path"][len(prefix) :].partition("/")
            if sid and slash:
                path = "/" + tail
                headers = [h for h in scope["headers"] if h[0] != PATH_SESSION_HEADER.encode()]
                headers.append((PATH_SESSION_HEADER.encode(), sid.encode()))
                scope = {**scope, "path": path, "raw_path": path.encode(), "headers": headers}
        await self.app(scope, receive, send)


class Gateway:
    """State and logic of the gateway; ``app`` serves it. Runs on one event loop."""

    def __init__(
        self,
        config: ServiceConfig,
        *,
        backends: list[tuple[str, str]] | None = None,
        source: Any | None = None,
        discount: float = 1.0,
        export_style: str = "individual",
        keys: KeyStore | None = None,
        anonymous_sessions: bool = False,
        store: ServiceStore | None = None,
        max_new_tokens: int | None = None,
    ) -> None:
        self.config = config
        self.store = store if store is not None else open_store(config.store)
        configured = config.load_keys()
        self.keys = keys or KeyStore(
            configured,
            admin_key=config.admin_key,
            max_sessions_per_key=config.max_sessions_per_key,
            tokens_per_minute=config.tokens_per_minute,
            max_tokens=config.max_tokens_per_key,
            store=self.store,
            request_rate=config.request_rate(),
        )
        self.open_mode = not configured and keys is None
        if self.open_mode and not is_loopback(config.host):
            raise ValueError("refusing to serve a non-loopback address without user keys")
        lost = self.store.fail_open_sessions(config.instance, RESTARTED)
        if lost:
            logger.warning("%d sessions open at the last shutdown are failed (%s)", lost, RESTARTED)
        self.pool = BackendPool(failures_to_down=config.health_failures)
        for base_url, admin_key in backends or []:
            self.pool.add(base_url, admin_key)
        self.source = source
        self.discount = config.discount if config.discount is not None else discount
        self.export_style = config.export_style or export_style
        self.anonymous_sessions = anonymous_sessions
        self.max_new_tokens = max_new_tokens
        """Cap (and default) of every model call's completion length: the trainer's
        ``gconfig.max_new_tokens`` governs sampling, whatever an agent asks for."""
        self.sessions: dict[str, GatewaySession] = {}
        self.draining = False
        """Set on shutdown: new sessions get 503 + Retry-After; open ones may finish."""
        self.counters: dict[str, int] = {
            "sessions_started": 0,
            "sessions_finalized": 0,
            "sessions_failed": 0,
            "requests_forwarded": 0,
            "rejected_draining": 0,
            "rejected_quota": 0,
            "rejected_rate": 0,
        }
        self._http: httpx.AsyncClient | None = None
        self._pending: set[asyncio.Task] = set()
        self.app = SessionPathApp(self._build_app())

    # -- plumbing --------------------------------------------------------------------------

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(
                timeout=httpx.Timeout(
                    connect=5.0, read=self.config.request_timeout, write=60.0, pool=None
                ),
                limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
            )
        return self._http

    async def aclose(self) -> None:
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    def _background(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> None:
        """Run a blocking store call in a worker thread without waiting for it (state changes
        that need no answer: failures, usage)."""

        async def run() -> None:
            try:
                await asyncio.to_thread(fn, *args, **kw)
            except Exception as e:  # noqa: BLE001 - logged; the in-memory state is right
                logger.warning("service store write failed: %s", e)

        try:
            task = asyncio.get_running_loop().create_task(run())
        except RuntimeError:  # no loop (tests calling from a thread): write now
            fn(*args, **kw)
            return
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    @property
    def open_sessions(self) -> int:
        """Sessions not closed yet (read from other threads too: a snapshot of the values)."""
        return sum(1 for s in list(self.sessions.values()) if s.state in ("open", "finalizing"))

    async def _authenticate(self, request: Request) -> tuple[UserKey, str | None]:
        """The caller's key (→ user) and a session id carried in the key, if any."""
        token = request_key(request)
        user = self.keys.lookup(token)
        session_in_key = None
        if user is None and token and ":" in token:
            key, _, session_in_key = token.rpartition(":")
            user = self.keys.lookup(key)
            if user is None and not self.open_mode:
                user = await asyncio.to_thread(self.keys.reload, key)
            token = key
        elif user is None and token and not self.open_mode:
            user = await asyncio.to_thread(self.keys.reload, token)
        if user is None and self.open_mode:
            user = await asyncio.to_thread(self.keys.add, token or "anonymous")
        if user is None:
            raise ServiceError(
                401,
                "missing, invalid or revoked API key (send Authorization: Bearer <key>)",
            )
        return user, session_in_key or None

    async def _lookup(self, session_id: str) -> GatewaySession | None:
        """A session from memory, or (after a restart) from the store as a closed record."""
        sess = self.sessions.get(session_id)
        if sess is not None:
            return sess
        rec = await asyncio.to_thread(self.store.get_session, session_id)
        if rec is None:
            return None
        owner = next((u for u in self.keys.list() if u.digest == rec.key_digest), None)
        if owner is None:
            return None
        state = rec.state if rec.state in ("done", "failed") else "failed"
        sess = GatewaySession(
            id=rec.id,
            user=owner,
            backend=None,
            backend_session_id="",
            session_key="",
            group_id=rec.group_id,
            task_id=rec.task_id,
            metadata=rec.metadata,
            state=state,
            error=rec.error if state == rec.state else RESTARTED,
            rewarded=rec.rewarded,
        )
        self.sessions[rec.id] = sess  # a tombstone, expired like any other
        return sess

    async def _session(self, user: UserKey, session_id: str | None) -> GatewaySession:
        if not session_id:
            raise ServiceError(
                400,
                f"no session: send the {SESSION_HEADER} header, use the session URL "
                "'/s/<session_id>/v1' or the key '<api_key>:<session_id>'; create a session "
                "with POST /rl/v1/sessions (AgentSession does all of this)",
            )
        sess = await self._lookup(session_id)
        if sess is None or sess.user.digest != user.digest:
            raise ServiceError(404, f"unknown session {session_id!r}")
        if sess.state == "failed":
            # 410, not 503: the session is gone for good, and clients retry 503s
            raise ServiceError(
                410,
                f"session {session_id} has failed ({sess.error}); start a new session",
                code="session_ended",
            )
        if sess.state != "open":
            raise ServiceError(409, f"session {session_id} is already finalized")
        sess.last_used = time.monotonic()
        return sess

    def _session_id(
        self, request: Request, in_key: str | None, body: dict | None = None
    ) -> str | None:
        return (
            request.headers.get(SESSION_HEADER)
            or in_key
            or request.headers.get(PATH_SESSION_HEADER)
            or ((body or {}).get("session_id") if isinstance(body, dict) else None)
        )

    def _release(self, sess: GatewaySession, state: str, reason: str | None = None) -> None:
        """Close ``sess`` for good (``done`` or ``failed``): free its quota and backend slot."""
        if sess.state in ("done", "failed"):
            return
        sess.state = state
        sess.error = reason
        sess.last_used = time.monotonic()
        self.keys.release(sess.user)
        if sess.backend is not None:
            sess.backend.open_sessions = max(0, sess.backend.open_sessions - 1)

    def _fail_session(self, sess: GatewaySession, reason: str, *, retry: bool = True) -> None:
        """Fail ``sess``: excluded from training (the source counts it; its group waits on
        unless the client said it will not retry)."""
        if sess.state in ("done", "failed"):
            return
        self._release(sess, "failed", reason)
        self.counters["sessions_failed"] += 1
        self._background(self.store.update_session, sess.id, "failed", reason)
        if self.source is not None and hasattr(self.source, "put_failed"):
            self.source.put_failed(sess.group_id, reason, retry=retry)

    def _backend_down(self, backend: Backend, error: str, *, conclusive: bool) -> None:
        if self.pool.mark_failure(backend, error, conclusive=conclusive):
            reason = f"its backend {backend.name} went down"
            for sess in list(self.sessions.values()):
                if sess.backend is backend and sess.state in ("open", "finalizing"):
                    self._fail_session(sess, reason)

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
            self._backend_down(
                backend,
                f"{type(e).__name__} on {path}",
                conclusive=isinstance(e, httpx.ConnectError),
            )
            raise ServiceError(503, unreachable) from e

    async def _admin_post(self, backend: Backend, path: str, payload: dict) -> httpx.Response:
        unreachable = f"backend {backend.name} is unreachable"
        return await self._post(backend, path, payload, backend.admin_key, unreachable)

    async def _session_post(self, sess: GatewaySession, path: str, payload: dict) -> httpx.Response:
        backend = sess.backend
        assert backend is not None, "closed sessions have no backend"
        unreachable = f"the backend of session {sess.id} is unreachable"
        return await self._post(backend, path, payload, sess.session_key, unreachable)

    def _check_quota(self, user: UserKey) -> None:
        try:
            self.keys.check_tokens(user)
        except QuotaExceededError as e:
            self.counters["rejected_quota"] += 1
            raise ServiceError(429, str(e), retry_after=e.retry_after) from e

    def _check_rate(self, user: UserKey) -> None:
        """One model call against the key's request rate (``service.requests_per_second``)."""
        try:
            self.keys.check_rate(user)
        except QuotaExceededError as e:
            self.counters["rejected_rate"] += 1
            raise ServiceError(
                429, str(e), retry_after=e.retry_after, code="rate_limit_exceeded"
            ) from e

    def _count_tokens(self, sess: GatewaySession | None, user: UserKey, tokens: int) -> None:
        if tokens <= 0:
            return
        if sess is not None:
            sess.tokens += tokens
        self.keys.count_tokens(user, tokens, persist=False)  # the next call sees it at once
        self._background(self.keys.persist_tokens, user, tokens)

    # -- sessions --------------------------------------------------------------------------

    async def start_session(
        self,
        user: UserKey,
        *,
        group_id: str | None = None,
        task_id: str | None = None,
        metadata: dict | None = None,
        persist: bool = True,
    ) -> GatewaySession:
        if self.draining:
            self.counters["rejected_draining"] += 1
            raise ServiceError(
                503,
                "the service is shutting down and takes no new sessions; retry after it restarts",
                retry_after=self.config.drain_retry_after,
            )
        self._check_quota(user)
        try:
            self.keys.acquire(user)
        except QuotaExceededError as e:
            self.counters["rejected_quota"] += 1
            raise ServiceError(429, str(e), retry_after=e.retry_after) from e
        admitted = False
        try:
            admit = getattr(self.source, "admit", None)
            if admit is not None and getattr(self.source, "admission_control", False):
                if not await admit(self.config.admission_timeout):
                    raise ServiceError(
                        429,
                        "the trainer has enough rollouts in flight for its staleness bound; "
                        "retry after the next training step",
                        retry_after=5.0,
                    )
                admitted = True
            sess = await self._start_on_backend(user, group_id, task_id, metadata or {})
        except BaseException:
            self.keys.release(user)
            if admitted and self.source is not None:
                self.source.release_admission()
            raise
        if persist:
            rec = SessionRecord(
                id=sess.id,
                key_digest=user.digest,
                group_id=group_id,
                task_id=task_id,
                metadata=sess.metadata,
                state="open",
                owner=self.config.instance,
            )
            try:
                await asyncio.to_thread(self.store.put_session, rec)
            except BaseException:
                self._fail_session(sess, "could not record the session")
                raise
        return sess

    async def _start_on_backend(
        self, user: UserKey, group_id: str | None, task_id: str | None, metadata: dict
    ) -> GatewaySession:
        try:
            candidates = self.pool.candidates()
        except NoBackendError as e:
            raise ServiceError(503, str(e), retry_after=5.0) from e
        payload = {"group_id": group_id, "task_id": task_id, "metadata": metadata}
        last: ServiceError | None = None
        for backend in candidates:
            try:
                resp = await self._admin_post(backend, routes.START_SESSION, payload)
            except ServiceError as e:
                last = e
                continue
            if resp.status_code == 429:
                last = ServiceError(
                    429,
                    "no rollout capacity right now; retry later",
                    retry_after=5.0,
                )
                continue
            if resp.status_code >= 400:
                last = ServiceError(
                    502,
                    f"backend {backend.name} refused the session ({resp.status_code})",
                )
                continue
            data = resp.json()
            sess = GatewaySession(
                id="sess-" + secrets.token_urlsafe(16),
                user=user,
                backend=backend,
                backend_session_id=data["session_id"],
                session_key=data["api_key"],
                group_id=group_id,
                task_id=task_id,
                metadata=metadata,
            )
            backend.open_sessions += 1
            self.sessions[sess.id] = sess
            self.counters["sessions_started"] += 1
            logger.info(
                "session %s (key %s, group %s) on %s", sess.id, user.key_id, group_id, backend.name
            )
            return sess
        assert last is not None
        raise last

    async def set_reward(
        self, sess: GatewaySession, reward: float, completion_id: str | None
    ) -> dict:
        payload: dict[str, Any] = {"reward": float(reward)}
        if completion_id:
            payload["completion_id"] = completion_id
        resp = await self._session_post(sess, routes.SET_REWARD, payload)
        if resp.status_code >= 400:
            raise ServiceError(resp.status_code, _backend_message(resp))
        if not sess.rewarded:
            sess.rewarded = True
            await asyncio.to_thread(self.store.update_session, sess.id, rewarded=True)
        return {"session_id": sess.id, "completion_id": completion_id, "reward": float(reward)}

    async def finalize(
        self,
        sess: GatewaySession,
        final_reward: float | None,
        status: str,
        *,
        retry: bool = True,
    ) -> dict:
        """Reward, end, export and hand the trajectory to the source (or record a failure).

        The answer is 200 only once the trajectory is in the store: an acknowledged trajectory
        survives any restart."""
        sess.state = "finalizing"
        reason = "finalized as failed by the client"
        try:
            if status == "ok" and final_reward is not None:
                resp = await self._session_post(
                    sess, routes.SET_REWARD, {"reward": float(final_reward)}
                )
                if resp.status_code == 404:
                    status, reason = "failed", "the session made no completions"
                elif resp.status_code >= 400:
                    code = resp.status_code
                    raise ServiceError(code, _backend_message(resp))
            resp = await self._session_post(sess, routes.END_SESSION, {})
            if resp.status_code >= 400 and resp.status_code not in (409, 410):
                msg = f"ending the session failed: {_backend_message(resp)}"
                raise ServiceError(502, msg)
            if status != "ok":
                self._fail_session(sess, reason, retry=retry)
                return {"session_id": sess.id, "status": "failed", "reason": sess.error}
            assert sess.backend is not None
            payload: dict[str, Any] = {
                "session_id": sess.backend_session_id,
                "discount": self.discount,
                "style": self.export_style,
            }
            resp = await self._admin_post(sess.backend, routes.EXPORT_TRAJECTORIES, payload)
            if resp.status_code >= 400:
                raise ServiceError(502, f"export failed: {_backend_message(resp)}")
            export = resp.json()
            if not export.get("trajectories"):
                self._fail_session(sess, "the session made no completions", retry=retry)
                return {"session_id": sess.id, "status": "failed", "reason": sess.error}
            record = dict(
                export,
                session_id=sess.id,
                group_id=sess.group_id,
                task_id=sess.task_id,
                user=sess.user.key_id,
                metadata=sess.metadata,
                final_reward=final_reward,
                status="ok",
            )
            self._reconcile_tokens(sess, export)
            if self.source is not None:
                await self.source.aput(record, sess.group_id)  # durable before the 200
            else:
                await asyncio.to_thread(self.store.update_session, sess.id, "done")
        except BaseException as e:
            if sess.state == "finalizing":
                self._fail_session(sess, f"finalize failed: {e}")
            if _is_source_closed(e):
                raise ServiceError(
                    503,
                    "the service is shutting down and cannot keep this trajectory; "
                    "run the episode again after it restarts",
                    retry_after=self.config.drain_retry_after,
                ) from e
            raise
        self._release(sess, "done")
        self.counters["sessions_finalized"] += 1
        return {
            "session_id": sess.id,
            "status": "ok",
            "num_completions": len(export.get("interactions", [])),
            "num_rows": len(export["trajectories"]),
        }

    def _reconcile_tokens(self, sess: GatewaySession, export: dict) -> None:
        """Count the tokens the answers did not report (e.g. streams without usage)."""
        total = 0
        for it in export.get("interactions") or []:
            for name in ("num_prompt_tokens", "num_output_tokens"):
                value = it.get(name)
                if isinstance(value, int):
                    total += value
        if total > sess.tokens:
            self._count_tokens(sess, sess.user, total - sess.tokens)

    # -- forwarding ------------------------------------------------------------------------

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
            self._backend_down(
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
        self.counters["requests_forwarded"] += 1
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
                self._count_tokens(sess, user, tokens)
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
                self._backend_down(backend, f"stream broke: {type(e).__name__}", conclusive=False)
            finally:
                await done()

        return StreamingResponse(
            body_iter(),
            status_code=resp.status_code,
            headers=out_headers,
            background=BackgroundTask(done),
        )

    # -- maintenance -----------------------------------------------------------------------

    async def probe(self, backend: Backend) -> None:
        try:
            resp = await self.http.get(
                backend.base_url + routes.HEALTH, timeout=self.config.health_timeout
            )
            ok = resp.status_code == 200
            error = f"/health answered {resp.status_code}"
        except httpx.HTTPError as e:
            ok, error = False, f"/health: {type(e).__name__}"
        if ok:
            self.pool.mark_ok(backend)
        else:
            self._backend_down(backend, error, conclusive=False)

    def expire(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for sid, sess in list(self.sessions.items()):
            idle = now - sess.last_used
            if sess.state == "open" and sess.inflight == 0 and idle > self.config.session_ttl:
                self._fail_session(sess, f"idle for more than {self.config.session_ttl:.0f} s")
            elif sess.state in ("done", "failed") and idle > _TOMBSTONE_SECONDS:
                del self.sessions[sid]

    async def maintain(self) -> None:
        """Background task: probe every backend, expire idle sessions; until cancelled at
        stop (then pending store writes finish and the HTTP client closes)."""
        try:
            while True:
                await asyncio.gather(
                    *(self.probe(b) for b in self.pool.all()), return_exceptions=True
                )
                self.expire()
                await asyncio.sleep(self.config.health_interval)
        finally:
            await self.aclose()

    # -- HTTP ------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="areal-env any-agent training service", docs_url=None, redoc_url=None)
        gw = self

        install_error_handlers(app, self.counters)

        @app.exception_handler(ServiceError)
        async def _service_error(request: Request, exc: Exception) -> Response:
            assert isinstance(exc, ServiceError)
            return error_response(request.url.path, exc)  # Retry-After included

        async def json_body(request: Request) -> dict:
            try:
                return await read_json(request, empty_ok=True, object_only=True)
            except RecursionError:  # nested too deeply for the parser
                raise ServiceError(400, "body is not valid JSON: nested too deeply") from None

        def require_admin(request: Request) -> None:
            if not gw.keys.is_admin(request_key(request)):
                raise ServiceError(401, "admin key required")

        @app.get(routes.HEALTH)
        async def health() -> dict:
            healthy = len(gw.pool.healthy())
            status = "draining" if gw.draining else ("ok" if healthy else "degraded")
            return {"status": status, "backends_healthy": healthy}

        @app.post(routes.SERVICE_SESSIONS)
        async def create_session(request: Request) -> dict:
            user, _ = await gw._authenticate(request)
            body = await json_body(request)
            group_id = body.get("group_id")
            task_id = body.get("task_id")
            metadata = body.get("metadata") or {}
            for name, value in (("group_id", group_id), ("task_id", task_id)):
                if value is not None and not isinstance(value, str):
                    raise ServiceError(400, f"{name} must be a string")
            if not isinstance(metadata, dict):
                raise ServiceError(400, "metadata must be an object")
            sess = await gw.start_session(
                user, group_id=group_id, task_id=task_id, metadata=metadata
            )
            return {"session_id": sess.id, "group_id": group_id, "task_id": task_id}

        async def describe_session(session_id: str, request: Request) -> dict:
            user, _ = await gw._authenticate(request)
            sess = await gw._lookup(session_id)
            if sess is None or sess.user.digest != user.digest:
                raise ServiceError(404, f"unknown session {session_id!r}")
            return {
                "session_id": sess.id,
                "state": sess.state,
                "error": sess.error,
                "rewarded": sess.rewarded,
                "group_id": sess.group_id,
                "task_id": sess.task_id,
            }

        @app.get(routes.SERVICE_SESSIONS + "/{session_id}")
        async def session_status(session_id: str, request: Request) -> dict:
            return await describe_session(session_id, request)

        @app.get(routes.SERVICE_SESSION)
        async def this_session(request: Request) -> dict:
            """The session named by the header, key or ``/s/{id}`` URL."""
            user, in_key = await gw._authenticate(request)
            sid = gw._session_id(request, in_key)
            if not sid:
                raise ServiceError(400, "no session named")
            return await describe_session(sid, request)

        @app.post(routes.SERVICE_SET_REWARD)
        async def set_reward(request: Request) -> dict:
            user, in_key = await gw._authenticate(request)
            body = await json_body(request)
            sess = await gw._session(user, gw._session_id(request, in_key, body))
            reward = _reward(body.get("reward"), "reward", required=True)
            assert reward is not None  # required=True refuses a missing reward
            completion_id = body.get("completion_id") or body.get("interaction_id")
            return await gw.set_reward(sess, reward, completion_id)

        @app.post(routes.SERVICE_FINALIZE)
        async def finalize(request: Request) -> dict:
            user, in_key = await gw._authenticate(request)
            body = await json_body(request)
            sid = gw._session_id(request, in_key, body)
            status = body.get("status", "ok")
            if status not in ("ok", "failed"):
                raise ServiceError(400, "status must be 'ok' or 'failed'")
            retry = body.get("retry", True)
            if not isinstance(retry, bool):
                raise ServiceError(400, "retry must be true or false")
            final_reward = _reward(body.get("final_reward"), "final_reward", required=False)
            existing = await gw._lookup(sid) if sid else None
            if (
                existing is not None
                and existing.user.digest == user.digest
                and existing.state == "failed"
                and status == "failed"
            ):
                if not retry and gw.source is not None and hasattr(gw.source, "abandon"):
                    gw.source.abandon(existing.group_id)
                return {"session_id": sid, "status": "failed", "reason": existing.error}
            sess = await gw._session(user, sid)
            return await gw.finalize(sess, final_reward, status, retry=retry)

        @app.post(routes.SERVICE_KEYS)
        async def issue_key(request: Request) -> dict:
            require_admin(request)
            body = await json_body(request)
            limits: dict[str, int | None] = {}
            for name in ("max_sessions", "tokens_per_minute", "max_tokens"):
                value = body.get(name)
                if value is not None and (
                    isinstance(value, bool) or not isinstance(value, int) or value < 1
                ):
                    raise ServiceError(400, f"{name} must be a positive integer")
                limits[name] = value
            key_name = body.get("name")
            if key_name is not None and not isinstance(key_name, str):
                raise ServiceError(400, "name must be a string")
            key, user = await asyncio.to_thread(gw.keys.issue, name=key_name, **limits)
            logger.info("issued user key %s (%s)", user.key_id, user.name or "unnamed")
            return {"api_key": key, **user.describe()}

        @app.get(routes.SERVICE_KEYS)
        async def list_keys(request: Request) -> dict:
            require_admin(request)
            return {"keys": [u.describe() for u in gw.keys.list()]}

        @app.delete(routes.SERVICE_KEYS + "/{key_id}")
        async def revoke_key(key_id: str, request: Request) -> dict:
            require_admin(request)
            user = await asyncio.to_thread(gw.keys.revoke, key_id)
            if user is None:
                raise ServiceError(404, f"unknown key {key_id!r}")
            logger.info("revoked user key %s", key_id)
            return user.describe()

        @app.get(routes.SERVICE_STATUS)
        async def admin_status(request: Request) -> dict:
            require_admin(request)
            states: dict[str, int] = {}
            for s in gw.sessions.values():
                states[s.state] = states.get(s.state, 0) + 1
            out = {
                "draining": gw.draining,
                "backends": [b.describe() for b in gw.pool.all()],
                "sessions": states,
                "counters": dict(gw.counters),
                "keys": [u.describe() for u in gw.keys.list()],
            }
            describe = getattr(gw.source, "describe", None)
            if describe is not None:
                out["trajectories"] = describe()
            return out

        @app.api_route("/v1/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
        async def model_call(path: str, request: Request) -> Response:
            user, in_key = await gw._authenticate(request)
            sid = gw._session_id(request, in_key)
            if sid is None and (
                path == "models" or path.startswith("models/") or gw.anonymous_sessions
            ):
                return await gw.forward_sessionless(request, user)
            sess = await gw._session(user, sid)
            gw._check_quota(user)
            gw._check_rate(user)
            if sess.backend is None or not sess.backend.healthy:
                gw._fail_session(sess, "its backend went down")
                await gw._session(user, sid)  # raises the 503
            assert sess.backend is not None
            return await gw.forward(request, sess, sess.backend, sess.session_key, user=user)

        return app

    async def forward_sessionless(self, request: Request, user: UserKey) -> Response:
        """``/v1/models`` without a session, or inference-only serving (one session per call)."""
        if not self.anonymous_sessions:
            try:
                backend = self.pool.candidates()[0]
            except NoBackendError as e:
                raise ServiceError(503, str(e)) from e
            return await self.forward(request, None, backend, backend.admin_key)
        self._check_rate(user)
        self._check_quota(user)
        sess = await self.start_session(user, persist=False)

        async def close() -> None:
            try:
                await self._session_post(sess, routes.END_SESSION, {})
            except ServiceError:
                pass
            self._release(sess, "done")  # inference only: never trained on
            self.sessions.pop(sess.id, None)

        assert sess.backend is not None  # a started session has its backend
        try:
            return await self.forward(
                request, sess, sess.backend, sess.session_key, on_close=close, user=user
            )
        except BaseException:
            self._release(sess, "failed", "request failed")
            self.sessions.pop(sess.id, None)
            raise


def _is_source_closed(exc: BaseException) -> bool:
    return type(exc).__name__ == "SourceClosedError"


def _reward(value: Any, name: str, *, required: bool) -> float | None:
    if value is None:
        if required:
            raise ServiceError(400, f"{name} is required")
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ServiceError(400, f"{name} must be a number")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise ServiceError(400, f"{name} must be finite")
    return value


def _backend_message(resp: httpx.Response) -> str:
    try:
        data = resp.json()
    except ValueError:
        return f"backend answered {resp.status_code}"
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])
    if isinstance(data, dict) and data.get("detail"):
        return str(data["detail"])
    return f"backend answered {resp.status_code}"


class PortInUseError(OSError):
    """The configured port is taken (found before anything heavy is loaded)."""


def _port_in_use(host: str, port: int, e: OSError) -> PortInUseError:
    return PortInUseError(
        e.errno,
        f"cannot listen on {host}:{port} ({e.strerror}): another program uses the port; "
        "choose another with --port N or service.port=N (0 = any free port)",
    )


def check_port(host: str, port: int) -> None:
    """Raise ``PortInUseError`` now if ``host:port`` cannot be bound (port 0 always can)."""
    if port == 0:
        return
    try:
        bind_socket(host, port).close()
    except OSError as e:
        if e.errno in (errno.EADDRINUSE, errno.EACCES):
            raise _port_in_use(host, port, e) from e
        raise


class GatewayServer:
    """Runs a ``Gateway`` in the toolkit's ``ServerThread`` (uvicorn, its own event loop)."""

    def __init__(self, config: ServiceConfig | None = None, **options: Any) -> None:
        """``options``: ``Gateway``'s keyword arguments (backends, source, store, ...)."""
        self.config = config or ServiceConfig()
        self.gateway = Gateway(self.config, **options)
        self._server: ServerThread | None = None
        self.port: int | None = None

    @property
    def app(self) -> Any:
        return self.gateway.app

    @property
    def admin_key(self) -> str:
        return self.gateway.keys.admin_key

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RuntimeError("the gateway is not started")
        return f"{self.config.scheme}://{url_host(self.config.host)}:{self.port}"

    def add_backend(self, base_url: str, admin_key: str, name: str | None = None) -> Backend:
        return self.gateway.pool.add(base_url, admin_key, name)

    def check_port(self) -> GatewayServer:
        """Fail now (``PortInUseError``) if the configured port is taken."""
        check_port(self.config.host, self.config.port)
        return self

    def drain(self) -> None:
        """Take no new sessions (503 + Retry-After); open ones may finish. Any thread."""
        self.gateway.draining = True

    @property
    def open_sessions(self) -> int:
        return self.gateway.open_sessions

    def start(self, timeout: float = 30.0) -> GatewayServer:
        self._server = ServerThread(
            self.app,
            self.config.host,
            self.config.port,
            name="gateway",
            scheme=self.config.scheme,
            background=self.gateway.maintain,
            ssl_keyfile=self.config.ssl_keyfile,
            ssl_certfile=self.config.ssl_certfile,
        )
        try:
            self._server.start(timeout)
        except OSError as e:
            self._server = None
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                raise _port_in_use(self.config.host, self.config.port, e) from e
            raise
        self.port = self._server.port
        logger.info("gateway listening at %s", self.base_url)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._server is not None:
            self._server.stop(timeout)
            self._server = None

    def __enter__(self) -> GatewayServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
