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
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

import torch

from areal_env.api.engine import PromptTooLongError
from areal_env.api.io import ModelRequest, ModelResponse, StreamChunk
from areal_env.engine.adapters import AdapterEngine, AdapterWeights
from areal_env.engine.batch_worker import BatchWorker
from areal_env.engine.cpu_linear import set_onednn_linears
from areal_env.engine.grammar import GrammarCompiler, RowGrammar
from areal_env.engine.json_end import JsonEnd
from areal_env.engine.models import load_causal_lm
from areal_env.engine.prefix_cache import PrefixCache
from areal_env.engine.request_state import RequestState
from areal_env.engine.sampler import RowSampling
from areal_env.engine.weight_updater import WeightUpdater

if TYPE_CHECKING:
    from areal_env.api.config import EngineConfig, ModelConfig

logger = logging.getLogger(__name__)

_STOP_TAIL_TOKENS = 8  # extra tokens decoded around a stop string (multi-byte / merged tokens)


def _close_margin(max_new_tokens: int) -> int:
    """The last tokens of a constrained row's budget in which it closes what is open (see
    ``RowGrammar.close``): a third of the budget, at most 32 tokens."""
    return min(32, max_new_tokens // 3)


class LocalEngine:
    """In-process transformers engine with continuous batching (implements ``InferenceEngine``).

    It checks and queues requests; its ``worker`` (a ``BatchWorker``) runs the decode loop and
    owns the batch state, and its ``weights`` (a ``WeightUpdater``) swaps weights in between two
    of the worker's steps.
    """

    supports_state_dict_update = True
    supports_lora = True
    """``update_weights(folder)`` also takes a peft LoRA adapter folder (merged into the base);
    named adapters (``load_adapter``) are served unmerged, each row with its own."""

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
        share_prefixes: bool = True,
        onednn_linear: bool = True,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size!r}")
        if prefix_cache_mb < 0:
            raise ValueError(f"prefix_cache_mb must be >= 0 (0 = off), got {prefix_cache_mb!r}")
        self.prefix_cache_mb = prefix_cache_mb
        self.onednn_linear = onednn_linear
        """Run the fp32 CPU products of the linear layers through oneDNN
        (``engine.cpu_linear``): faster decode steps and prefills, the same fp32 arithmetic."""
        self.model_path = str(model_path)
        self._device_opt = device
        self._dtype_opt = dtype
        self._max_context_opt = max_context_len
        self.max_context_len: int = max_context_len or 0
        self.eos_token_ids: list[int] = []
        self.vocab_size = 0
        self.worker = BatchWorker(
            max_batch_size=max_batch_size, num_threads=num_threads, share_prefixes=share_prefixes
        )
        self.weights = WeightUpdater(self.worker)
        self.grammars: GrammarCompiler | None = None
        """Compiles ``GenerationConfig.constraint`` (made with the tokenizer)."""
        self._rejected = 0  # requests refused by validation (they never reach the worker)
        self._rejected_lock = threading.Lock()

    # The model, its tokenizer and device live with the worker (the decode loop uses them).
    @property
    def model(self) -> Any:
        return self.worker.model

    @property
    def tokenizer(self) -> Any:
        return self.worker.tokenizer

    @property
    def device(self) -> torch.device:
        return self.worker.device

    @property
    def max_batch_size(self) -> int:
        return self.worker.max_batch_size

    @property
    def num_threads(self) -> int | None:
        return self.worker.num_threads

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def from_config(cls, model: ModelConfig, engine: EngineConfig) -> LocalEngine:
        """Build from the ``model`` and ``engine`` config sections (resolves model names)."""
        from areal_env.engine.models import resolve_model_path

        path = resolve_model_path(model.path, model.cache_dir)
        return cls(
            str(path),
            device=model.device,
            dtype=engine.served_dtype(model),
            max_batch_size=engine.max_batch_size,
            max_context_len=model.max_context_len,
            num_threads=model.num_threads,
            prefix_cache_mb=engine.prefix_cache_mb,
            share_prefixes=engine.share_prefixes,
            onednn_linear=engine.cpu_linear == "onednn",
        )

    def initialize(self) -> None:
        """Load tokenizer and model and start the worker thread (idempotent)."""
        if self.worker.alive:
            return
        from transformers import AutoTokenizer

        t0 = time.perf_counter()
        dev = self._device_opt
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(dev)
        dtype = {
            "auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
            "float32": torch.float32,
            "bfloat16": torch.bfloat16,
            "float16": torch.float16,
        }.get(self._dtype_opt)
        if dtype is None:
            raise ValueError(
                f"dtype must be auto|float32|bfloat16|float16, got {self._dtype_opt!r}"
            )
        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        model = load_causal_lm(self.model_path, dtype=dtype)
        model.to(device).eval()
        model.requires_grad_(False)
        if self.onednn_linear and device.type == "cpu" and dtype == torch.float32:
            set_onednn_linears(model, True)
        cfg = model.config
        self.vocab_size = int(cfg.vocab_size)
        limit = int(getattr(cfg, "max_position_embeddings", 0) or 0) or 2048
        self.max_context_len = min(self._max_context_opt or limit, limit)
        eos: set[int] = set()
        for source in (
            tokenizer.eos_token_id,
            getattr(model.generation_config, "eos_token_id", None),
        ):
            if isinstance(source, int):
                eos.add(source)
            elif source:
                eos.update(int(t) for t in source)
        self.eos_token_ids = sorted(eos)
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size, self.eos_token_ids)
        cache = PrefixCache(self._prefix_budget_tokens(cfg, dtype))
        self.worker.start(model, tokenizer, device, cache)
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
        aborted = self.worker.stop()
        if aborted is None:
            return
        logger.info("LocalEngine destroyed (%d unfinished requests aborted)", aborted)

    # ------------------------------------------------------------------ weights, versions, pause
    def update_weights(self, weights: dict[str, torch.Tensor] | str) -> None:
        """Swap in new weights between two decode steps, then bump the version.

        ``weights`` is a state dict (same parameter names as the loaded model), the path of an
        HF model folder or of a peft LoRA adapter folder (merged onto the base weights). Blocks
        until the swap is done; safe to call from any thread. In-flight requests continue with
        the new weights.
        """
        self.weights.update(weights)

    # ------------------------------------------------------------------ named LoRA adapters
    def load_adapter(self, name: str, weights: AdapterWeights | str | os.PathLike[str]) -> None:
        """Load (or replace) LoRA adapter ``name`` (a peft adapter folder or ``AdapterWeights``):
        requests naming it (``ModelRequest.adapter``) are decoded with it, in the same batches
        as every other adapter's and the base model's. Swapped in between two decode steps;
        the weight version is not moved (all adapters share the engine's clock)."""
        self.weights.load_adapter(name, weights)

    def unload_adapter(self, name: str) -> None:
        self.weights.unload_adapter(name)

    @property
    def adapter_names(self) -> list[str]:
        adapters = self.worker.adapters
        return adapters.names if adapters is not None else []

    def adapter(self, name: str) -> AdapterEngine:
        """Adapter ``name`` as an ``InferenceEngine`` of its own (see ``AdapterEngine``)."""
        return AdapterEngine(self, name)

    def set_prefix_cache_mb(self, mb: float) -> None:
        """Resize (and empty) the prefix cache at a step boundary; 0 turns it off."""
        if mb < 0:
            raise ValueError(f"prefix_cache_mb must be >= 0 (0 = off), got {mb!r}")
        with self.worker.at_step_boundary():
            self.prefix_cache_mb = mb
            self.worker.prefix_cache = PrefixCache(
                self._prefix_budget_tokens(self.model.config, self.model.dtype)
            )

    def get_version(self) -> int:
        return self.worker.version

    def set_version(self, version: int) -> None:
        self.worker.set_version(version)

    def pause(self) -> None:
        """Hold generation at the next step boundary (returns once no step is running).

        Requests keep arriving and wait; none is lost. ``resume()`` continues them.
        """
        self.worker.pause()

    def resume(self) -> None:
        self.worker.resume()

    @property
    def paused(self) -> bool:
        return self.worker.paused

    def stats(self) -> dict[str, float]:
        """Counters: requests, tokens generated, decode steps, mean/max batch size, queue."""
        s = self.worker.stats()
        s["rejected"] = self._rejected
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

        grammar = await self._compile(req)
        r = self._submit(req, self._threadsafe(loop, settle), stream=False, grammar=grammar)
        try:
            return await fut
        except asyncio.CancelledError:
            self.worker.cancel(r)
            raise

    async def agenerate_stream(self, req: ModelRequest) -> AsyncGenerator[StreamChunk, None]:
        """Yield a ``StreamChunk`` per decode step; the last one carries ``final``."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        grammar = await self._compile(req)
        r = self._submit(
            req, self._threadsafe(loop, queue.put_nowait), stream=True, grammar=grammar
        )
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
                self.worker.cancel(r)

    def abort(self, rid: str) -> bool:
        """End request ``rid`` with ``stop_reason="abort"`` and the tokens produced so far.

        Answered at once when no decode step is running (e.g. while paused), otherwise at the end
        of the current step. Returns False if no such request is in flight.
        """
        return self.worker.abort(rid)

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

    async def _compile(self, req: ModelRequest) -> RowGrammar | None:
        """The row's grammar matcher for ``req.gconfig.constraint`` (compiled off the event loop
        unless cached); ``ConstraintError`` (a ``ValueError``) if it cannot be honoured."""
        constraint = req.gconfig.constraint
        if constraint is None:
            return None
        self.worker.require_alive()
        grammars = self.grammars
        assert grammars is not None  # made by initialize()
        try:
            if grammars.cached(constraint):
                return grammars.matcher(constraint)
            return await asyncio.to_thread(grammars.matcher, constraint)
        except ValueError:
            with self._rejected_lock:
                self._rejected += 1
            raise

    def _submit(
        self,
        req: ModelRequest,
        deliver: Callable[[Any], None],
        stream: bool,
        grammar: RowGrammar | None = None,
    ) -> RequestState:
        self.worker.require_alive()
        try:
            self._validate(req)
        except ValueError:
            with self._rejected_lock:
                self._rejected += 1
            raise
        g = req.gconfig
        stop_ids = set() if g.ignore_eos else set(self.eos_token_ids) | set(g.stop_token_ids or [])
        stop_strs = list(g.stop or [])
        rng = None
        if not g.is_greedy:
            rng = random.Random(g.seed if g.seed is not None else int.from_bytes(os.urandom(8)))
        r = RequestState(
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
                decision_pending=bool(g.prefix_decision),
                guided=bool(g.prefix_guided),
            ),
            json_end=(
                JsonEnd(g.stop_at_json_end, g.json_end_depth)
                if g.stop_at_json_end is not None
                else None
            ),
            grammar=grammar,
            close_margin=_close_margin(g.max_new_tokens) if grammar is not None else 0,
            top_logprobs=int(g.top_logprobs),
        )
        if req.adapter is not None:
            adapters = self.worker.adapters
            if adapters is None or req.adapter not in adapters:
                with self._rejected_lock:
                    self._rejected += 1
                loaded = ", ".join(self.adapter_names) or "none"
                raise ValueError(f"no LoRA adapter named {req.adapter!r} is loaded ({loaded})")
            r.adapter = adapters.slot(req.adapter)
            r.key_offset = r.adapter * self.vocab_size
        self.worker.submit(r)
        return r
