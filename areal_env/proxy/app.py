"""The proxy's FastAPI app: OpenAI chat / Responses, Anthropic Messages, and the RL endpoints.

Every completion request, whatever its protocol, runs the same pipeline (:class:`ProxyState`):
authenticate the session key → convert to internal OpenAI-chat messages → find the parent
interaction in the session's tree → splice (parent prompt + parent output + new turns) or render
from scratch → ``engine.agenerate`` (or ``agenerate_stream``) → parse tool calls → record the
:class:`~areal_env.proxy.cache.Interaction` → answer in the protocol's own shape.

Bodies are parsed and validated by hand instead of through pydantic models: clients send many
fields we ignore, and every failure must come back as a 400 in the protocol's own error format
(never FastAPI's 422), cheaply — the proxy sits on the hot path of every agent step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from areal_env.api.config import ProxyConfig
from areal_env.api.engine import EngineUnavailableError, PromptTooLongError, stream_from_generate
from areal_env.api.io import GenerationConfig, ModelRequest, ModelResponse
from areal_env.http import routes
from areal_env.http.body import read_json, request_key
from areal_env.http.codec import json_response
from areal_env.http.errors import install_error_handlers
from areal_env.proxy.cache import Interaction, InteractionCache, SessionLimitError
from areal_env.proxy.protocols import anthropic as anth
from areal_env.proxy.protocols import openai_chat as oai
from areal_env.proxy.protocols import responses as resp_api
from areal_env.proxy.protocols.common import (
    DEFAULT_TOOL_MARKERS,
    CompletionRequest,
    TextStream,
    TokenTexts,
    content_remainder,
    sse,
    truncate_at_stop,
)
from areal_env.proxy.protocols.errors import (
    ProxyError,
    anthropic_error_body,
    bad_request,
    openai_error_body,
)
from areal_env.proxy.render import ChatRenderer, RenderError
from areal_env.proxy.sessions import Session, SessionRegistry

logger = logging.getLogger(__name__)


@dataclass
class Prepared:
    """A request ready for the engine."""

    session: Session
    creq: CompletionRequest
    prompt_ids: list[int]
    parent: Interaction | None
    gconfig: GenerationConfig
    interaction_id: str
    protocol: str
    started: float


@dataclass
class Completion:
    """A finished, recorded completion."""

    interaction: Interaction
    message: dict[str, Any]
    finish_reason: str
    stop_hit: str | None
    prompt_tokens: int
    completion_tokens: int


class ProxyState:
    """Everything the routes share: engine, renderer, sessions, counters."""

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        config: ProxyConfig | None = None,
        *,
        admin_key: str,
        model_name: str | None = None,
        renderer: ChatRenderer | None = None,
        max_context_len: int | None = None,
    ) -> None:
        self.config = config or ProxyConfig()
        self.engine = engine
        self.tokenizer = tokenizer
        self.renderer = renderer or ChatRenderer(tokenizer, self.config.tool_parser)
        self.model_name = (
            model_name
            or self.config.model_name
            or str(getattr(engine, "model_path", "") or "default")
        )
        self.max_context_len = int(
            max_context_len
            or getattr(engine, "max_context_len", 0)
            or getattr(tokenizer, "model_max_length", 0)
            or 8192
        )
        if self.max_context_len > 10_000_000:  # tokenizers report a huge sentinel when unknown
            self.max_context_len = 8192
        cfg = self.config
        self.registry = SessionRegistry(
            cache_factory=lambda sid: InteractionCache(
                max_interactions=cfg.max_interactions_per_session,
                max_tokens=cfg.max_tokens_per_session,
            ),
            admin_key=admin_key,
            ttl=cfg.session_ttl,
            max_sessions=cfg.max_sessions,
            initial_capacity=cfg.initial_capacity,
        )
        self.token_texts = TokenTexts(tokenizer)
        self._skip_ids = frozenset(self.renderer.stop_token_ids) | frozenset(
            getattr(engine, "eos_token_ids", None) or []
        )
        parser = self.renderer.parser
        marker = getattr(parser, "open_tag", None) or getattr(parser, "marker", None)
        self.tool_markers = (
            (marker,) if isinstance(marker, str) and marker else DEFAULT_TOOL_MARKERS
        )
        self.started_at = time.time()
        self.counters = {"requests": 0, "errors": 0, "streams": 0}

    # ---- request → prompt ---------------------------------------------------------------------
    def prepare(
        self, session: Session, creq: CompletionRequest, protocol: str, id_prefix: str
    ) -> Prepared:
        """Find the parent, build the prompt ids (spliced when possible), check the bounds."""
        cache = session.cache
        if cache.max_interactions is not None and len(cache) >= cache.max_interactions:
            raise ProxyError(
                413,
                f"session holds the maximum of {cache.max_interactions} interactions",
                code="session_limit",
            )
        messages = creq.messages
        parent = cache.find_parent(messages)
        try:
            if parent is not None:
                n = len(parent.messages) + 1
                if len(messages) > n and parent.tools == creq.tools:
                    # Share the parent's (identical, verified) message objects instead of keeping
                    # a fresh copy of the whole history per turn: memory stays O(turns).
                    messages = creq.messages = [
                        *parent.messages,
                        parent.output_message,
                        *messages[n:],
                    ]
                    prompt_ids = self.renderer.render_extension(
                        parent, messages[n:], creq.tools, creq.tool_choice
                    )
                else:
                    session.stats.re_renders += 1
                    prompt_ids = self.renderer.render_prompt(messages, creq.tools, creq.tool_choice)
            else:
                if any(m.get("role") == "assistant" for m in messages):
                    session.stats.re_renders += 1  # history we did not produce, or edited
                prompt_ids = self.renderer.render_prompt(messages, creq.tools, creq.tool_choice)
        except RenderError as e:
            raise bad_request(str(e), "messages") from None
        n_prompt = len(prompt_ids)
        if n_prompt + 1 > self.max_context_len:
            raise ProxyError(
                413,
                f"prompt has {n_prompt} tokens; with at least one new token it exceeds the "
                f"context length {self.max_context_len}",
                param="messages",
                code="context_length_exceeded",
            )
        if cache.max_tokens is not None and cache.total_tokens + n_prompt + 1 > cache.max_tokens:
            raise ProxyError(
                413,
                f"session would exceed its maximum of {cache.max_tokens} tokens",
                code="session_limit",
            )
        max_new = creq.max_tokens or self.config.default_max_tokens
        max_new = max(1, min(max_new, self.max_context_len - n_prompt))
        temperature = 1.0 if creq.temperature is None else creq.temperature
        top_p = 1.0 if creq.top_p is None else creq.top_p
        try:
            gconfig = GenerationConfig(
                max_new_tokens=max_new,
                temperature=temperature,
                top_p=top_p if top_p > 0 else 1.0,
                top_k=creq.top_k or 0,
                greedy=temperature == 0 or top_p == 0,
                stop=creq.stop,
                stop_token_ids=list(self.renderer.stop_token_ids),
                seed=creq.seed,
            )
        except ValueError as e:
            raise bad_request(str(e)) from None
        return Prepared(
            session=session,
            creq=creq,
            prompt_ids=prompt_ids,
            parent=parent,
            gconfig=gconfig,
            interaction_id=f"{id_prefix}{secrets.token_hex(16)}",
            protocol=protocol,
            started=time.perf_counter(),
        )

    def model_request(self, prep: Prepared) -> ModelRequest:
        return ModelRequest(
            input_ids=prep.prompt_ids, gconfig=prep.gconfig, rid=prep.interaction_id
        )

    # ---- engine result → recorded interaction ------------------------------------------------
    def record(self, prep: Prepared, result: ModelResponse) -> Completion:
        creq, session = prep.creq, prep.session
        stop_reason = result.stop_reason
        if stop_reason == "abort":
            if not result.output_tokens:
                raise ProxyError(503, "generation was aborted (engine stopping or paused); retry")
            stop_reason = "length"
        parsed = self.renderer.parse_output(
            list(result.output_tokens), stop_reason, creq.tools, creq.tool_choice
        )
        content, stop_hit = truncate_at_stop(parsed.content, creq.stop)
        finish = parsed.finish_reason
        if stop_hit is not None and not parsed.tool_calls:
            finish = "stop"
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
            if not content:
                message["content"] = None
        elif content is None:
            message["content"] = ""
        if parsed.tool_parse_error:
            session.stats.tool_parse_failures += 1
            if parsed.tool_call_recovery == "raw_arguments":
                session.stats.tool_calls_raw_arguments += 1
            elif parsed.tool_call_recovery == "markup_removed":
                session.stats.tool_markup_removed += 1
        it = Interaction(
            id=prep.interaction_id,
            session_id=session.id,
            messages=creq.messages,
            tools=creq.tools,
            output_message=message,
            prompt_ids=prep.prompt_ids,
            output_ids=list(result.output_tokens),
            output_logprobs=list(result.output_logprobs),
            output_versions=list(result.output_versions),
            stop_reason=finish,
            parent_id=prep.parent.id if prep.parent is not None else None,
            extra={
                "protocol": prep.protocol,
                "engine_stop_reason": result.stop_reason,
                "tool_parse_error": parsed.tool_parse_error,
                "tool_call_recovery": parsed.tool_call_recovery,
                "latency": time.perf_counter() - prep.started,
            },
        )
        try:
            session.cache.add(it)
        except SessionLimitError as e:
            raise ProxyError(413, str(e), code="session_limit") from None
        st = session.stats
        st.completions += 1
        st.spliced += bool(it.spliced)
        st.prompt_tokens += len(prep.prompt_ids)
        st.output_tokens += len(it.output_ids)
        return Completion(
            interaction=it,
            message=message,
            finish_reason=finish,
            stop_hit=stop_hit,
            prompt_tokens=len(prep.prompt_ids),
            completion_tokens=len(it.output_ids),
        )

    async def generate(self, prep: Prepared) -> Completion:
        session = prep.session
        session.in_flight += 1
        try:
            with engine_errors():
                result = await self.engine.agenerate(self.model_request(prep))
            return self.record(prep, result)
        finally:
            session.in_flight -= 1
            session.touch()

    def logprob_entries(self, ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
        keep = [(t, lp) for t, lp in zip(ids, logprobs, strict=False) if t not in self._skip_ids]
        return self.token_texts.logprob_entries([t for t, _ in keep], [lp for _, lp in keep])

    # ---- streaming ----------------------------------------------------------------------------
    async def open_stream(self, prep: Prepared) -> tuple[AsyncIterator[Any], Any]:
        """Start the engine stream and wait for its first chunk, so errors still get a status."""
        gen_fn = getattr(self.engine, "agenerate_stream", None)
        req = self.model_request(prep)
        agen = gen_fn(req) if gen_fn is not None else stream_from_generate(self.engine, req)
        prep.session.in_flight += 1
        try:
            with engine_errors():
                first = await agen.__anext__()
        except BaseException:
            prep.session.in_flight -= 1
            with contextlib.suppress(Exception):
                await agen.aclose()
            raise
        return agen, first

    async def stream(
        self, prep: Prepared, agen: AsyncIterator[Any], first: Any, writer: Any
    ) -> AsyncIterator[bytes]:
        """Run one stream: text deltas as tokens arrive, then calls, finish and usage events.

        ``writer`` adapts the protocol (see the ``_*Stream`` classes below).
        """
        self.counters["streams"] += 1
        creq = prep.creq
        try:
            yield writer.start()
            ts = TextStream(
                self.tokenizer,
                skip_ids=self._skip_ids,
                tool_markers=self.tool_markers if creq.parse_tools else (),
                stop=creq.stop,
            )
            if creq.parse_tools and self.renderer.prefill_text(creq.tools, creq.tool_choice):
                ts.in_tool_call = True  # the prompt already opened a call
            pending_lp: list[dict[str, Any]] = []
            chunk = first
            while True:
                if creq.logprobs and chunk.token_ids:
                    pending_lp.extend(self.logprob_entries(chunk.token_ids, chunk.logprobs))
                text = ts.add(chunk.token_ids)
                if text:
                    yield writer.text(text, pending_lp)
                    pending_lp = []
                if chunk.final is not None:
                    break
                with engine_errors():
                    chunk = await agen.__anext__()
            text = ts.finish()
            if text:
                yield writer.text(text, pending_lp)
                pending_lp = []
            done = self.record(prep, chunk.final)
            rest = content_remainder(done.message.get("content"), ts.emitted_text)
            if rest:
                yield writer.text(rest, pending_lp)
                pending_lp = []
            if done.message.get("tool_calls"):
                yield writer.tool_calls(done.message["tool_calls"])
            yield writer.finish(done, pending_lp)
        except ProxyError as e:
            self.counters["errors"] += 1
            yield writer.error(e)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("stream failed")
            self.counters["errors"] += 1
            yield writer.error(ProxyError(500, "internal error while streaming"))
        finally:
            prep.session.in_flight -= 1
            prep.session.touch()
            with contextlib.suppress(Exception):
                await agen.aclose()

    # ---- health -------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        version = None
        with contextlib.suppress(Exception):
            version = self.engine.get_version()
        return {
            "status": "ok",
            "model": self.model_name,
            "sessions": self.registry.live_sessions,
            "sessions_held": len(self.registry),
            "sessions_started": self.registry.total_started,
            "sessions_expired": self.registry.total_expired,
            "capacity": self.registry.capacity,
            "engine_version": version,
            "uptime_s": round(time.time() - self.started_at, 3),
            "requests": dict(self.counters),
            "stats": self.registry.aggregate_stats(),
        }


@contextlib.contextmanager
def engine_errors():
    """Engine exceptions → client statuses (503 down, 413 too long, 400 invalid)."""
    try:
        yield
    except ProxyError:
        raise
    except EngineUnavailableError as e:
        raise ProxyError(
            503, f"inference engine unavailable: {e}", code="engine_unavailable"
        ) from None
    except PromptTooLongError as e:
        raise ProxyError(413, str(e), code="context_length_exceeded") from None
    except ValueError as e:
        raise bad_request(str(e)) from None
    except StopAsyncIteration:
        raise ProxyError(503, "inference engine ended the stream without a result") from None


# ---- protocol stream adapters -----------------------------------------------------------------


class _ChatStream:
    def __init__(self, prep: Prepared, model: str) -> None:
        self.prep = prep
        self.w = oai.ChunkWriter(prep.interaction_id, model, prep.creq.include_usage)

    def start(self) -> bytes:
        return self.w.role()

    def text(self, text: str, lp: list) -> bytes:
        return self.w.content(text, lp if self.prep.creq.logprobs else None)

    def tool_calls(self, calls: list) -> bytes:
        return self.w.tool_calls(calls)

    def finish(self, done: Completion, lp: list) -> bytes:
        out = self.w.finish(done.finish_reason, lp if self.prep.creq.logprobs else None)
        if self.prep.creq.include_usage:
            out += self.w.usage(done.prompt_tokens, done.completion_tokens)
        return out + self.w.done()

    def error(self, err: ProxyError) -> bytes:
        return sse(openai_error_body(err)) + self.w.done()


class _AnthropicStream:
    def __init__(self, prep: Prepared, model: str) -> None:
        self.w = anth.EventWriter(prep.interaction_id, model, len(prep.prompt_ids))

    def start(self) -> bytes:
        return self.w.start()

    def text(self, text: str, lp: list) -> bytes:
        return self.w.text(text)

    def tool_calls(self, calls: list) -> bytes:
        return self.w.tool_uses(calls)

    def finish(self, done: Completion, lp: list) -> bytes:
        return self.w.finish(done.finish_reason, done.stop_hit, done.completion_tokens)

    def error(self, err: ProxyError) -> bytes:
        return self.w.error(anthropic_error_body(err))


class _ResponsesStream:
    def __init__(self, prep: Prepared, model: str) -> None:
        self.w = resp_api.EventWriter(prep.interaction_id, model, prep.creq.extra.get("echo", {}))

    def start(self) -> bytes:
        return self.w.start()

    def text(self, text: str, lp: list) -> bytes:
        return self.w.text(text)

    def tool_calls(self, calls: list) -> bytes:
        return self.w.function_calls(calls)

    def finish(self, done: Completion, lp: list) -> bytes:
        return self.w.finish(done.finish_reason, done.prompt_tokens, done.completion_tokens)

    def error(self, err: ProxyError) -> bytes:
        return self.w.error(err.message, err.code)


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


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

    # ---- completions ----
    async def _complete(
        request: Request,
        parse: Callable[[Any], CompletionRequest],
        protocol: str,
        id_prefix: str,
        build: Callable[[Prepared, Completion, str], dict[str, Any]],
        stream_cls: type,
    ) -> Response:
        state.counters["requests"] += 1
        session = state.registry.by_key(request_key(request))
        creq = parse(await read_json(request))
        if protocol == "responses" and "previous_response_id" in creq.extra:
            _apply_previous_response(session, creq)
        prep = state.prepare(session, creq, protocol, id_prefix)
        model = creq.model or state.model_name
        if creq.stream:
            agen, first = await state.open_stream(prep)
            return StreamingResponse(
                state.stream(prep, agen, first, stream_cls(prep, model)),
                media_type="text/event-stream",
                headers=_SSE_HEADERS,
            )
        done = await state.generate(prep)
        return json_response(build(prep, done, model))

    def _build_chat(prep: Prepared, done: Completion, model: str) -> dict[str, Any]:
        lp = None
        if prep.creq.logprobs:
            it = done.interaction
            lp = state.logprob_entries(it.output_ids, it.output_logprobs)
        return oai.build_response(
            completion_id=prep.interaction_id,
            model=model,
            message=done.message,
            finish_reason=done.finish_reason,
            prompt_tokens=done.prompt_tokens,
            completion_tokens=done.completion_tokens,
            logprobs=lp,
        )

    def _build_anthropic(prep: Prepared, done: Completion, model: str) -> dict[str, Any]:
        return anth.build_response(
            message_id=prep.interaction_id,
            model=model,
            message=done.message,
            finish_reason=done.finish_reason,
            stop_hit=done.stop_hit,
            prompt_tokens=done.prompt_tokens,
            completion_tokens=done.completion_tokens,
        )

    def _build_responses(prep: Prepared, done: Completion, model: str) -> dict[str, Any]:
        return resp_api.response_object(
            response_id=prep.interaction_id,
            model=model,
            echo=prep.creq.extra.get("echo", {}),
            output=resp_api.output_items(done.message),
            status=resp_api.status_of(done.finish_reason),
            finish_reason=done.finish_reason,
            usage_obj=resp_api.usage(done.prompt_tokens, done.completion_tokens),
        )

    async def chat_completions(request: Request) -> Response:
        return await _complete(
            request, oai.parse_request, "openai_chat", "chatcmpl-", _build_chat, _ChatStream
        )

    async def messages(request: Request) -> Response:
        return await _complete(
            request, anth.parse_request, "anthropic", "msg_", _build_anthropic, _AnthropicStream
        )

    async def responses(request: Request) -> Response:
        return await _complete(
            request,
            resp_api.parse_request,
            "responses",
            "resp_",
            _build_responses,
            _ResponsesStream,
        )

    # The completion routes are plain Starlette routes: they take the raw request and parse it
    # by hand anyway, so FastAPI's per-request dependency solving would be pure overhead on the
    # agents' hot path. Errors still go through the handlers above.
    app.add_route(routes.CHAT_COMPLETIONS, chat_completions, methods=["POST"])
    app.add_route(routes.MESSAGES, messages, methods=["POST"])
    app.add_route(routes.RESPONSES, responses, methods=["POST"])

    @app.post(routes.COUNT_TOKENS)
    async def count_tokens(request: Request) -> Response:
        state.registry.by_key(request_key(request))
        creq = anth.parse_request({"max_tokens": 1, **(await read_json(request, object_only=True))})
        try:
            ids = state.renderer.render_prompt(creq.messages, creq.tools, creq.tool_choice)
        except RenderError as e:
            raise bad_request(str(e)) from None
        return json_response({"input_tokens": len(ids)})

    @app.get(routes.MODELS)
    async def models() -> Response:
        return json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": state.model_name,
                        "object": "model",
                        "created": int(state.started_at),
                        "owned_by": "areal-env",
                    }
                ],
            }
        )

    @app.get(routes.MODELS + "/{model_id:path}")
    async def model(model_id: str) -> Response:
        if model_id != state.model_name:
            raise ProxyError(404, f"model {model_id!r} not found (serving {state.model_name!r})")
        return json_response(
            {
                "id": state.model_name,
                "object": "model",
                "created": int(state.started_at),
                "owned_by": "areal-env",
            }
        )

    @app.get(routes.HEALTH)
    async def health() -> Response:
        return json_response(state.health())

    @app.get(routes.METRICS)
    async def metrics() -> Response:
        return json_response(state.health())

    # ---- RL control ----
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
        meta = body.get("metadata")
        if meta is not None and not isinstance(meta, dict):
            raise bad_request("'metadata' must be an object", "metadata")
        session, key = state.registry.start(ids["task_id"], ids["group_id"], meta)
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
        iid = body.get("interaction_id", body.get("completion_id"))
        if iid is not None and not isinstance(iid, str):
            raise bad_request("'interaction_id' must be a string", "interaction_id")
        try:
            rid = session.cache.set_reward(float(reward), iid)
        except KeyError:
            if iid is None:
                raise ProxyError(404, "this session has no completion to reward yet") from None
            raise ProxyError(
                404, f"unknown interaction {iid!r} in this session", param="interaction_id"
            ) from None
        except ValueError as e:
            raise bad_request(str(e), "reward") from None
        return json_response({"interaction_id": rid, "reward": session.cache.get(rid).reward})

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
                    _interaction_summary(state, it, include_text)
                    for it in session.cache.interactions()
                ],
                "stats": session.stats.as_dict(),
            }
        )

    return app


def _apply_previous_response(session: Session, creq: CompletionRequest) -> None:
    """``previous_response_id``: prepend that response's conversation (same session only)."""
    prev_id = creq.extra["previous_response_id"]
    try:
        prev = session.cache.get(prev_id)
    except KeyError:
        raise ProxyError(
            404, f"unknown previous_response_id {prev_id!r}", param="previous_response_id"
        ) from None
    new = [m for m in creq.messages if m["role"] != "system"]
    creq.messages = [*prev.messages, prev.output_message, *new]


def _interaction_summary(state: ProxyState, it: Interaction, include_text: bool) -> dict[str, Any]:
    versions = it.output_versions
    out: dict[str, Any] = {
        "id": it.id,
        "parent_id": it.parent_id,
        "reward": it.reward,
        "stop_reason": it.stop_reason,
        "spliced": it.spliced,
        "num_prompt_tokens": len(it.prompt_ids),
        "num_output_tokens": len(it.output_ids),
        "versions": [min(versions), max(versions)] if versions else [],
        "created_at": it.created_at,
    }
    if include_text:
        dec = state.tokenizer.decode
        out["prompt_text"] = dec(it.prompt_ids, skip_special_tokens=False)
        out["completion_text"] = dec(it.output_ids, skip_special_tokens=False)
    return out
