"""The gateway's HTTP app: health, the RL session routes (``/rl/v1/...``), the admin routes
(keys, status) and the model calls (``/v1/...``, forwarded to the session's backend).

Routes only parse and check requests; the work is the ``Gateway``'s and its parts'.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from areal_env.http import routes
from areal_env.http.body import read_json, request_key
from areal_env.http.errors import error_response, install_error_handlers
from areal_env.service.sessions import ServiceError

if TYPE_CHECKING:
    from areal_env.service.gateway import Gateway

logger = logging.getLogger(__name__)


def build_app(gw: Gateway) -> FastAPI:
    """The FastAPI app serving ``gw`` (routes registered in the order they are matched)."""
    app = FastAPI(title="areal-env any-agent training service", docs_url=None, redoc_url=None)
    install_error_handlers(app, gw.book.counters)

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ServiceError)
        return error_response(request.url.path, exc)  # Retry-After included

    @app.get(routes.HEALTH)
    async def health() -> dict:
        healthy = len(gw.book.pool.healthy())
        status = "draining" if gw.book.draining else ("ok" if healthy else "degraded")
        return {"status": status, "backends_healthy": healthy}

    _session_routes(app, gw)
    _admin_routes(app, gw)
    _model_routes(app, gw)
    return app


async def _json_body(request: Request) -> dict:
    try:
        return await read_json(request, empty_ok=True, object_only=True)
    except RecursionError:  # nested too deeply for the parser
        raise ServiceError(400, "body is not valid JSON: nested too deeply") from None


def _require_admin(gw: Gateway, request: Request) -> None:
    if not gw.book.keys.is_admin(request_key(request)):
        raise ServiceError(401, "admin key required")


def _session_routes(app: FastAPI, gw: Gateway) -> None:
    """``/rl/v1/sessions``, the session's status, rewards and finalize."""

    @app.post(routes.SERVICE_SESSIONS)
    async def create_session(request: Request) -> dict:
        user, _ = await gw.book.authenticate(request)
        body = await _json_body(request)
        group_id = body.get("group_id")
        task_id = body.get("task_id")
        metadata = body.get("metadata") or {}
        for name, value in (("group_id", group_id), ("task_id", task_id)):
            if value is not None and not isinstance(value, str):
                raise ServiceError(400, f"{name} must be a string")
        if not isinstance(metadata, dict):
            raise ServiceError(400, "metadata must be an object")
        sess = await gw.start_session(user, group_id=group_id, task_id=task_id, metadata=metadata)
        return {"session_id": sess.id, "group_id": group_id, "task_id": task_id}

    async def describe_session(session_id: str, request: Request) -> dict:
        user, _ = await gw.book.authenticate(request)
        sess = await gw.book.lookup(session_id)
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
        user, in_key = await gw.book.authenticate(request)
        sid = gw.book.session_id_of(request, in_key)
        if not sid:
            raise ServiceError(400, "no session named")
        return await describe_session(sid, request)

    @app.post(routes.SERVICE_SET_REWARD)
    async def set_reward(request: Request) -> dict:
        user, in_key = await gw.book.authenticate(request)
        body = await _json_body(request)
        unknown = sorted(set(body) - {"reward", "completion_id", "session_id", "train"})
        if unknown:  # a misspelt id would otherwise reward the last completion instead
            raise ServiceError(
                400,
                f"unknown field {unknown[0]!r}: set_reward takes 'reward', 'completion_id', "
                "'train' and 'session_id'",
            )
        sess = await gw.book.active_session(user, gw.book.session_id_of(request, in_key, body))
        reward = _reward(body.get("reward"), "reward", required=True)
        assert reward is not None  # required=True refuses a missing reward
        train = body.get("train", True)
        if not isinstance(train, bool):
            raise ServiceError(400, "'train' must be true or false")
        completion_id = body.get("completion_id")
        return await gw.set_reward(sess, reward, completion_id, train=train)

    @app.post(routes.SERVICE_FINALIZE)
    async def finalize(request: Request) -> dict:
        user, in_key = await gw.book.authenticate(request)
        body = await _json_body(request)
        sid = gw.book.session_id_of(request, in_key, body)
        status = body.get("status", "ok")
        if status not in ("ok", "failed"):
            raise ServiceError(400, "status must be 'ok' or 'failed'")
        retry = body.get("retry", True)
        if not isinstance(retry, bool):
            raise ServiceError(400, "retry must be true or false")
        final_reward = _reward(body.get("final_reward"), "final_reward", required=False)
        existing = await gw.book.lookup(sid) if sid else None
        if (
            existing is not None
            and existing.user.digest == user.digest
            and existing.state == "failed"
            and status == "failed"
        ):
            if not retry and gw.book.source is not None and hasattr(gw.book.source, "abandon"):
                gw.book.source.abandon(existing.group_id)
            return {"session_id": sid, "status": "failed", "reason": existing.error}
        sess = await gw.book.active_session(user, sid)
        return await gw.finalize(sess, final_reward, status, retry=retry)


def _admin_routes(app: FastAPI, gw: Gateway) -> None:
    """Key issue/list/revoke and the status page (admin key only)."""

    @app.post(routes.SERVICE_KEYS)
    async def issue_key(request: Request) -> dict:
        _require_admin(gw, request)
        body = await _json_body(request)
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
        key, user = await asyncio.to_thread(gw.book.keys.issue, name=key_name, **limits)
        logger.info("issued user key %s (%s)", user.key_id, user.name or "unnamed")
        return {"api_key": key, **user.describe()}

    @app.get(routes.SERVICE_KEYS)
    async def list_keys(request: Request) -> dict:
        _require_admin(gw, request)
        return {"keys": [u.describe() for u in gw.book.keys.list()]}

    @app.delete(routes.SERVICE_KEYS + "/{key_id}")
    async def revoke_key(key_id: str, request: Request) -> dict:
        _require_admin(gw, request)
        user = await asyncio.to_thread(gw.book.keys.revoke, key_id)
        if user is None:
            raise ServiceError(404, f"unknown key {key_id!r}")
        logger.info("revoked user key %s", key_id)
        return user.describe()

    @app.get(routes.SERVICE_STATUS)
    async def admin_status(request: Request) -> dict:
        _require_admin(gw, request)
        states: dict[str, int] = {}
        for s in gw.book.sessions.values():
            states[s.state] = states.get(s.state, 0) + 1
        out = {
            "draining": gw.book.draining,
            "backends": [b.describe() for b in gw.book.pool.all()],
            "sessions": states,
            "counters": dict(gw.book.counters),
            "keys": [u.describe() for u in gw.book.keys.list()],
        }
        describe = getattr(gw.book.source, "describe", None)
        if describe is not None:
            out["trajectories"] = describe()
        return out


def _model_routes(app: FastAPI, gw: Gateway) -> None:
    """``/v1/...``: model calls, forwarded to the backend owning the session."""

    @app.api_route("/v1/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def model_call(path: str, request: Request) -> Response:
        user, in_key = await gw.book.authenticate(request)
        sid = gw.book.session_id_of(request, in_key)
        if sid is None and (
            path == "models" or path.startswith("models/") or gw.anonymous_sessions
        ):
            return await gw.forward_sessionless(request, user)
        sess = await gw.book.active_session(user, sid)
        gw.book.check_quota(user)
        gw.book.check_rate(user)
        if sess.backend is None or not sess.backend.healthy:
            gw.book.fail_session(sess, "its backend went down")
            await gw.book.active_session(user, sid)  # raises the 503
        assert sess.backend is not None
        return await gw.forwarder.forward(request, sess, sess.backend, sess.session_key, user=user)


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
