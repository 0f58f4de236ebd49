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
import logging
import secrets
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response

from areal_env.api.service_config import ServiceConfig
from areal_env.api.source import SourceClosedError
from areal_env.http import routes
from areal_env.http.net import bind_socket, url_host
from areal_env.http.runner import ServerThread
from areal_env.service.auth import KeyStore, QuotaExceededError, UserKey
from areal_env.service.backends import Backend, NoBackendError
from areal_env.service.forwarding import Forwarder
from areal_env.service.gateway_routes import build_app
from areal_env.service.sessions import (
    GatewaySession,
    ServiceError,
    SessionBook,
    SessionPathApp,
)
from areal_env.service.source import GroupClosedError
from areal_env.service.store import ServiceStore, SessionRecord

logger = logging.getLogger(__name__)


class Gateway:
    """The gateway: the RL session calls (start, reward, finalize) over its parts, the state
    and bookkeeping (``book``, a ``SessionBook``), the calls to the backends (``forwarder``, a
    ``Forwarder``) and the HTTP app serving them (``app``, ``gateway_routes.build_app``)."""

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
        """``discount``, ``export_style``: the rollout's (``service.discount`` and
        ``service.export_style`` win when set); ``anonymous_sessions``: inference-only serving
        (a model call without a session runs in a throwaway one); ``max_new_tokens``: the cap
        of every model call's completion length."""
        self.config = config
        self.book = SessionBook(config, backends=backends, source=source, keys=keys, store=store)
        self.forwarder = Forwarder(self.book, max_new_tokens=max_new_tokens)
        self.discount = config.discount if config.discount is not None else discount
        self.export_style = config.export_style or export_style
        self.anonymous_sessions = anonymous_sessions
        self.app = SessionPathApp(build_app(self))

    async def maintain(self) -> None:
        """Background task: probe every backend, expire idle sessions; until cancelled at
        stop (then pending store writes finish and the HTTP client closes)."""
        try:
            while True:
                await asyncio.gather(
                    *(self.forwarder.probe(b) for b in self.book.pool.all()),
                    return_exceptions=True,
                )
                self.book.expire()
                await asyncio.sleep(self.config.health_interval)
        finally:
            await self.book.flush()
            await self.forwarder.aclose()

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
        if self.book.draining:
            raise self._refusal_while_stopping()
        self.book.check_quota(user)
        try:
            self.book.keys.acquire(user)
        except QuotaExceededError as e:
            self.book.counters["rejected_quota"] += 1
            raise ServiceError(429, str(e), retry_after=e.retry_after) from e
        admitted = False
        try:
            admit = getattr(self.book.source, "admit", None)
            if admit is not None:
                try:
                    ok = await admit(group_id, self.config.admission_timeout)
                except SourceClosedError as e:  # woken by the shutdown while it waited
                    raise self._refusal_while_stopping() from e
                except GroupClosedError as e:
                    raise ServiceError(409, str(e), code="group_closed") from e
                if not ok:
                    raise ServiceError(
                        429,
                        "the trainer has enough rollouts in flight for its staleness bound; "
                        "retry after the next training step",
                        retry_after=5.0,
                    )
                admitted = True
            sess = await self._start_on_backend(user, group_id, task_id, metadata or {})
        except BaseException:
            self.book.keys.release(user)
            if admitted and self.book.source is not None:
                self.book.source.release_admission(group_id)
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
                await asyncio.to_thread(self.book.store.put_session, rec)
            except BaseException:
                self.book.fail_session(sess, "could not record the session")
                raise
        return sess

    def _refusal_while_stopping(self) -> ServiceError:
        """The answer to a session request once the service stops: 503 + Retry-After while it
        will restart (a drain), 410 ``training_finished`` once training is over."""
        self.book.counters["rejected_draining"] += 1
        if self.book.finished is not None:
            return ServiceError(
                410,
                f"training is finished ({self.book.finished}): this service starts no more sessions",
                code="training_finished",
            )
        return ServiceError(
            503,
            "the service is shutting down and takes no new sessions; retry after it restarts",
            retry_after=self.config.drain_retry_after,
        )

    async def _start_on_backend(
        self, user: UserKey, group_id: str | None, task_id: str | None, metadata: dict
    ) -> GatewaySession:
        try:
            candidates = self.book.pool.candidates()
        except NoBackendError as e:
            raise ServiceError(503, str(e), retry_after=5.0) from e
        payload = {"group_id": group_id, "task_id": task_id, "metadata": metadata}
        last: ServiceError | None = None
        for backend in candidates:
            try:
                resp = await self.forwarder.admin_post(backend, routes.START_SESSION, payload)
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
            self.book.add(sess)
            logger.info(
                "session %s (key %s, group %s) on %s", sess.id, user.key_id, group_id, backend.name
            )
            return sess
        assert last is not None
        raise last

    async def set_reward(
        self, sess: GatewaySession, reward: float, completion_id: str | None, *, train: bool = True
    ) -> dict:
        payload: dict[str, Any] = {"reward": float(reward)}
        if completion_id:
            payload["completion_id"] = completion_id
        if not train:
            payload["train"] = False
        resp = await self.forwarder.session_post(sess, routes.SET_REWARD, payload)
        if resp.status_code >= 400:
            raise ServiceError(resp.status_code, _backend_message(resp))
        if not sess.rewarded:
            sess.rewarded = True
            await asyncio.to_thread(self.book.store.update_session, sess.id, rewarded=True)
        return {
            "session_id": sess.id,
            "completion_id": completion_id,
            "reward": float(reward),
            "train": train,
        }

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
        if self.book.finished is not None and status == "ok":
            # The last step has taken its batch: a trajectory stored now would never be trained.
            self.book.fail_session(sess, "training is finished", retry=False)
            raise ServiceError(
                410,
                f"training is finished ({self.book.finished}): this trajectory will not be trained",
                code="training_finished",
            )
        sess.state = "finalizing"
        reason = "finalized as failed by the client"
        try:
            if status == "ok" and final_reward is not None:
                resp = await self.forwarder.session_post(
                    sess, routes.SET_REWARD, {"reward": float(final_reward)}
                )
                if resp.status_code == 404:
                    status, reason = "failed", "the session made no completions"
                elif resp.status_code >= 400:
                    code = resp.status_code
                    raise ServiceError(code, _backend_message(resp))
                elif not sess.rewarded:
                    sess.rewarded = True
                    await asyncio.to_thread(self.book.store.update_session, sess.id, rewarded=True)
            resp = await self.forwarder.session_post(sess, routes.END_SESSION, {})
            if resp.status_code >= 400 and resp.status_code not in (409, 410):
                msg = f"ending the session failed: {_backend_message(resp)}"
                raise ServiceError(502, msg)
            if status != "ok":
                self.book.fail_session(sess, reason, retry=retry)
                return {"session_id": sess.id, "status": "failed", "reason": sess.error}
            assert sess.backend is not None
            payload: dict[str, Any] = {
                "session_id": sess.backend_session_id,
                "discount": self.discount,
                "style": self.export_style,
            }
            resp = await self.forwarder.admin_post(
                sess.backend, routes.EXPORT_TRAJECTORIES, payload
            )
            if resp.status_code >= 400:
                raise ServiceError(502, f"export failed: {_backend_message(resp)}")
            export = resp.json()
            if not export.get("trajectories"):
                self.book.fail_session(sess, "the session made no completions", retry=retry)
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
            if self.book.source is not None:
                await self.book.source.aput(record, sess.group_id)  # durable before the 200
            else:
                await asyncio.to_thread(self.book.store.update_session, sess.id, "done")
        except GroupClosedError as e:
            self.book.fail_session(sess, str(e), retry=False)
            raise ServiceError(409, str(e), code="group_closed") from e
        except BaseException as e:
            if sess.state == "finalizing":
                self.book.fail_session(sess, f"finalize failed: {e}")
            if isinstance(e, SourceClosedError):
                raise ServiceError(
                    503,
                    "the service is shutting down and cannot keep this trajectory; "
                    "run the episode again after it restarts",
                    retry_after=self.config.drain_retry_after,
                ) from e
            raise
        self.book.release(sess, "done")
        self.book.counters["sessions_finalized"] += 1
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
            self.book.count_tokens(sess, sess.user, total - sess.tokens)

    # -- forwarding ------------------------------------------------------------------------
    async def forward_sessionless(self, request: Request, user: UserKey) -> Response:
        """``/v1/models`` without a session, or inference-only serving (one session per call)."""
        if not self.anonymous_sessions:
            try:
                backend = self.book.pool.candidates()[0]
            except NoBackendError as e:
                raise ServiceError(503, str(e)) from e
            return await self.forwarder.forward(request, None, backend, backend.admin_key)
        self.book.check_rate(user)
        self.book.check_quota(user)
        sess = await self.start_session(user, persist=False)

        async def close() -> None:
            try:
                await self.forwarder.session_post(sess, routes.END_SESSION, {})
            except ServiceError:
                pass
            self.book.release(sess, "done")  # inference only: never trained on
            self.book.sessions.pop(sess.id, None)

        assert sess.backend is not None  # a started session has its backend
        try:
            return await self.forwarder.forward(
                request, sess, sess.backend, sess.session_key, on_close=close, user=user
            )
        except BaseException:
            self.book.release(sess, "failed", "request failed")
            self.book.sessions.pop(sess.id, None)
            raise


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
        return self.gateway.book.keys.admin_key

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RuntimeError("the gateway is not started")
        return f"{self.config.scheme}://{url_host(self.config.host)}:{self.port}"

    def add_backend(self, base_url: str, admin_key: str, name: str | None = None) -> Backend:
        return self.gateway.book.pool.add(base_url, admin_key, name)

    def check_port(self) -> GatewayServer:
        """Fail now (``PortInUseError``) if the configured port is taken."""
        check_port(self.config.host, self.config.port)
        return self

    def drain(self, finished: str | None = None) -> None:
        """Take no new sessions (503 + Retry-After; with ``finished``, the reason training is
        over: 410 ``training_finished``); open ones may finish. Any thread."""
        if finished is not None:
            self.gateway.book.finished = finished
        self.gateway.book.draining = True

    @property
    def open_sessions(self) -> int:
        return self.gateway.book.open_sessions

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
