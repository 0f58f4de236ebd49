"""The proxy's shared pipeline (:class:`ProxyState`), whatever the wire protocol.

authenticate the session key → convert to internal OpenAI-chat messages (the protocol object)
→ find the parent interaction in the session's tree → splice (parent prompt + parent output +
new turns) or render from scratch → ``engine.agenerate`` (or ``agenerate_stream``) → parse
tool calls → record the :class:`~areal_env.proxy.cache.Interaction` → an :class:`Answer` the
protocol object turns into its own response or stream events.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import random
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from areal_env.api.config import ProxyConfig
from areal_env.api.engine import EngineUnavailableError, InferenceEngine, PromptTooLongError
from areal_env.api.io import (
    Constraint,
    GenerationConfig,
    ModelRequest,
    ModelResponse,
    StreamChunk,
)
from areal_env.engine.grammar import ConstraintError, schema_error
from areal_env.engine.json_end import JsonEnd
from areal_env.http.errors import HTTPError, bad_request
from areal_env.proxy.cache import Interaction, InteractionCache, SessionLimitError
from areal_env.proxy.guide import next_guided_step
from areal_env.proxy.policies import PolicyEndpoint, PolicyRoute, PolicyRoutes, make_route
from areal_env.proxy.protocols.common import (
    Answer,
    ChoicesWriter,
    CompletionRequest,
    StreamWriter,
    TextStream,
    content_remainder,
    truncate_at_stop,
)
from areal_env.proxy.render import ChatRenderer, RenderError, RequiredCall
from areal_env.proxy.sampling import Sampling, resolve_sampling
from areal_env.proxy.sessions import Session, SessionRegistry

logger = logging.getLogger(__name__)


@dataclass
class Prepared:
    """A request ready for the engine."""

    session: Session
    creq: CompletionRequest
    route: PolicyRoute
    """The policy that answers (its engine and renderer)."""
    prompt_ids: list[int]
    parent: Interaction | None
    gconfig: GenerationConfig
    sampling: Sampling
    interaction_id: str
    protocol: str
    started: float
    call_close: str = ""
    """What closes the call list the engine stops inside after one call (``]``), if it does."""


@dataclass
class OpenStream:
    """One choice's engine stream, started: its first chunk is already in."""

    prep: Prepared
    agen: AsyncGenerator[StreamChunk, None]
    first: StreamChunk
    closed: bool = False

    async def close(self) -> None:
        """Stop the engine stream and release the session's in-flight count (once)."""
        if self.closed:
            return
        self.closed = True
        self.prep.session.in_flight -= 1
        self.prep.session.touch()
        with contextlib.suppress(Exception):
            await self.agen.aclose()


async def interleave(parts: list[AsyncIterator[bytes]]) -> AsyncIterator[bytes]:
    """The items of ``parts`` as each produces them. The first error stops them all and is
    raised; so is closing this iterator early."""
    queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()

    async def pump(part: AsyncIterator[bytes]) -> None:
        try:
            async for item in part:
                await queue.put(item)
            await queue.put(None)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            await queue.put(e)

    tasks = [asyncio.create_task(pump(p)) for p in parts]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class ProxyState:
    """Everything the routes share: engine, renderer, sessions, counters.

    ``policies``: a multi-agent run's policies by name (each its engine and tokenizer): a
    request's ``model`` field picks one (see ``proxy.policies``). Without them the proxy serves
    ``engine`` under any model name. ``engine`` and ``tokenizer`` are the run's base model
    either way (health, the default renderer).
    """

    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer: Any,
        config: ProxyConfig | None = None,
        *,
        admin_key: str,
        model_name: str | None = None,
        renderer: ChatRenderer | None = None,
        max_context_len: int | None = None,
        train_gconfig: GenerationConfig | None = None,
        policies: dict[str, PolicyEndpoint] | None = None,
    ) -> None:
        self.config = config or ProxyConfig()
        self.engine = engine
        self.tokenizer = tokenizer
        self.train_gconfig = train_gconfig
        """The trainer's sampling parameters (``proxy.sampling: trainer``); None: the agent's."""
        default = make_route(
            None,
            engine,
            tokenizer,
            self.config,
            renderer=renderer,
            key=None if policies else "",  # a digest only when there is something to compare
        )
        self.routes = (
            PolicyRoutes.build(default, policies, self.config)
            if policies
            else PolicyRoutes(default)
        )
        self.renderer = default.renderer
        self.model_name = (
            model_name or self.config.model_name or str(engine.model_path or "default")
        )
        self.max_context_len = int(
            max_context_len
            or engine.max_context_len
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
            rate_limit=cfg.rate_limit(),
        )
        self.started_at = time.time()
        self.counters = {"requests": 0, "errors": 0, "streams": 0}
        # draws gconfig.call_exploration's decisions (a request's own seed draws its own)
        self._explore_rng = random.Random()

    # ---- request → prompt ---------------------------------------------------------------------
    def prepare(
        self, session: Session, creq: CompletionRequest, protocol: str, id_prefix: str
    ) -> Prepared:
        """Pick the policy, find the parent, build the prompt ids (spliced when possible), check
        the bounds."""
        route = self.routes.route(creq.model)
        cache = session.cache
        if cache.max_interactions is not None and len(cache) >= cache.max_interactions:
            raise HTTPError(
                413,
                f"session holds the maximum of {cache.max_interactions} interactions",
                code="session_limit",
            )
        parent = cache.find_parent(creq.messages)
        if parent is not None and self.routes.named:
            self.routes.check_continuation(route, parent.policy)
        prompt_ids = self._render(route.renderer, session, creq, parent)
        n_prompt = len(prompt_ids)
        context_len = self._context_len(route)
        if n_prompt + 1 > context_len:
            raise context_error(protocol, n_prompt, context_len)
        if cache.max_tokens is not None and cache.total_tokens + n_prompt + 1 > cache.max_tokens:
            raise HTTPError(
                413,
                f"session would exceed its maximum of {cache.max_tokens} tokens",
                code="session_limit",
            )
        sampling = resolve_sampling(
            self.config.sampling,
            self.train_gconfig,
            session.sampling,
            temperature=creq.temperature,
            top_p=creq.top_p,
            top_k=creq.top_k,
            max_tokens=creq.max_tokens,
            default_max_tokens=self.config.default_max_tokens,
        )
        max_new = max(1, min(sampling.max_new_tokens, context_len - n_prompt))
        constraint = self.constraint(creq, route.renderer)
        can_constrain = self.config.constrain_required and creq.parse_tools and constraint is None
        guided = (
            self._guided_start(route.renderer, session, creq)
            if session.guide
            and self.config.constrain_required
            and constraint is None
            and not sampling.greedy
            else None
        )
        required = (
            route.renderer.required_call(creq.tools, creq.tool_choice, creq.parallel_tool_calls)
            if can_constrain and guided is None
            else None
        )
        explored_call = (
            route.renderer.explored_call(creq.tools, creq.parallel_tool_calls)
            if sampling.call_exploration > 0
            and guided is None
            and can_constrain
            and required is None
            and creq.tool_choice in (None, "auto")
            and creq.messages
            and creq.messages[-1].get("role") == "tool"
            and self._call_draw(creq.seed) < sampling.call_exploration
            else None
        )
        start = guided or required or explored_call  # the constrained start of the reply
        try:
            gconfig = GenerationConfig(
                max_new_tokens=max_new,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                greedy=sampling.greedy,
                stop=_with_call_stop(creq.stop, start.stop if start else []),
                stop_token_ids=list(route.renderer.stop_token_ids),
                seed=creq.seed,
                prefix_choices=start.choices if start else None,
                choice_exploration=sampling.choice_exploration if start else 0.0,
                prefix_decision=explored_call is not None,
                prefix_guided=guided is not None,
                stop_at_json_end=start.json_start if start else None,
                json_end_depth=start.json_depth if start else 0,
                constraint=constraint,
                top_logprobs=creq.top_logprobs if creq.logprobs else 0,
            )
        except ValueError as e:
            raise bad_request(str(e)) from None
        return Prepared(
            session=session,
            creq=creq,
            route=route,
            prompt_ids=prompt_ids,
            parent=parent,
            gconfig=gconfig,
            sampling=sampling,
            interaction_id=f"{id_prefix}{secrets.token_hex(16)}",
            protocol=protocol,
            started=time.perf_counter(),
            call_close=start.close if start else "",
        )

    @staticmethod
    def _guided_start(
        renderer: ChatRenderer, session: Session, creq: CompletionRequest
    ) -> RequiredCall | None:
        """The constrained start that writes the session's guide's next step into this reply
        (``areal_env.proxy.guide``), or None: no step left, or the request cannot take it."""
        step = next_guided_step(session.guide, creq.messages)
        if step is None:
            return None
        if "content" in step:
            return renderer.guided_answer(creq.tool_choice, step["content"])
        if not creq.parse_tools:
            return None
        return renderer.guided_call(creq.tools, creq.tool_choice, step, creq.parallel_tool_calls)

    def _call_draw(self, seed: int | None) -> float:
        """A uniform draw for ``call_exploration``: from the request's seed when it has one, so
        a seeded request is reproducible."""
        return random.Random(seed).random() if seed is not None else self._explore_rng.random()

    def constraint(self, creq: CompletionRequest, renderer: ChatRenderer) -> Constraint | None:
        """What constrained decoding holds the reply to: the requested output format (JSON, a
        schema) and strict tools' arguments inside the model family's call format; None when
        the request asks for neither. Schemas that cannot be honoured are a 400 naming the
        parameter, before anything is generated."""
        fmt = creq.output_format
        if fmt is not None and fmt.schema is not None:
            error = schema_error(fmt.schema)
            if error:
                raise bad_request(f"{fmt.param}: the schema cannot be honoured: {error}", fmt.param)
        tools = creq.parse_tools or []
        strict = False
        for i, tool in enumerate(tools):
            fn = tool["function"]
            if fn.get("strict"):
                strict = True
                error = schema_error(fn.get("parameters"))
                if error:
                    param = f"tools[{i}].function.parameters"
                    raise bad_request(
                        f"{param}: the schema of strict tool {fn['name']!r} cannot be honoured: "
                        f"{error}",
                        param,
                    )
        answer = fmt.schema if fmt is not None else None
        if tools and (strict or fmt is not None):
            grammar = renderer.call_grammar(
                tools, creq.tool_choice, answer, creq.parallel_tool_calls
            )
            if grammar:
                return Constraint("grammar", grammar)
        if answer is not None:
            return Constraint("json_schema", json.dumps(answer, ensure_ascii=False))
        return None

    def _context_len(self, route: PolicyRoute) -> int:
        """Prompt + completion tokens the route's engine takes (the proxy's bound for the base
        model, and any other engine's own)."""
        if route.engine is self.engine or not route.engine.max_context_len:
            return self.max_context_len
        return min(self.max_context_len, int(route.engine.max_context_len))

    def _render(
        self,
        renderer: ChatRenderer,
        session: Session,
        creq: CompletionRequest,
        parent: Interaction | None,
    ) -> list[int]:
        """Prompt ids for ``creq``: spliced onto ``parent``'s exact tokens when the new messages
        only extend it, rendered afresh otherwise (counted as a re-render)."""
        messages = creq.messages
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
                    prompt_ids = renderer.render_extension(
                        parent, messages[n:], creq.tools, creq.tool_choice
                    )
                else:
                    session.stats.re_renders += 1
                    prompt_ids = renderer.render_prompt(messages, creq.tools, creq.tool_choice)
            else:
                if any(m.get("role") == "assistant" for m in messages):
                    session.stats.re_renders += 1  # history we did not produce, or edited
                prompt_ids = renderer.render_prompt(messages, creq.tools, creq.tool_choice)
        except RenderError as e:
            raise bad_request(str(e), "messages") from None
        return prompt_ids

    def _call_close(self, prep: Prepared, result: ModelResponse) -> tuple[str, int]:
        """``(prep.call_close, characters after the call)`` when the engine stopped inside a
        call list after its first call (``parallel_tool_calls: false``), else ``("", 0)``: the
        parse closes the list there (a ``},`` token leaves a ``,`` to drop), and the history
        adds the closing."""
        json_start = prep.gconfig.stop_at_json_end
        if not prep.call_close or json_start is None or result.stop_reason != "stop":
            return "", 0
        text = prep.route.tokenizer.decode(list(result.output_tokens), skip_special_tokens=False)
        one_call, whole = JsonEnd(json_start, prep.gconfig.json_end_depth), JsonEnd(json_start)
        if not one_call.feed(text) or whole.feed(text):
            return "", 0
        return prep.call_close, len(one_call.rest)

    def model_request(self, prep: Prepared) -> ModelRequest:
        # the session id pins every turn to one inference server (SGLangEngine's routing), so
        # later turns reuse that server's prefix cache
        return ModelRequest(
            input_ids=prep.prompt_ids,
            gconfig=prep.gconfig,
            rid=prep.interaction_id,
            metadata={"session_id": prep.session.id},
        )  # the route's engine (an adapter's) names its adapter itself

    # ---- engine result → recorded interaction ------------------------------------------------
    def record(self, prep: Prepared, result: ModelResponse, model: str = "") -> Answer:
        creq, session = prep.creq, prep.session
        stop_reason = result.stop_reason
        if stop_reason == "abort":
            if not result.output_tokens:
                raise HTTPError(503, "generation was aborted (engine stopping or paused); retry")
            stop_reason = "length"
        closing, cut = self._call_close(prep, result)
        parsed = prep.route.renderer.parse_output(
            list(result.output_tokens), stop_reason, creq.tools, creq.tool_choice, closing, cut
        )
        calls = parsed.tool_calls
        if calls and not creq.parallel_tool_calls and len(calls) > 1:
            # a free reply with several calls: the first is the one call the client allows
            session.stats.parallel_calls_dropped += len(calls) - 1
            calls = calls[:1]
        content, stop_hit = truncate_at_stop(parsed.content, creq.stop)
        finish = parsed.finish_reason
        if stop_hit is not None and not calls:
            finish = "stop"
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
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
            policy=prep.route.name,
            extra={
                "protocol": prep.protocol,
                "engine_stop_reason": result.stop_reason,
                "tool_parse_error": parsed.tool_parse_error,
                "tool_call_recovery": parsed.tool_call_recovery,
                # the "]" the history adds after a call list cut at its first call
                "call_close": closing,
                "latency": time.perf_counter() - prep.started,
                "sampling": {
                    **prep.sampling.as_dict(),
                    "mode": self.config.sampling,
                    "requested": {
                        "temperature": creq.temperature,
                        "top_p": creq.top_p,
                        "top_k": creq.top_k,
                        "max_tokens": creq.max_tokens,
                    },
                },
                "logprob_temperature": prep.sampling.logprob_temperature,
                "explored": result.explored,
                # the engine wrote a guide's step (engines that cannot constrain do not)
                "guided": prep.gconfig.prefix_guided and result.explored > 0,
                # the tokens that were the only one allowed (logprob 0) are out of the loss mask
                "constrained": prep.gconfig.prefix_choices is not None
                or prep.gconfig.constraint is not None,
            },
        )
        try:
            session.cache.add(it)
        except SessionLimitError as e:
            raise HTTPError(413, str(e), code="session_limit") from None
        st = session.stats
        st.completions += 1
        st.spliced += bool(it.spliced)
        st.prompt_tokens += len(prep.prompt_ids)
        st.output_tokens += len(it.output_ids)
        return Answer(
            prep.interaction_id,
            model,
            creq,
            message,
            finish,
            stop_hit,
            len(prep.prompt_ids),
            len(it.output_ids),
            interaction=it,
        )

    def choices(self, prep: Prepared) -> list[Prepared]:
        """One ``Prepared`` per requested choice (``n``): the same prompt (its KV is shared
        through the engine's prefix cache), each its own interaction, a branch of the session's
        tree, with its own seed when the request gave one."""
        n = prep.creq.n
        if n <= 1:
            return [prep]
        seed = prep.gconfig.seed
        return [
            dataclasses.replace(
                prep,
                interaction_id=prep.interaction_id if i == 0 else f"{prep.interaction_id}-{i}",
                gconfig=prep.gconfig.new(seed=None if seed is None else seed + i),
            )
            for i in range(n)
        ]

    async def generate(self, prep: Prepared, model: str = "") -> Answer:
        """The answer of ``prep`` (with ``n > 1``, its other choices in ``alternatives``)."""
        session = prep.session
        session.in_flight += 1
        try:
            preps = self.choices(prep)
            with self.engine_errors(prep):
                results = await asyncio.gather(
                    *(prep.route.engine.agenerate(self.model_request(p)) for p in preps)
                )
            answers = []
            for p, result in zip(preps, results, strict=True):
                done = self.record(p, result, model)
                if prep.creq.logprobs:
                    done.logprobs = self.logprob_entries(
                        prep.route,
                        result.output_tokens,
                        result.output_logprobs,
                        result.output_top_logprobs,
                    )
                answers.append(done)
            first = answers[0]
            first.alternatives = answers[1:]
            return first
        finally:
            session.in_flight -= 1
            session.touch()

    def logprob_entries(
        self,
        route: PolicyRoute,
        ids: list[int],
        logprobs: list[float],
        tops: list[list[tuple[int, float]]] | None = None,
    ) -> list[dict[str, Any]]:
        keep = [i for i, t in enumerate(ids[: len(logprobs)]) if t not in route.skip_ids]
        return route.token_texts.logprob_entries(
            [ids[i] for i in keep],
            [logprobs[i] for i in keep],
            [tops[i] for i in keep] if tops is not None and len(tops) == len(ids) else None,
        )

    # ---- streaming ----------------------------------------------------------------------------
    async def open_stream(self, prep: Prepared) -> list[OpenStream]:
        """Start one engine stream per choice (``n``) and wait for each first chunk, so that
        errors still get a status. Either all choices are open or none is."""
        preps = self.choices(prep)
        if len(preps) == 1:  # the usual request: no tasks to gather on the hot path
            return [await self._open_one(preps[0])]
        results = await asyncio.gather(*(self._open_one(p) for p in preps), return_exceptions=True)
        opened = [r for r in results if isinstance(r, OpenStream)]
        failed = [r for r in results if not isinstance(r, OpenStream)]
        if failed:
            for o in opened:
                await o.close()
            raise failed[0]
        return opened

    async def _open_one(self, prep: Prepared) -> OpenStream:
        agen = prep.route.engine.agenerate_stream(self.model_request(prep))
        prep.session.in_flight += 1
        try:
            with self.engine_errors(prep):
                first = await agen.__anext__()
        except BaseException:
            prep.session.in_flight -= 1
            with contextlib.suppress(Exception):
                await agen.aclose()
            raise
        return OpenStream(prep, agen, first)

    async def stream(
        self, opened: list[OpenStream], writer: StreamWriter, model: str
    ) -> AsyncIterator[bytes]:
        """Run a request's streams: text deltas as tokens arrive, then calls, finish and usage
        events, written by the protocol's ``writer``. With ``n > 1`` the choices' events
        interleave as their tokens arrive (each event names its choice), then one trailer."""
        self.counters["streams"] += 1
        answers: list[Answer | None] = [None] * len(opened)
        try:
            if len(opened) == 1:
                async for event in self._choice_events(opened[0], writer, model, answers, 0):
                    yield event
            else:
                if not isinstance(writer, ChoicesWriter):  # parse_request refuses n > 1
                    raise HTTPError(400, "this protocol streams one choice only", param="n")
                parts = [
                    self._choice_events(o, writer.choice(i), model, answers, i)
                    for i, o in enumerate(opened)
                ]
                async for event in interleave(parts):
                    yield event
                yield writer.end([a for a in answers if a is not None])
        except HTTPError as e:
            self.counters["errors"] += 1
            yield writer.error(e)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("stream failed")
            self.counters["errors"] += 1
            yield writer.error(HTTPError(500, "internal error while streaming"))
        finally:
            for o in opened:
                await o.close()

    async def _choice_events(
        self,
        opened: OpenStream,
        writer: StreamWriter,
        model: str,
        answers: list[Answer | None],
        index: int,
    ) -> AsyncIterator[bytes]:
        """One choice's events; its finished answer goes to ``answers[index]``."""
        prep, agen, chunk = opened.prep, opened.agen, opened.first
        creq, route = prep.creq, prep.route
        yield writer.start()
        ts = TextStream(
            route.tokenizer,
            skip_ids=route.skip_ids,
            tool_markers=route.tool_markers if creq.parse_tools else (),
            stop=creq.stop,
        )
        if creq.parse_tools and route.renderer.prefill_text(creq.tools, creq.tool_choice):
            ts.in_tool_call = True  # the prompt already opened a call
        pending_lp: list[dict[str, Any]] = []
        while True:
            if creq.logprobs and chunk.token_ids:
                pending_lp.extend(
                    self.logprob_entries(route, chunk.token_ids, chunk.logprobs, chunk.top_logprobs)
                )
            text = ts.add(chunk.token_ids)
            if text:
                yield writer.text(text, pending_lp)
                pending_lp = []
            if chunk.final is not None:
                break
            with self.engine_errors(prep):
                chunk = await agen.__anext__()
        text = ts.finish()
        if text:
            yield writer.text(text, pending_lp)
            pending_lp = []
        done = self.record(prep, chunk.final, model)
        answers[index] = done
        rest = content_remainder(done.message.get("content"), ts.emitted_text)
        if rest:
            yield writer.text(rest, pending_lp)
            pending_lp = []
        if done.message.get("tool_calls"):
            yield writer.tool_calls(done.message["tool_calls"])
        yield writer.finish(done, pending_lp)

    # ---- health -------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        version = None
        with contextlib.suppress(Exception):
            version = self.engine.get_version()
        return {
            "status": "ok",
            "model": self.model_name,
            "policies": self.routes.names,
            "sessions": self.registry.live_sessions,
            "sessions_held": len(self.registry),
            "sessions_started": self.registry.total_started,
            "sessions_expired": self.registry.total_expired,
            "capacity": self.registry.capacity,
            "rate_limited": self.registry.total_rate_limited,
            "engine_version": version,
            "uptime_s": round(time.time() - self.started_at, 3),
            "requests": dict(self.counters),
            "stats": self.registry.aggregate_stats(),
        }

    @contextlib.contextmanager
    def engine_errors(self, prep: Prepared) -> Iterator[None]:
        """Engine exceptions → client statuses (503 down, 400 too long, 400 invalid; a
        constraint the engine cannot honour names the request's parameter)."""
        try:
            yield
        except HTTPError:
            raise
        except EngineUnavailableError as e:
            raise HTTPError(
                503, f"inference engine unavailable: {e}", code="engine_unavailable"
            ) from None
        except PromptTooLongError:
            raise context_error(prep.protocol, len(prep.prompt_ids), self.max_context_len) from None
        except ConstraintError as e:
            fmt = prep.creq.output_format
            param = fmt.param if fmt is not None else "tools"
            raise bad_request(f"{param}: cannot be honoured: {e}", param) from None
        except ValueError as e:
            raise bad_request(str(e)) from None
        except StopAsyncIteration:
            raise HTTPError(503, "inference engine ended the stream without a result") from None


def context_error(protocol: str, n_prompt: int, limit: int) -> HTTPError:
    """A prompt over the context, in the words each protocol's clients key on: Anthropic's
    "prompt is too long: M tokens > N maximum" (what Claude-Code-style clients compact on),
    OpenAI's ``context_length_exceeded`` with its message. A 400, as both APIs answer."""
    if protocol == "anthropic":
        return HTTPError(400, f"prompt is too long: {n_prompt} tokens > {limit} maximum")
    return HTTPError(
        400,
        f"This model's maximum context length is {limit} tokens. However, your messages "
        f"resulted in {n_prompt} tokens. Please reduce the length of the messages.",
        param="input" if protocol == "responses" else "messages",
        code="context_length_exceeded",
    )


def _with_call_stop(stop: list[str] | None, call_stop: list[str]) -> list[str] | None:
    """The request's stop strings plus the end of a required reply's call block."""
    if not call_stop:
        return stop
    return [*(stop or []), *(s for s in call_stop if s not in (stop or []))]
