"""The gateway's session bookkeeping: who a caller is, which session a call names, the
sessions' states, backend health, quotas, and the durable store writes behind them.

``SessionBook`` is the gateway's state, shared by its parts: ``Gateway`` (``gateway.py``) runs
the RL session calls on it, ``Forwarder`` (``forwarding.py``) the calls to the backends, and
``gateway_routes.py`` the HTTP app. The book makes no HTTP calls itself. Every store call runs in
a worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from areal_env_client import SESSION_HEADER
from fastapi import Request

from areal_env.api.service_config import ServiceConfig
from areal_env.http import routes
from areal_env.http.body import request_key
from areal_env.http.errors import HTTPError
from areal_env.http.net import is_loopback
from areal_env.service.auth import KeyStore, QuotaExceededError, UserKey
from areal_env.service.backends import Backend, BackendPool
from areal_env.service.store import ServiceStore, open_store

logger = logging.getLogger(__name__)

_TOMBSTONE_SECONDS = 600.0
PATH_SESSION_HEADER = "x-areal-path-session"
"""Set by ``SessionPathApp`` from ``/s/{id}/...`` URLs (never forwarded)."""
RESTARTED = "the service restarted while the session was open; start a new session"


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


class SessionBook:
    """State and bookkeeping of the gateway: the user keys, the sessions and their states, the
    backend pool, the counters, the durable store and the trajectory source. Runs on one event
    loop; the gateway's parts hold it and change it only through it."""

    def __init__(
        self,
        config: ServiceConfig,
        *,
        backends: list[tuple[str, str]] | None = None,
        source: Any | None = None,
        keys: KeyStore | None = None,
        store: ServiceStore | None = None,
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
        self.sessions: dict[str, GatewaySession] = {}
        self.draining = False
        """Set on shutdown: new sessions get 503 + Retry-After; open ones may finish."""
        self.finished: str | None = None
        """Set when training is over (why): new sessions get 410 ``training_finished``."""
        self.counters: dict[str, int] = {
            "sessions_started": 0,
            "sessions_finalized": 0,
            "sessions_failed": 0,
            "requests_forwarded": 0,
            "rejected_draining": 0,
            "rejected_quota": 0,
            "rejected_rate": 0,
        }
        self._pending: set[asyncio.Task] = set()

    # -- store writes ----------------------------------------------------------------------

    async def flush(self) -> None:
        """Wait for the store writes still running in the background (at stop)."""
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)

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

    # -- callers and sessions --------------------------------------------------------------

    @property
    def open_sessions(self) -> int:
        """Sessions not closed yet (read from other threads too: a snapshot of the values)."""
        return sum(1 for s in list(self.sessions.values()) if s.state in ("open", "finalizing"))

    async def authenticate(self, request: Request) -> tuple[UserKey, str | None]:
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

    async def lookup(self, session_id: str) -> GatewaySession | None:
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

    async def active_session(self, user: UserKey, session_id: str | None) -> GatewaySession:
        """``user``'s open session ``session_id``; the error a client can act on otherwise
        (400 none named, 404 unknown, 410 failed, 409 finalized)."""
        if not session_id:
            raise ServiceError(
                400,
                f"no session: send the {SESSION_HEADER} header, use the session URL "
                "'/s/<session_id>/v1' or the key '<api_key>:<session_id>'; create a session "
                "with POST /rl/v1/sessions (AgentSession does all of this)",
            )
        sess = await self.lookup(session_id)
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

    @staticmethod
    def session_id_of(request: Request, in_key: str | None, body: dict | None = None) -> str | None:
        """The session a call names: header, key suffix, ``/s/{id}`` URL or body field."""
        return (
            request.headers.get(SESSION_HEADER)
            or in_key
            or request.headers.get(PATH_SESSION_HEADER)
            or ((body or {}).get("session_id") if isinstance(body, dict) else None)
        )

    def add(self, sess: GatewaySession) -> None:
        """Book a session just started on its backend."""
        assert sess.backend is not None, "a started session has its backend"
        sess.backend.open_sessions += 1
        self.sessions[sess.id] = sess
        self.counters["sessions_started"] += 1

    def release(self, sess: GatewaySession, state: str, reason: str | None = None) -> None:
        """Close ``sess`` for good (``done`` or ``failed``): free its quota and backend slot."""
        if sess.state in ("done", "failed"):
            return
        sess.state = state
        sess.error = reason
        sess.last_used = time.monotonic()
        self.keys.release(sess.user)
        if sess.backend is not None:
            sess.backend.open_sessions = max(0, sess.backend.open_sessions - 1)

    def fail_session(self, sess: GatewaySession, reason: str, *, retry: bool = True) -> None:
        """Fail ``sess``: excluded from training (the source counts it; its group waits on
        unless the client said it will not retry)."""
        if sess.state in ("done", "failed"):
            return
        self.release(sess, "failed", reason)
        self.counters["sessions_failed"] += 1
        self._background(self.store.update_session, sess.id, "failed", reason)
        if self.source is not None and hasattr(self.source, "put_failed"):
            self.source.put_failed(sess.group_id, reason, retry=retry)

    def backend_down(self, backend: Backend, error: str, *, conclusive: bool) -> None:
        """Count a failure of ``backend``; once it is down, its open sessions fail."""
        if self.pool.mark_failure(backend, error, conclusive=conclusive):
            reason = f"its backend {backend.name} went down"
            for sess in list(self.sessions.values()):
                if sess.backend is backend and sess.state in ("open", "finalizing"):
                    self.fail_session(sess, reason)

    # -- quotas ----------------------------------------------------------------------------

    def check_quota(self, user: UserKey) -> None:
        try:
            self.keys.check_tokens(user)
        except QuotaExceededError as e:
            self.counters["rejected_quota"] += 1
            raise ServiceError(429, str(e), retry_after=e.retry_after) from e

    def check_rate(self, user: UserKey) -> None:
        """One model call against the key's request rate (``service.requests_per_second``)."""
        try:
            self.keys.check_rate(user)
        except QuotaExceededError as e:
            self.counters["rejected_rate"] += 1
            raise ServiceError(
                429, str(e), retry_after=e.retry_after, code="rate_limit_exceeded"
            ) from e

    def count_tokens(self, sess: GatewaySession | None, user: UserKey, tokens: int) -> None:
        if tokens <= 0:
            return
        if sess is not None:
            sess.tokens += tokens
        self.keys.count_tokens(user, tokens, persist=False)  # the next call sees it at once
        self._background(self.keys.persist_tokens, user, tokens)

    # -- maintenance -----------------------------------------------------------------------

    def expire(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for sid, sess in list(self.sessions.items()):
            idle = now - sess.last_used
            if sess.state == "open" and sess.inflight == 0 and idle > self.config.session_ttl:
                self.fail_session(sess, f"idle for more than {self.config.session_ttl:.0f} s")
            elif sess.state in ("done", "failed") and idle > _TOMBSTONE_SECONDS:
                del self.sessions[sid]
