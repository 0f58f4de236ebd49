"""The embedded inference engine: transformers + continuous batching in one worker thread.

Concurrent ``agenerate`` calls share every decode step. New requests are prefilled together and
merged into the running batch; finished ones leave at the step boundary. All torch work happens in
the worker thread, so the asyncio loops that await results (the proxy's, the trainer's) stay
responsive. Weight updates and pauses take effect between two decode steps: in-flight requests
carry on with the new weights, and each output token records the weight version that produced it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from areal_env.api.engine import EngineUnavailableError, PromptTooLongError
from areal_env.api.io import ModelRequest, ModelResponse, StreamChunk
from areal_env.api.tokens import common_prefix_len
from areal_env.engine._json_end import JsonEnd
from areal_env.engine._kv import _GROW, BatchKV
from areal_env.engine._prefix import PrefixCache
from areal_env.engine._sampling import RowSampling, sample_rows
from areal_env.engine.lora import (
    apply_adapter,
    is_adapter_folder,
    load_adapter_folder,
    split_adapter,
)

if TYPE_CHECKING:
    from areal_env.api.config import EngineConfig, ModelConfig

logger = logging.getLogger(__name__)

_STOP_TAIL_TOKENS = 8  # extra tokens decoded around a stop string (multi-byte / merged tokens)
_MAX_PREFILL_TOKENS = 8192  # padded prompt tokens prefilled in one forward (bounds decode stalls)
_LOG_EVERY_S = 30.0  # progress log interval while busy
_MIN_PREFIX = 32  # shortest cached prefix worth a separate prefill path


@dataclass(eq=False)  # identity semantics: requests are compared/removed by object
class _Request:
    """A request's state inside the engine (touched by the worker thread only, except flags)."""

    req: ModelRequest
    deliver: Callable[[Any], None]  # thread-safe: hands a result/chunk/exception to the caller
    stream: bool
    submitted: float
    max_new: int
    stop_ids: frozenset[int]
    stop_strs: list[str]
    stop_window: int
    sampling: RowSampling
    out_tokens: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    out_versions: list[int] = field(default_factory=list)
    sent: int = 0  # tokens already streamed
    first_token_at: float = 0.0
    cancelled: bool = False  # set from other threads: drop silently
    aborted: bool = False  # set from other threads: finish with stop_reason "abort"
    done: bool = False
    reason: str = ""  # why it stopped (set by _check_done)
    json_end: JsonEnd | None = None  # GenerationConfig.stop_at_json_end


def _allowed(rows: list[_Request]) -> list[list[int] | None] | None:
    """Each row's allowed next tokens under its constrained start (None when no row has one)."""
    if not any(r.sampling.choices for r in rows):
        return None
    return [r.sampling.allowed(r.out_tokens) for r in rows]


def _length_groups(
    reqs: list[_Request],
    max_waste: float = 0.2,
    size: Callable[[_Request], int] = lambda r: len(r.req.input_ids),
) -> list[list[_Request]]:
    """Split requests (longest first) so that each group's left padding stays under ``max_waste``.

    Padding is wasted compute in the prefill forward; one extra forward costs far less.
    ``size`` is the tokens a request prefills (its prompt, or the part beyond a cached prefix).
    """
    ordered = sorted(reqs, key=size, reverse=True)
    groups: list[list[_Request]] = []
    real = 0
    for r in ordered:
        n = size(r)
        if groups:
            group = groups[-1]
            longest = size(group[0])
            if (len(group) + 1) * longest <= (1.0 + max_waste) * (real + n):
                group.append(r)
                real += n
                continue
        groups.append([r])
        real = n
    return groups


class LocalEngine:
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

    # ------------------------------------------------------------------ versions, pause, weights
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

    @contextlib.contextmanager
    def _at_step_boundary(self) -> Iterator[None]:
        """Hold the decode loop between two steps while the block runs (waits for the running
        step to finish; generation continues afterwards)."""
        self._require_alive()
        with self._cv:
            self._holders += 1
            while self._in_step:
                self._cv.wait()
        try:
            yield
        finally:
            with self._cv:
                self._holders -= 1
                self._cv.notify_all()

    def update_weights(self, weights: dict[str, torch.Tensor] | str) -> None:
        """Swap in new weights between two decode steps, then bump the version.

        ``weights`` is a state dict (same parameter names as the loaded model) or the path of an
        HF model folder. Blocks until the swap is done; safe to call from any thread. In-flight
        requests continue with the new weights.
        """
        with self._at_step_boundary():
            t0 = time.perf_counter()
            if isinstance(weights, (str, os.PathLike)) and is_adapter_folder(weights):
                self._apply_adapter(str(weights))
                state = None
            elif isinstance(weights, (str, os.PathLike)):
                state = self._load_folder(str(weights))
            elif isinstance(weights, dict):
                state = weights
            else:
                raise TypeError(
                    f"update_weights takes a state dict or a path, got {type(weights)!r}"
                )
            if state is not None:
                self._load_state(state)
                self._lora_base = {}  # new base weights: a later adapter merges onto these
            self._prefix.clear()  # cached KV belongs to the old weights
            with self._cv:
                self._version += 1
                self._stats["weight_updates"] += 1
            logger.info(
                "weights updated to version %d in %.2fs", self._version, time.perf_counter() - t0
            )

    def set_prefix_cache_mb(self, mb: float) -> None:
        """Resize (and empty) the prefix cache at a step boundary; 0 turns it off."""
        if mb < 0:
            raise ValueError(f"prefix_cache_mb must be >= 0 (0 = off), got {mb!r}")
        with self._at_step_boundary():
            self.prefix_cache_mb = mb
            self._prefix = PrefixCache(
                self._prefix_budget_tokens(self.model.config, self.model.dtype)
            )

    def _apply_adapter(self, path: str) -> None:
        """Merge a LoRA adapter into the weights: ``W = W_base + (alpha / r) * B @ A``, always
        from the base weights (a new adapter replaces the previous one, never stacks on it)."""
        tensors, cfg = load_adapter_folder(path)
        params = dict(self.model.named_parameters())
        base = self._lora_base
        names = {n for n in split_adapter(tensors)}
        for n in names:
            if n not in params:
                raise ValueError(f"update_weights: the adapter targets {n}, not in the model")
            if n not in base:
                base[n] = params[n].detach().clone()
        merged = apply_adapter(base, tensors, cfg)
        with torch.no_grad():
            for n, w in merged.items():
                params[n].copy_(w)
        logger.info("LoRA adapter %s merged into %d weight matrices", path, len(merged))

    def _load_folder(self, path: str) -> dict[str, torch.Tensor]:
        from transformers import AutoModelForCausalLM

        if not os.path.isdir(path):
            raise ValueError(f"update_weights: {path!r} is not a model folder")
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=self.model.dtype)
        return loaded.state_dict()

    def _load_state(self, state: dict[str, torch.Tensor]) -> None:
        # Tied weights (lm_head = embed_tokens) may be absent from a state dict: not an error.
        tied = set(getattr(self.model, "_tied_weights_keys", None) or {})
        with torch.no_grad():
            result = self.model.load_state_dict(state, strict=False)
        missing = [k for k in result.missing_keys if k not in tied]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"update_weights: state dict does not match the model "
                f"(missing {missing[:5]}, unexpected {list(result.unexpected_keys)[:5]})"
            )

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

    # ------------------------------------------------------------------ worker
    def _log_progress(self) -> None:
        now = time.perf_counter()
        s = self._stats
        if not (self._running or self._pending):  # going idle: restart the window
            self._log_at, self._log_tokens = now, s["tokens_generated"]
            return
        if now - self._log_at < _LOG_EVERY_S:
            return
        tokens = s["tokens_generated"] - self._log_tokens
        if tokens:
            logger.info(
                "generating: %.1f tok/s over %.0fs, batch %d, queued %d, version %d",
                tokens / (now - self._log_at),
                now - self._log_at,
                len(self._running),
                len(self._pending),
                self._version,
            )
        self._log_at, self._log_tokens = now, s["tokens_generated"]

    def _worker(self) -> None:
        torch.set_grad_enabled(False)
        if self.num_threads:
            # OpenMP thread counts are per calling thread: set it where the model work runs.
            torch.set_num_threads(self.num_threads)
        self._log_at, self._log_tokens = time.perf_counter(), 0
        while True:
            with self._cv:
                while not self._stopping and (
                    self._paused or self._holders > 0 or not (self._pending or self._running)
                ):
                    self._cv.wait()
                if self._stopping:
                    return
                self._in_step = True
                admit = self._take_pending()
            try:
                with torch.inference_mode():
                    self._step(admit)
                self._log_progress()
            except Exception as exc:  # keep serving: fail only the requests of this batch
                logger.exception("generation step failed; failing %d requests", len(self._running))
                for r in self._running + admit:
                    if not r.done:
                        r.done = True
                        self._live.pop(id(r), None)
                        r.deliver(RuntimeError(f"generation failed: {exc}"))
                self._running, self._kv = [], None
                self._next_tokens = self._positions = None
            finally:
                with self._cv:
                    self._in_step = False
                    self._cv.notify_all()

    def _take_pending(self) -> list[_Request]:
        """Requests to prefill now (caller holds the lock); drops cancelled ones."""
        admit: list[_Request] = []
        room = self.max_batch_size - len(self._running)
        longest = 0
        while self._pending and len(admit) < room:
            r = self._pending[0]
            n_in = len(r.req.input_ids)
            if admit and (len(admit) + 1) * max(longest, n_in) > _MAX_PREFILL_TOKENS:
                break  # the rest joins at the next step boundary
            self._pending.popleft()
            if r.cancelled:
                self._finish(r, "cancel")
                continue
            if r.aborted:
                self._finish(r, "abort")
                continue
            admit.append(r)
            longest = max(longest, n_in)
        return admit

    def _step(self, admit: list[_Request]) -> None:
        version = self._version
        if admit:
            self._prefill(admit, version)
        if not self._running:
            return
        kv = self._kv
        assert kv is not None and self._next_tokens is not None and self._positions is not None
        mask = kv.mask_for_step(1)
        out = self.model(
            input_ids=self._next_tokens[:, None],
            attention_mask=mask,
            position_ids=self._positions[:, None],
            past_key_values=kv.cache,
            use_cache=True,
        )
        kv.advance(1)
        self._positions += 1
        logits = out.logits[:, -1, :]
        tokens, logps = sample_rows(
            logits, [r.sampling for r in self._running], _allowed(self._running)
        )
        self._stats["decode_steps"] += 1
        self._stats["batch_size_sum"] += len(self._running)
        self._stats["max_batch_size_seen"] = max(
            self._stats["max_batch_size_seen"], len(self._running)
        )
        self._record(self._running, tokens, logps, version)
        self._next_tokens = torch.tensor(tokens, dtype=torch.long, device=self.device)
        self._retire()

    def _prefill(self, admit: list[_Request], version: int) -> None:
        """Prefill new requests in groups of similar length (little padding), then merge them.

        With the prefix cache on, requests whose prompt starts with a cached prefix only prefill
        the rest; a long prefix shared by several new requests is prefilled once first.
        """
        plain: list[_Request] = admit
        cached: list[_Request] = []
        if self._prefix.enabled:
            self._seed_shared_prefixes(admit)
            plain, cached = [], []
            for r in admit:
                n = self._prefix.match_length(r.req.input_ids, len(r.req.input_ids) - 1)
                (cached if n >= _MIN_PREFIX else plain).append(r)
        for group in _length_groups(plain):
            self._prefill_group(group, version)
        if cached:
            rest = {
                id(r): len(r.req.input_ids)
                - self._prefix.match_length(r.req.input_ids, len(r.req.input_ids) - 1)
                for r in cached
            }
            for group in _length_groups(cached, size=lambda r: rest[id(r)]):
                self._prefill_cached(group, version)

    def _seed_shared_prefixes(self, admit: list[_Request]) -> None:
        """Prefill, once, each long prefix that several of ``admit`` share and the cache lacks."""
        ids = sorted(
            (r.req.input_ids for r in admit if self._prefix.match_length(r.req.input_ids) == 0),
            key=tuple,
        )
        i = 0
        while i + 1 < len(ids):
            shared = common_prefix_len(ids[i], ids[i + 1])
            j = i + 1
            while j + 1 < len(ids):
                nxt = min(shared, common_prefix_len(ids[j], ids[j + 1]))
                if nxt < _MIN_PREFIX:
                    break
                shared, j = nxt, j + 1
            shared = min(shared, min(len(x) for x in ids[i : j + 1]) - 1)
            if shared >= _MIN_PREFIX:
                prefix = list(ids[i][:shared])
                from transformers import DynamicCache

                cache = DynamicCache()
                self.model(
                    input_ids=torch.tensor([prefix], dtype=torch.long, device=self.device),
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                self._stats["prefill_tokens"] += shared
                self._prefix.insert(prefix, BatchKV.stack_prefill(cache)[:, :, 0])
                i = j + 1
            else:
                i += 1

    def _prefill_group(self, admit: list[_Request], version: int) -> None:
        lengths = [len(r.req.input_ids) for r in admit]
        T = max(lengths)
        ids = torch.zeros((len(admit), T), dtype=torch.long)
        mask = torch.zeros((len(admit), T), dtype=torch.bool)
        for i, r in enumerate(admit):
            ids[i, T - lengths[i] :] = torch.tensor(r.req.input_ids, dtype=torch.long)
            mask[i, T - lengths[i] :] = True
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        from transformers import DynamicCache

        cache = DynamicCache()
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self._stats["prefill_tokens"] += sum(lengths)
        self._admit_prefilled(
            admit, out.logits[:, -1, :], BatchKV.stack_prefill(cache), mask, version
        )

    def _prefill_cached(self, admit: list[_Request], version: int) -> None:
        """Prefill requests whose prompts start with a cached prefix: only the rest is computed.

        Row layout (columns): ``[pad, cached prefix | pad, rest of the prompt]`` — the prefixes
        right-aligned at column P, the rests right-aligned at the end, so the last column holds
        every row's last prompt token. Pad columns are masked out; position ids count real tokens.
        """
        matches = [self._prefix.match(r.req.input_ids, len(r.req.input_ids) - 1) for r in admit]
        if any(n == 0 for n, _ in matches):  # evicted since it was looked up: prefill it whole
            self._prefill_group(
                [r for r, (n, _) in zip(admit, matches, strict=True) if n == 0], version
            )
            kept = [(r, m) for r, m in zip(admit, matches, strict=True) if m[0] > 0]
            if not kept:
                return
            admit, matches = [r for r, _ in kept], [m for _, m in kept]
        P = max(n for n, _ in matches)
        rests = [len(r.req.input_ids) - n for r, (n, _) in zip(admit, matches, strict=True)]
        S = max(rests)
        L, two, H, _, D = matches[0][1].shape
        n_rows = len(admit)
        buf = matches[0][1].new_zeros((L, two, n_rows, H, P + S + _GROW, D))
        mask = torch.zeros((n_rows, P + S + _GROW), dtype=torch.bool, device=self.device)
        ids = torch.zeros((n_rows, S), dtype=torch.long)
        pos = torch.zeros((n_rows, S), dtype=torch.long)
        for i, (r, (n, kv)) in enumerate(zip(admit, matches, strict=True)):
            buf[:, :, i, :, P - n : P] = kv
            mask[i, P - n : P] = True
            mask[i, P + S - rests[i] : P + S] = True
            ids[i, S - rests[i] :] = torch.tensor(r.req.input_ids[n:], dtype=torch.long)
            pos[i, S - rests[i] :] = torch.arange(n, n + rests[i])
            pos[i, : S - rests[i]] = n
            self._stats["prefix_cache_hit_tokens"] += n
        kv_state = BatchKV(buf, mask, 0, P)
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=mask[:, : P + S],
            position_ids=pos.to(self.device),
            past_key_values=kv_state.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        kv_state.advance(S)
        self._stats["prefill_tokens"] += sum(rests)
        self._admit_prefilled(
            admit, out.logits[:, -1, :], buf[..., : P + S, :], mask[:, : P + S], version
        )

    def _admit_prefilled(
        self,
        admit: list[_Request],
        logits: torch.Tensor,
        new_kv: torch.Tensor,
        mask: torch.Tensor,
        version: int,
    ) -> None:
        """Sample each prefilled row's first token, cache the prompts' KV and merge the rows that
        go on into the running batch (``new_kv`` ``[L,2,n,H,T,D]``, ``mask`` ``[n,T]``)."""
        lengths = [len(r.req.input_ids) for r in admit]
        if self._prefix.enabled:
            for i, r in enumerate(admit):
                if lengths[i] >= _MIN_PREFIX:
                    self._prefix.insert(r.req.input_ids, new_kv[:, :, i][:, :, :, mask[i]])
        tokens, logps = sample_rows(logits, [r.sampling for r in admit], _allowed(admit))
        now = time.perf_counter()
        for r in admit:
            r.first_token_at = now
        self._record(admit, tokens, logps, version)
        keep = [i for i, r in enumerate(admit) if not self._check_done(r)]
        for i, r in enumerate(admit):
            if i not in keep:
                self._finish(r, r.reason)
        if not keep:
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        if len(keep) < len(admit):
            new_kv, mask = new_kv.index_select(2, idx), mask.index_select(0, idx)
        new_tokens = torch.tensor([tokens[i] for i in keep], dtype=torch.long, device=self.device)
        new_pos = torch.tensor([lengths[i] for i in keep], dtype=torch.long, device=self.device)
        self._kv = BatchKV.merge(self._kv, new_kv, mask)
        if self._running:
            assert self._next_tokens is not None and self._positions is not None
            self._next_tokens = torch.cat([self._next_tokens, new_tokens])
            self._positions = torch.cat([self._positions, new_pos])
        else:
            self._next_tokens, self._positions = new_tokens, new_pos
        self._running.extend(admit[i] for i in keep)
        logger.debug("admitted %d requests; batch size %d", len(keep), len(self._running))

    def _record(
        self, rows: list[_Request], tokens: list[int], logps: list[float], version: int
    ) -> None:
        for r, t, lp in zip(rows, tokens, logps, strict=True):
            r.out_tokens.append(t)
            r.out_logprobs.append(lp)
            r.out_versions.append(version)
        self._stats["tokens_generated"] += len(rows)

    def _check_done(self, r: _Request) -> bool:
        """Decide whether ``r`` stops after its latest token (reason stored on the request)."""
        reason = None
        if r.done:  # already answered (aborted while the worker was paused)
            reason = "gone"
        elif r.cancelled:
            reason = "cancel"
        elif r.aborted:
            reason = "abort"
        elif r.out_tokens[-1] in r.stop_ids:
            reason = "stop"
        elif r.stop_strs and self._hit_stop_string(r):
            reason = "stop"
        elif r.json_end is not None and r.json_end.feed(
            self.tokenizer.decode(r.out_tokens[-1:], skip_special_tokens=False)
        ):
            reason = "stop"
        elif len(r.out_tokens) >= r.max_new:
            reason = "length"
        if reason is None:
            if r.stream:
                self._send_chunk(r)
            return False
        r.reason = reason
        return True

    def _hit_stop_string(self, r: _Request) -> bool:
        tail = self.tokenizer.decode(r.out_tokens[-r.stop_window :], skip_special_tokens=False)
        return any(s in tail for s in r.stop_strs)

    def _retire(self) -> None:
        """Finish rows that are done (or cancelled) and shrink the batch."""
        keep: list[int] = []
        for i, r in enumerate(self._running):
            if self._check_done(r):
                self._finish(r, r.reason)
            else:
                keep.append(i)
        if len(keep) == len(self._running):
            return
        if not keep:
            self._running, self._kv = [], None
            self._next_tokens = self._positions = None
            return
        assert (
            self._kv is not None and self._next_tokens is not None and self._positions is not None
        )
        self._kv.select(keep)
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self._next_tokens = self._next_tokens.index_select(0, idx)
        self._positions = self._positions.index_select(0, idx)
        self._running = [self._running[i] for i in keep]

    def _send_chunk(self, r: _Request) -> None:
        n = len(r.out_tokens)
        if n > r.sent:
            r.deliver(
                StreamChunk(
                    token_ids=r.out_tokens[r.sent : n],
                    logprobs=r.out_logprobs[r.sent : n],
                    versions=r.out_versions[r.sent : n],
                )
            )
            r.sent = n

    def _finish(self, r: _Request, reason: str) -> None:
        if reason == "gone":
            return
        r.done = True
        with self._cv:
            self._live.pop(id(r), None)
        if reason == "cancel":  # nobody awaits it any more
            self._stats["aborted"] += 1
            return
        now = time.perf_counter()
        resp = ModelResponse(
            input_tokens=list(r.req.input_ids),
            output_tokens=list(r.out_tokens),
            output_logprobs=list(r.out_logprobs),
            output_versions=list(r.out_versions),
            stop_reason=reason,  # type: ignore[arg-type]
            latency=now - r.submitted,
            ttft=(r.first_token_at - r.submitted) if r.first_token_at else now - r.submitted,
            rid=r.req.rid,
        )
        self._stats["finished" if reason != "abort" else "aborted"] += 1
        if r.stream:
            n = len(r.out_tokens)
            r.deliver(
                StreamChunk(
                    token_ids=r.out_tokens[r.sent : n],
                    logprobs=r.out_logprobs[r.sent : n],
                    versions=r.out_versions[r.sent : n],
                    final=resp,
                )
            )
            r.sent = n
        else:
            r.deliver(resp)
