"""The embedded inference engine: transformers + continuous batching in one worker thread.

Concurrent ``agenerate`` calls share every decode step. New requests are prefilled together and
merged into the running batch; finished ones leave at the step boundary. All torch work happens in
the worker thread, so the asyncio loops that await results (the proxy's, the trainer's) stay
responsive. Weight updates and pauses take effect between two decode steps: in-flight requests
carry on with the new weights, and each output token records the weight version that produced it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

import torch

from areal_env.api.engine import EngineUnavailableError, PromptTooLongError
from areal_env.api.io import ModelRequest, ModelResponse, StreamChunk
from areal_env.engine._batch import (
    _BatchLoop,
    cache_keyword,
)
from areal_env.engine._json_end import JsonEnd
from areal_env.engine._kv import BatchKV
from areal_env.engine._prefix import PrefixCache
from areal_env.engine._request import _Request
from areal_env.engine._sampling import RowSampling
from areal_env.engine._weights import _WeightUpdates

if TYPE_CHECKING:
    from areal_env.api.config import EngineConfig, ModelConfig

logger = logging.getLogger(__name__)

_STOP_TAIL_TOKENS = 8  # extra tokens decoded around a stop string (multi-byte / merged tokens)


class LocalEngine(_WeightUpdates, _BatchLoop):
    """In-process transformers engine with continuous batching (implements ``InferenceEngine``)."""

    supports_state_dict_update = True
    supports_lora = True
    """``update_weights(folder)`` also takes a peft LoRA adapter folder (merged into the base)."""

    def __init__(
        self,
        model_path: str,
        *,
        device: str = "auto",
        dtype: str = "auto",
        max_batch_size: int = 32,
        max_context_len: int | None = None,
        num_threads: int | None = None,
        prefix_cache_mb: float = 256,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size!r}")
        if prefix_cache_mb < 0:
            raise ValueError(f"prefix_cache_mb must be >= 0 (0 = off), got {prefix_cache_mb!r}")
        self.prefix_cache_mb = prefix_cache_mb
        self._prefix = PrefixCache(0)
        self.model_path = str(model_path)
        self._device_opt = device
        self._dtype_opt = dtype
        self.max_batch_size = max_batch_size
        self._max_context_opt = max_context_len
        self.num_threads = num_threads
        self.max_context_len: int = max_context_len or 0
        self.eos_token_ids: list[int] = []
        self.tokenizer: Any = None
        self.model: Any = None
        self.device = torch.device("cpu")
        self.vocab_size = 0

        self._cv = threading.Condition()
        self._pending: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._live: dict[int, _Request] = {}  # id(request) -> request, until finished
        self._kv: BatchKV | None = None
        self._next_tokens: torch.Tensor | None = None  # [B] last sampled, not yet in the cache
        self._positions: torch.Tensor | None = None  # [B] position of the next fed token
        self._thread: threading.Thread | None = None
        self._alive = False
        self._stopping = False
        self._paused = False
        self._holders = 0  # callers waiting to act at a step boundary (weight updates)
        self._in_step = False
        self._version = 0
        self._lora_base: dict[str, Any] = {}
        """Base weights of the parameters a LoRA adapter changed (adapters merge onto them)."""
        self._log_at, self._log_tokens = 0.0, 0
        self._stats = {
            "requests": 0,
            "finished": 0,
            "aborted": 0,
            "rejected": 0,
            "tokens_generated": 0,
            "prefill_tokens": 0,
            "decode_steps": 0,
            "batch_size_sum": 0,
            "max_batch_size_seen": 0,
            "weight_updates": 0,
            "prefix_cache_hit_tokens": 0,
        }

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def from_config(cls, model: ModelConfig, engine: EngineConfig) -> LocalEngine:
        """Build from the ``model`` and ``engine`` config sections (resolves model names)."""
        from areal_env.engine.models import resolve_model_path

        path = resolve_model_path(model.path, model.cache_dir)
        return cls(
            str(path),
            device=model.device,
            dtype=model.dtype,
            max_batch_size=engine.max_batch_size,
            max_context_len=model.max_context_len,
            num_threads=model.num_threads,
            prefix_cache_mb=engine.prefix_cache_mb,
        )

    def initialize(self) -> None:
        """Load tokenizer and model and start the worker thread (idempotent)."""
        with self._cv:
            if self._alive:
                return
        from transformers import AutoModelForCausalLM, AutoTokenizer

        t0 = time.perf_counter()
        dev = self._device_opt
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(dev)
        dtype = {
            "auto": torch.bfloat16 if self.device.type == "cuda" else torch.float32,
            "float32": torch.float32,
            "bfloat16": torch.bfloat16,
            "float16": torch.float16,
        }.get(self._dtype_opt)
        if dtype is None:
            raise ValueError(
                f"dtype must be auto|float32|bfloat16|float16, got {self._dtype_opt!r}"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype)
        model.to(self.device).eval()
        model.requires_grad_(False)
        self.model = model
        self._cache_keyword = cache_keyword(model)
        cfg = model.config
        self.vocab_size = int(cfg.vocab_size)
        limit = int(getattr(cfg, "max_position_embeddings", 0) or 0) or 2048
        self.max_context_len = min(self._max_context_opt or limit, limit)
        eos: set[int] = set()
        for source in (
            self.tokenizer.eos_token_id,
            getattr(model.generation_config, "eos_token_id", None),
        ):
            if isinstance(source, int):
                eos.add(source)
            elif source:
                eos.update(int(t) for t in source)
        self.eos_token_ids = sorted(eos)
        self._prefix = PrefixCache(self._prefix_budget_tokens(cfg, dtype))
        with self._cv:
            self._alive, self._stopping = True, False
            self._thread = threading.Thread(
                target=self._worker, name="LocalEngine-worker", daemon=True
            )
            self._thread.start()
        logger.info(
            "LocalEngine ready: %s on %s/%s, context %d, batch %d, eos %s (%.1fs)",
            os.path.basename(self.model_path.rstrip("/")),
            self.device,
            str(dtype).replace("torch.", ""),
            self.max_context_len,
            self.max_batch_size,
            self.eos_token_ids,
            time.perf_counter() - t0,
        )

    def _prefix_budget_tokens(self, cfg: Any, dtype: torch.dtype) -> int:
        """Tokens of KV that ``prefix_cache_mb`` holds for this model."""
        heads = int(cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        per_token = int(cfg.num_hidden_layers) * 2 * kv_heads * head_dim * dtype.itemsize
        return int(self.prefix_cache_mb * 2**20) // per_token

    def destroy(self) -> None:
        """Stop the worker; unfinished requests end with ``stop_reason="abort"``."""
        with self._cv:
            if not self._alive:
                return
            self._alive = False
            self._stopping = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._cv:
            leftovers = list(self._running) + list(self._pending)
            self._running, self._pending = [], deque()
            self._kv = None
        for r in leftovers:
            if not r.done:
                self._finish(r, "abort")
        self.model = None
        logger.info("LocalEngine destroyed (%d unfinished requests aborted)", len(leftovers))

    # ------------------------------------------------------------------ versions, pause
    # (weight updates: engine/_weights.py; the decode loop: engine/_batch.py)
    def get_version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        with self._cv:
            self._version = int(version)

    def pause(self) -> None:
        """Hold generation at the next step boundary (returns once no step is running).

        Requests keep arriving and wait; none is lost. ``resume()`` continues them.
        """
        with self._cv:
            self._paused = True
            while self._in_step:
                self._cv.wait()

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def stats(self) -> dict[str, float]:
        """Counters: requests, tokens generated, decode steps, mean/max batch size, queue."""
        with self._cv:
            s: dict[str, float] = dict(self._stats)
            s["running"] = len(self._live) - len(self._pending)  # incl. being prefilled
            s["queued"] = len(self._pending)
            s["version"] = self._version
        s["prefix_cache_tokens"] = self._prefix.tokens
        s["prefix_cache_capacity_tokens"] = self._prefix.max_tokens
        steps = s["decode_steps"]
        s["mean_batch_size"] = s["batch_size_sum"] / steps if steps else 0.0
        return s

    # ------------------------------------------------------------------ request API
    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate a completion; callable from any event loop or thread."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[ModelResponse] = loop.create_future()

        def settle(item: Any) -> None:
            if fut.done():
                return
            if isinstance(item, BaseException):
                fut.set_exception(item)
            elif isinstance(item, ModelResponse):
                fut.set_result(item)

        r = self._submit(req, self._threadsafe(loop, settle), stream=False)
        try:
            return await fut
        except asyncio.CancelledError:
            r.cancelled = True
            self._wake()
            raise

    async def agenerate_stream(self, req: ModelRequest) -> AsyncGenerator[StreamChunk, None]:
        """Yield a ``StreamChunk`` per decode step; the last one carries ``final``."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        r = self._submit(req, self._threadsafe(loop, queue.put_nowait), stream=True)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.final is not None:
                    return
        finally:
            if not r.done:
                r.cancelled = True
                self._wake()

    def abort(self, rid: str) -> bool:
        """End request ``rid`` with ``stop_reason="abort"`` and the tokens produced so far.

        Answered at once when no decode step is running (e.g. while paused), otherwise at the end
        of the current step. Returns False if no such request is in flight.
        """
        with self._cv:
            for r in list(self._live.values()):
                if r.req.rid != rid or r.done:
                    continue
                if self._in_step:
                    r.aborted = True
                else:  # the worker is idle or paused: answer now; it drops the row later
                    if r in self._pending:
                        self._pending.remove(r)
                    self._finish(r, "abort")
                self._cv.notify_all()
                return True
        return False

    @staticmethod
    def _threadsafe(
        loop: asyncio.AbstractEventLoop, fn: Callable[[Any], None]
    ) -> Callable[[Any], None]:
        def deliver(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(fn, item)
            except RuntimeError:  # the caller's loop is closed: nobody is waiting any more
                pass

        return deliver

    def _require_alive(self) -> None:
        if not self._alive:
            raise EngineUnavailableError(
                "LocalEngine is not running (call initialize(); destroyed engines cannot serve)"
            )

    def _validate(self, req: ModelRequest) -> None:
        ids = req.input_ids
        if not isinstance(ids, (list, tuple)) or len(ids) == 0:
            raise ValueError("input_ids must be a non-empty list of token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("input_ids must contain only integers")
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) + 1 > self.max_context_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; with at least one new token it exceeds the "
                f"context length {self.max_context_len}"
            )
        req.gconfig.validate()

    def _submit(self, req: ModelRequest, deliver: Callable[[Any], None], stream: bool) -> _Request:
        self._require_alive()
        try:
            self._validate(req)
        except ValueError:
            with self._cv:
                self._stats["rejected"] += 1
            raise
        g = req.gconfig
        stop_ids = set() if g.ignore_eos else set(self.eos_token_ids) | set(g.stop_token_ids or [])
        stop_strs = list(g.stop or [])
        rng = None
        if not g.is_greedy:
            rng = random.Random(g.seed if g.seed is not None else int.from_bytes(os.urandom(8)))
        r = _Request(
            req=req,
            deliver=deliver,
            stream=stream,
            submitted=time.perf_counter(),
            max_new=min(g.max_new_tokens, self.max_context_len - len(req.input_ids)),
            stop_ids=frozenset(stop_ids),
            stop_strs=stop_strs,
            stop_window=(max(len(s) for s in stop_strs) + _STOP_TAIL_TOKENS) if stop_strs else 0,
            sampling=RowSampling(
                greedy=g.is_greedy,
                temperature=float(g.temperature),
                top_k=int(g.top_k),
                top_p=float(g.top_p),
                rng=rng,
                choices=[list(c) for c in g.prefix_choices] if g.prefix_choices else None,
                explore=float(g.choice_exploration),
            ),
            json_end=JsonEnd(g.stop_at_json_end) if g.stop_at_json_end is not None else None,
        )
        with self._cv:
            if not self._alive:
                raise EngineUnavailableError("LocalEngine was destroyed")
            self._pending.append(r)
            self._live[id(r)] = r
            self._stats["requests"] += 1
            self._cv.notify_all()
        return r

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()
