"""The proxy's FastAPI app: the routes around the shared pipeline (``proxy/pipeline.py``).

One route per wire protocol (each an object in ``proxy/protocols/``), the model-info routes and
the RL control routes. Bodies are parsed and validated by hand instead of through pydantic
models: clients send many fields we ignore, and every failure must come back as a 400 in the
protocol's own error format (never FastAPI's 422), cheaply — the proxy sits on the hot path of
every agent step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from areal_env.http import routes
from areal_env.http.body import read_json, request_key
from areal_env.http.codec import json_response
from areal_env.http.errors import HTTPError, bad_request, install_error_handlers
from areal_env.proxy.cache import Interaction, InteractionCache
from areal_env.proxy.guide import validate_guide
from areal_env.proxy.pipeline import ProxyState
from areal_env.proxy.protocols import anthropic, openai_chat, responses
from areal_env.proxy.protocols.common import (
    CompletionRequest,
    WireProtocol,
)
from areal_env.proxy.render import RenderError
from areal_env.proxy.sampling import validate_session_sampling
from areal_env.proxy.sessions import Session

logger = logging.getLogger(__name__)


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

# The wire protocols served, each one object (see areal_env.proxy.protocols).
PROTOCOLS: tuple[WireProtocol, ...] = (
    openai_chat.PROTOCOL,
    anthropic.PROTOCOL,
    responses.PROTOCOL,
)


# ---- the app ----------------------------------------------------------------------------------


def create_app(state: ProxyState) -> FastAPI:
    """Build the FastAPI app around ``state`` (one app per proxy instance)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        period = max(0.05, min(30.0, state.registry.ttl / 4))

        async def expire_loop() -> None:
            while True:
                await asyncio.sleep(period)
                try:
                    state.registry.expire()
                except Exception:  # pragma: no cover - never let the janitor die
                    logger.exception("session expiry failed")

        task = asyncio.create_task(expire_loop())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

    app = FastAPI(
        title="areal-env proxy",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.proxy = state

    install_error_handlers(app, state.counters)

    _completion_routes(app, state)
    _info_routes(app, state)
    _rl_routes(app, state)
    return app


def _completion_routes(app: FastAPI, state: ProxyState) -> None:
    """One pipeline, one route per wire protocol."""

    async def complete(request: Request, proto: WireProtocol) -> Response:
        state.counters["requests"] += 1
        session = state.registry.admit(request_key(request))
        creq = proto.parse(await read_json(request))
        if "previous_response_id" in creq.extra:
            _apply_previous_response(session, creq)
        prep = state.prepare(session, creq, proto.name, proto.id_prefix)
        model = creq.model or state.model_name
        if creq.stream:
            opened = await state.open_stream(prep)
            writer = proto.stream(prep.interaction_id, model, creq, len(prep.prompt_ids))
            return StreamingResponse(
                state.stream(opened, writer, model),
                media_type="text/event-stream",
                headers=_SSE_HEADERS,
            )
        return json_response(proto.response(await state.generate(prep, model)))

    # The completion routes are plain Starlette routes: they take the raw request and parse it
    # by hand anyway, so FastAPI's per-request dependency solving would be pure overhead on the
    # agents' hot path. Errors still go through the handlers above.
    for proto in PROTOCOLS:
        app.add_route(proto.route, _handler(complete, proto), methods=["POST"])


def _info_routes(app: FastAPI, state: ProxyState) -> None:
    """Token counting, models, health and metrics."""

    @app.post(routes.COUNT_TOKENS)
    async def count_tokens(request: Request) -> Response:
        state.registry.admit(request_key(request))
        creq = anthropic.parse_request(
            {"max_tokens": 1, **(await read_json(request, object_only=True))}
        )
        renderer = state.routes.route(creq.model).renderer
        try:
            ids = renderer.render_prompt(creq.messages, creq.tools, creq.tool_choice)
        except RenderError as e:
            raise bad_request(str(e)) from None
        return json_response({"input_tokens": len(ids)})

    def served() -> list[str]:
        """The policies (a multi-agent run), else the one model name."""
        return state.routes.names or [state.model_name]

    def model_card(name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": int(state.started_at),
            "owned_by": "areal-env",
        }

    @app.get(routes.MODELS)
    async def models() -> Response:
        return json_response({"object": "list", "data": [model_card(n) for n in served()]})

    @app.get(routes.MODELS + "/{model_id:path}")
    async def model(model_id: str) -> Response:
        if model_id not in served():
            raise HTTPError(
                404,
                f"model {model_id!r} not found (serving {', '.join(served())})",
                param="model",
                code="model_not_found",
            )
        return json_response(model_card(model_id))

    @app.get(routes.HEALTH)
    async def health() -> Response:
        return json_response(state.health())

    @app.get(routes.METRICS)
    async def metrics() -> Response:
        return json_response(state.health())


def _rl_routes(app: FastAPI, state: ProxyState) -> None:
    """RL control: capacity, session start/reward/end, trajectory export."""

    @app.post(routes.GRANT_CAPACITY)
    async def grant_capacity(request: Request) -> Response:
        state.registry.check_admin(request_key(request))
        body = await read_json(request)
        n = body.get("capacity") if isinstance(body, dict) else None
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise bad_request("'capacity' must be an integer >= 0", "capacity")
        return json_response({"capacity": state.registry.grant_capacity(n)})

    @app.post(routes.START_SESSION)
    async def start_session(request: Request) -> Response:
        state.registry.check_admin(request_key(request))
        body = await read_json(request, empty_ok=True)
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        ids = {}
        for name in ("task_id", "group_id"):
            v = body.get(name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, str | int)):
                raise bad_request(f"'{name}' must be a string or an integer", name)
            ids[name] = None if v is None else str(v)
        meta, sampling = _session_metadata(body), _session_sampling(body)
        try:
            guide = validate_guide(body.get("guide"))
        except ValueError as e:
            raise bad_request(str(e), "guide") from None
        session, key = state.registry.start(ids["task_id"], ids["group_id"], meta)
        session.sampling = sampling
        session.guide = guide
        return json_response({"session_id": session.id, "api_key": key})

    @app.post(routes.SET_REWARD)
    async def set_reward(request: Request) -> Response:
        session = state.registry.by_key(request_key(request))
        body = await read_json(request)
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        reward = body.get("reward")
        if (
            isinstance(reward, bool)
            or not isinstance(reward, int | float)
            or not math.isfinite(reward)
        ):
            raise bad_request("'reward' must be a finite number", "reward")
        unknown = sorted(set(body) - {"reward", "completion_id", "train"})
        if unknown:  # a misspelt id would otherwise reward the last completion instead
            raise bad_request(
                f"unknown field {unknown[0]!r}: set_reward takes 'reward', 'completion_id' "
                "and 'train'",
                unknown[0],
            )
        iid = body.get("completion_id")
        if iid is not None and not isinstance(iid, str):
            raise bad_request("'completion_id' must be a string", "completion_id")
        train = body.get("train", True)
        if not isinstance(train, bool):
            raise bad_request("'train' must be true or false", "train")
        try:
            rid = session.cache.set_reward(float(reward), iid, train=train)
        except KeyError:
            if iid is None:
                raise HTTPError(404, "this session has no completion to reward yet") from None
            raise HTTPError(
                404, f"unknown completion {iid!r} in this session", param="completion_id"
            ) from None
        except ValueError as e:
            raise bad_request(str(e), "reward") from None
        it = session.cache.get(rid)
        return json_response({"completion_id": rid, "reward": it.reward, "train": it.trained})

    @app.post(routes.END_SESSION)
    async def end_session(request: Request) -> Response:
        session = state.registry.by_key(request_key(request), allow_ended=True)
        state.registry.end(session)
        return json_response({"session_id": session.id, "num_interactions": len(session.cache)})

    @app.post(routes.EXPORT_TRAJECTORIES)
    async def export_trajectories(request: Request) -> Response:
        state.registry.check_admin(request_key(request))
        body = await read_json(request)
        if not isinstance(body, dict) or not isinstance(body.get("session_id"), str):
            raise bad_request("'session_id' (string) is required", "session_id")
        session = state.registry.get(body["session_id"])
        discount = body.get("discount", 1.0)
        style = body.get("style", "individual")
        if isinstance(discount, bool) or not isinstance(discount, int | float):
            raise bad_request("'discount' must be a number in [0, 1]", "discount")
        if style not in ("individual", "concat"):
            raise bad_request("'style' must be 'individual' or 'concat'", "style")
        include_text = body.get("include_text", True) is not False
        try:
            rows = session.cache.export(discount=float(discount), style=style)
        except ValueError as e:
            raise bad_request(str(e)) from None
        session.touch()
        return json_response(
            {
                "session_id": session.id,
                "task_id": session.task_id,
                "group_id": session.group_id,
                "metadata": session.metadata,
                "ended": session.ended,
                "style": style,
                "trajectories": rows,
                "interactions": [
                    _interaction_summary(state, it, include_text, session.cache)
                    for it in session.cache.interactions()
                ],
                "stats": session.stats.as_dict(),
            }
        )


def _handler(
    complete: Callable[[Request, WireProtocol], Awaitable[Response]], proto: WireProtocol
) -> Callable[[Request], Awaitable[Response]]:
    async def handle(request: Request) -> Response:
        return await complete(request, proto)

    handle.__name__ = proto.name
    return handle


def _apply_previous_response(session: Session, creq: CompletionRequest) -> None:
    """``previous_response_id``: prepend that response's conversation (same session only)."""
    prev_id = creq.extra["previous_response_id"]
    try:
        prev = session.cache.get(prev_id)
    except KeyError:
        raise HTTPError(
            404, f"unknown previous_response_id {prev_id!r}", param="previous_response_id"
        ) from None
    new = [m for m in creq.messages if m["role"] != "system"]
    creq.messages = [*prev.messages, prev.output_message, *new]


def _session_metadata(body: dict[str, Any]) -> dict[str, Any] | None:
    meta = body.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        raise bad_request("'metadata' must be an object", "metadata")
    return meta


def _session_sampling(body: dict[str, Any]) -> dict[str, Any] | None:
    """A session's own sampling parameters (``/rl/start_session`` ``sampling``), checked."""
    try:
        return validate_session_sampling(body.get("sampling"))
    except ValueError as e:
        raise bad_request(str(e), "sampling") from None


def _new_messages(it: Interaction, cache: InteractionCache) -> list[dict[str, Any]]:
    """The request messages an interaction added to its parent's conversation (all of them for
    a root): tool results, user turns. Readers rebuild a session's tree from these without
    repeating every earlier turn."""
    if it.parent_id is None or it.parent_id not in cache:
        return it.messages
    return it.messages[len(cache.get(it.parent_id).messages) + 1 :]


def _interaction_summary(
    state: ProxyState, it: Interaction, include_text: bool, cache: InteractionCache
) -> dict[str, Any]:
    versions = it.output_versions
    names = [c.get("function", {}).get("name") for c in it.output_message.get("tool_calls") or []]
    offered = {(t.get("function") or t).get("name") for t in it.tools or [] if isinstance(t, dict)}
    out: dict[str, Any] = {
        "id": it.id,
        "parent_id": it.parent_id,
        "policy": it.policy,
        "reward": it.reward,
        "trained": it.trained,
        "stop_reason": it.stop_reason,
        "spliced": it.spliced,
        "num_prompt_tokens": len(it.prompt_ids),
        "num_output_tokens": len(it.output_ids),
        "versions": [min(versions), max(versions)] if versions else [],
        "created_at": it.created_at,
        "sampling": it.extra.get("sampling"),
        "guided": bool(it.extra.get("guided")),
        "tool_calls": names,
        "valid_tool_calls": sum(1 for n in names if n in offered),
        "tool_parse_error": bool(it.extra.get("tool_parse_error")),
    }
    if include_text:
        dec = state.routes.of_policy(it.policy).tokenizer.decode
        out["prompt_text"] = dec(it.prompt_ids, skip_special_tokens=False)
        out["completion_text"] = dec(it.output_ids, skip_special_tokens=False)
        out["messages"] = _new_messages(it, cache)
        out["output_message"] = it.output_message
    return out
