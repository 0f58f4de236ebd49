"""``ScriptedEngine``: an :class:`~areal_env.api.engine.InferenceEngine` that answers from a
script, instantly, without a model (like openai-agents' ``agents.testing`` fake model).

Protocol, error and pipeline tests use it so they run in milliseconds and say exactly what
the "model" produced; token-exact paths (splicing, logprobs of real sampling) keep a real model.

    engine = ScriptedEngine(tokenizer, ["Hello!", Reply(text='<tool_call>[...]</tool_call>')])
    with ProxyServer(engine, tokenizer) as proxy: ...
    engine.requests[-1].input_ids  # what the proxy sent

Each request takes the next scripted reply; when the script runs out, ``default`` answers (a
reply, or a function of the request). A reply is text (encoded with the tokenizer, eos
appended), token ids, a :class:`Reply` with logprobs/versions/stop reason/delay, or an
exception to raise (e.g. ``EngineUnavailableError``).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from areal_env.api.engine import EngineUnavailableError, PromptTooLongError
from areal_env.api.io import ModelRequest, ModelResponse, StopReason, StreamChunk


@dataclass
class Reply:
    """One scripted completion.

    ``text`` is encoded with the engine's tokenizer (and ``eos`` appended when
    ``stop_reason == "stop"``); ``token_ids`` are used as they are. ``logprobs``: one per token,
    or one value for all. ``version``: the weight version stamped on every token (default: the
    engine's current one). The request's ``max_new_tokens`` truncates the output (stop reason
    ``length``). ``delay``: seconds before the answer (between tokens when streaming).
    """

    text: str | None = None
    token_ids: list[int] | None = None
    logprobs: list[float] | float = -0.5
    version: int | None = None
    stop_reason: StopReason = "stop"
    delay: float = 0.0
    eos: bool = True


Scripted = Reply | str | list[int] | BaseException
Default = Scripted | Callable[[ModelRequest], Scripted]


@dataclass
class ScriptedEngine:
    """A scripted stand-in for a real engine; records every request in ``requests``."""

    tokenizer: Any = None
    script: Iterable[Scripted] = ()
    default: Default = "OK"
    max_context_len: int = 8192
    model_path: str = "scripted"
    eos_token_ids: list[int] = field(default_factory=list)
    stream_chunk_tokens: int = 1
    supports_state_dict_update: bool = True
    supports_lora: bool = False
    requests: list[ModelRequest] = field(default_factory=list)
    weight_updates: list[Any] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._queue: collections.deque[Scripted] = collections.deque(self.script)
        if not self.eos_token_ids and self.tokenizer is not None:
            eos = getattr(self.tokenizer, "eos_token_id", None)
            self.eos_token_ids = [eos] if isinstance(eos, int) else []
        self._version = 0
        self._paused = False
        self._alive = True

    # ---- scripting --------------------------------------------------------------------------
    def push(self, *replies: Scripted) -> ScriptedEngine:
        """Append replies to the script (answered in order)."""
        self._queue.extend(replies)
        return self

    @property
    def pending(self) -> int:
        """Scripted replies not yet used."""
        return len(self._queue)

    def _next(self, req: ModelRequest) -> Reply:
        item: Any = self._queue.popleft() if self._queue else self.default
        if callable(item) and not isinstance(item, BaseException | type):
            item = item(req)
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, str):
            return Reply(text=item)
        if isinstance(item, list):
            return Reply(token_ids=list(item), eos=False)
        if isinstance(item, Reply):
            return item
        raise TypeError(f"cannot use {item!r} as a scripted reply")

    def _tokens(self, reply: Reply) -> list[int]:
        if reply.token_ids is not None:
            ids = list(reply.token_ids)
        elif reply.text is not None:
            if self.tokenizer is None:
                raise ValueError("a text reply needs ScriptedEngine(tokenizer=...)")
            ids = list(self.tokenizer.encode(reply.text, add_special_tokens=False))
        else:
            ids = []
        if reply.eos and reply.stop_reason == "stop" and self.eos_token_ids:
            ids.append(self.eos_token_ids[0])
        return ids

    def _response(self, req: ModelRequest, reply: Reply) -> ModelResponse:
        ids = self._tokens(reply)
        stop: StopReason = reply.stop_reason
        if len(ids) > req.gconfig.max_new_tokens:
            ids, stop = ids[: req.gconfig.max_new_tokens], "length"
        lps = reply.logprobs
        logprobs = [float(lps)] * len(ids) if isinstance(lps, int | float) else list(lps)
        if len(logprobs) < len(ids):
            raise ValueError(f"scripted reply has {len(ids)} tokens but {len(logprobs)} logprobs")
        version = self._version if reply.version is None else reply.version
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=ids,
            output_logprobs=logprobs[: len(ids)],
            output_versions=[version] * len(ids),
            stop_reason=stop,
            rid=req.rid,
        )

    async def _admit(self, req: ModelRequest) -> Reply:
        if not self._alive:
            raise EngineUnavailableError("scripted engine is destroyed")
        req.gconfig.validate()
        if len(req.input_ids) + 1 > self.max_context_len:
            raise PromptTooLongError(
                f"prompt of {len(req.input_ids)} tokens exceeds the context length "
                f"{self.max_context_len}"
            )
        while self._paused:
            await asyncio.sleep(0.005)
        self.requests.append(req)
        return self._next(req)

    # ---- InferenceEngine --------------------------------------------------------------------
    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        reply = await self._admit(req)
        if reply.delay:
            await asyncio.sleep(reply.delay)
        return self._response(req, reply)

    async def agenerate_stream(self, req: ModelRequest) -> AsyncGenerator[StreamChunk, None]:
        reply = await self._admit(req)
        resp = self._response(req, reply)
        step = max(1, self.stream_chunk_tokens)
        n = len(resp.output_tokens)
        for start in range(0, max(n, 1), step):
            if reply.delay:
                await asyncio.sleep(reply.delay)
            end = min(n, start + step)
            yield StreamChunk(
                token_ids=resp.output_tokens[start:end],
                logprobs=resp.output_logprobs[start:end],
                versions=resp.output_versions[start:end],
                final=resp if end >= n else None,
            )

    def abort(self, rid: str) -> bool:
        """Record the abort (scripted replies finish at once: nothing is ever in flight)."""
        self.aborted.append(rid)
        return False

    def update_weights(self, weights: dict[str, Any] | str) -> None:
        self.weight_updates.append(weights)
        self._version += 1

    def get_version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        self._version = int(version)

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        self._paused = False

    def initialize(self) -> None:
        self._alive = True

    def destroy(self) -> None:
        self._alive = False

    def stats(self) -> dict[str, float]:
        return {"requests": float(len(self.requests)), "pending_script": float(self.pending)}
