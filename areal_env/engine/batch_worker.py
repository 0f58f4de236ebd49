"""``LocalEngine``'s batch worker: the continuous-batching decode loop and its KV bookkeeping.

The worker owns everything the decode loop touches: the queue of pending requests, the running
rows, the batch's KV, the prefix cache, the weight version stamped on each token and the
counters. Its thread is the only one that runs the model; other threads hand it requests
(``submit``), flags (``abort``, ``cancel``) or hold it between two steps (``pause``,
``at_step_boundary``, used by weight updates). Each step admits pending requests (prefilled in
groups of similar length, reusing cached prefixes), decodes one token for every running row, and
retires finished rows at the step boundary, shrinking the batch's KV with them. A prompt prefix
that all running rows start with is held once (``shared_prefix``): each decode step reads it once
instead of once per row.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import torch

from areal_env.api.engine import EngineUnavailableError
from areal_env.api.io import ModelResponse, StreamChunk
from areal_env.api.tokens import common_prefix_len
from areal_env.engine.adapters import AdapterSet
from areal_env.engine.grammar import MaskFiller
from areal_env.engine.kv_cache import SPARE_COLUMNS, BatchKV
from areal_env.engine.prefix_cache import PrefixCache
from areal_env.engine.request_state import RequestState, allowed_tokens, length_groups
from areal_env.engine.sampler import sample_rows_top
from areal_env.engine.shared_prefix import (
    MIN_SHARED_TOKENS,
    SharedPrefix,
    enable_shared_prefix_attention,
)

logger = logging.getLogger(__name__)

_MAX_PREFILL_TOKENS = 8192  # padded prompt tokens prefilled in one forward (bounds decode stalls)
_LOG_EVERY_S = 30.0  # progress log interval while busy
_MIN_PREFIX = 32  # shortest cached prefix worth a separate prefill path


def cache_keyword(model: Any) -> str:
    """The forward keyword that takes the KV cache: ``cache`` from transformers 5.24 on (the old
    ``past_key_values`` warns there and is removed in 5.40), ``past_key_values`` before."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a wrapper without an inspectable signature
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


class BatchWorker:
    """The decode loop of ``LocalEngine`` and the state it owns (see the module docstring)."""

    def __init__(
        self, *, max_batch_size: int, num_threads: int | None, share_prefixes: bool = True
    ) -> None:
        self.max_batch_size = max_batch_size
        self.num_threads = num_threads
        self.share_prefixes = share_prefixes
        """Hold the prefix all running rows share once (where the model's attention allows:
        ``shared_prefix.supports_shared_prefix``); set at ``start``."""
        self.model: Any = None
        self.tokenizer: Any = None
        self.device = torch.device("cpu")
        self.prefix_cache = PrefixCache(0)
        """Replaced only at a step boundary (``at_step_boundary``): the loop is its only user."""
        self.version = 0
        """Weight version stamped on every token decoded from now on."""
        self.adapters: AdapterSet | None = None
        """Named LoRA adapters served per row (one per policy of a multi-agent run); ``None``
        until the first is loaded. Loaded and removed only at a step boundary."""
        self.counters = {
            "requests": 0,
            "finished": 0,
            "aborted": 0,
            "tokens_generated": 0,
            "prefill_tokens": 0,
            "decode_steps": 0,
            "batch_size_sum": 0,
            "max_batch_size_seen": 0,
            "weight_updates": 0,
            "prefix_cache_hit_tokens": 0,
            "shared_prefix_steps": 0,
            "shared_prefix_row_tokens": 0,
            "shared_prefix_prefill_row_tokens": 0,
        }
        self._cache_keyword = "past_key_values"
        self._cv = threading.Condition()
        self._pending: deque[RequestState] = deque()
        self._running: list[RequestState] = []
        self._live: dict[int, RequestState] = {}  # id(request) -> request, until finished
        self._kv: BatchKV | None = None
        self._next_tokens: torch.Tensor | None = None  # [B] last sampled, not yet in the cache
        self._positions: torch.Tensor | None = None  # [B] position of the next fed token
        self._thread: threading.Thread | None = None
        self._alive = False
        self._stopping = False
        self._paused = False
        self._holders = 0  # callers waiting to act at a step boundary (weight updates)
        self._in_step = False
        self._log_at, self._log_tokens = 0.0, 0
        self._masks: MaskFiller | None = None  # made at the first constrained row

    # ------------------------------------------------------------------ lifecycle
    @property
    def alive(self) -> bool:
        return self._alive

    def start(self, model: Any, tokenizer: Any, device: torch.device, cache: PrefixCache) -> None:
        """Serve ``model`` from a new worker thread (no-op while already serving)."""
        with self._cv:
            if self._alive:
                return
            self.model, self.tokenizer, self.device = model, tokenizer, device
            self.prefix_cache = cache
            self._cache_keyword = cache_keyword(model)
            self.share_prefixes = self.share_prefixes and enable_shared_prefix_attention(model)
            self._alive, self._stopping = True, False
            self._thread = threading.Thread(
                target=self._loop, name="LocalEngine-worker", daemon=True
            )
            self._thread.start()

    def stop(self) -> int | None:
        """Stop the thread; unfinished requests end with ``stop_reason="abort"``. Returns how
        many there were (None when it was not serving)."""
        with self._cv:
            if not self._alive:
                return None
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
        if self._masks is not None:
            self._masks.close()
            self._masks = None
        self.model = None
        return len(leftovers)

    def require_alive(self) -> None:
        if not self._alive:
            raise EngineUnavailableError(
                "LocalEngine is not running (call initialize(); destroyed engines cannot serve)"
            )

    # ------------------------------------------------------------------ from other threads
    def submit(self, r: RequestState) -> None:
        """Queue ``r``; it joins the running batch at the next step boundary."""
        with self._cv:
            if not self._alive:
                raise EngineUnavailableError("LocalEngine was destroyed")
            self._pending.append(r)
            self._live[id(r)] = r
            self.counters["requests"] += 1
            self._cv.notify_all()

    def cancel(self, r: RequestState) -> None:
        """Drop ``r`` silently at the next step boundary (nobody awaits it any more)."""
        r.cancelled = True
        with self._cv:
            self._cv.notify_all()

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

    def pause(self) -> None:
        """Hold generation at the next step boundary (returns once no step is running)."""
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
    def at_step_boundary(self) -> Iterator[None]:
        """Hold the decode loop between two steps while the block runs (waits for the running
        step to finish; generation continues afterwards)."""
        self.require_alive()
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

    def set_version(self, version: int) -> None:
        with self._cv:
            self.version = int(version)

    def new_weights_loaded(self) -> None:
        """Called at a step boundary after a weight update: cached KV belongs to the old weights,
        and tokens decoded from now on carry the next version."""
        self.prefix_cache.clear()
        with self._cv:
            self.version += 1
            self.counters["weight_updates"] += 1

    def adapters_changed(self) -> None:
        """Called at a step boundary after an adapter was loaded or removed: cached KV of its
        rows belongs to the old adapter weights (the version is the caller's to move: all
        policies of an engine share its clock)."""
        self.prefix_cache.clear()
        with self._cv:
            self.counters["weight_updates"] += 1

    def stats(self) -> dict[str, float]:
        """Counters: requests, tokens generated, decode steps, mean/max batch size, queue."""
        with self._cv:
            s: dict[str, float] = dict(self.counters)
            s["running"] = len(self._live) - len(self._pending)  # incl. being prefilled
            s["queued"] = len(self._pending)
            s["version"] = self.version
        s["prefix_cache_tokens"] = self.prefix_cache.tokens
        s["prefix_cache_capacity_tokens"] = self.prefix_cache.max_tokens
        steps = s["decode_steps"]
        s["mean_batch_size"] = s["batch_size_sum"] / steps if steps else 0.0
        return s

    # ------------------------------------------------------------------ the worker thread
    def _forward(self, cache: Any, rows: list[RequestState], **kwargs: Any) -> Any:
        """One model forward over ``rows`` (each with its own LoRA adapter, if any) that extends
        ``cache`` in place, under this transformers' keyword."""
        if self.adapters is not None and len(self.adapters):
            self.adapters.select([r.adapter for r in rows], self.device)
        return self.model(**kwargs, **{self._cache_keyword: cache})

    def _shared_prefix_args(self, kv: BatchKV) -> dict[str, Any]:
        """The forward keyword that hands the attention the batch's shared prefix (none when
        the rows hold all their columns)."""
        if kv.shared is None:
            return {}
        self.counters["shared_prefix_steps"] += 1
        self.counters["shared_prefix_row_tokens"] += kv.shared.length * kv.rows
        return {"shared_prefix": kv.shared}

    def _log_progress(self) -> None:
        now = time.perf_counter()
        s = self.counters
        if not (self._running or self._pending):  # going idle: restart the window
            self._log_at, self._log_tokens = now, s["tokens_generated"]
            return
        if now - self._log_at < _LOG_EVERY_S:
            return
        tokens = s["tokens_generated"] - self._log_tokens
        shared = self._kv.shared if self._kv is not None else None
        if tokens:
            logger.info(
                "generating: %.1f tok/s over %.0fs, batch %d, queued %d, version %d%s",
                tokens / (now - self._log_at),
                now - self._log_at,
                len(self._running),
                len(self._pending),
                self.version,
                f", {shared.length}-token prefix held once" if shared is not None else "",
            )
        self._log_at, self._log_tokens = now, s["tokens_generated"]

    def _loop(self) -> None:
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

    def _take_pending(self) -> list[RequestState]:
        """Requests to prefill now (caller holds the lock); drops cancelled ones."""
        admit: list[RequestState] = []
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

    def _step(self, admit: list[RequestState]) -> None:
        version = self.version
        if admit:
            self._prefill(admit, version)
        if not self._running:
            return
        kv = self._kv
        assert kv is not None and self._next_tokens is not None and self._positions is not None
        mask = kv.mask_for_step(1)
        pending = self._start_masks(self._running)  # computed while the forward runs
        out = self._forward(
            kv.cache,
            self._running,
            input_ids=self._next_tokens[:, None],
            attention_mask=mask,
            position_ids=self._positions[:, None],
            use_cache=True,
            **self._shared_prefix_args(kv),
        )
        kv.advance(1)
        self._positions += 1
        logits = out.logits[:, -1, :]
        tokens, logps, tops = self._sample(self._running, logits, pending)
        self.counters["decode_steps"] += 1
        self.counters["batch_size_sum"] += len(self._running)
        self.counters["max_batch_size_seen"] = max(
            self.counters["max_batch_size_seen"], len(self._running)
        )
        self._record(self._running, tokens, logps, tops, version)
        self._next_tokens = torch.tensor(tokens, dtype=torch.long, device=self.device)
        self._retire()

    def _prefill(self, admit: list[RequestState], version: int) -> None:
        """Prefill new requests in groups of similar length (little padding), then merge them.

        With the prefix cache on, requests whose prompt starts with a cached prefix only prefill
        the rest; a long prefix shared by several new requests is prefilled once first.
        """
        plain: list[RequestState] = admit
        cached: list[RequestState] = []
        if self.prefix_cache.enabled:
            self._seed_shared_prefixes(admit)
            plain, cached = [], []
            for r in admit:
                n = self.prefix_cache.match_length(r.prompt_key, len(r.req.input_ids) - 1)
                (cached if n >= _MIN_PREFIX else plain).append(r)
        for group in length_groups(plain):
            self._prefill_group(group, version)
        if cached:
            rest = {
                id(r): len(r.req.input_ids)
                - self.prefix_cache.match_length(r.prompt_key, len(r.req.input_ids) - 1)
                for r in cached
            }
            for group in length_groups(cached, size=lambda r: rest[id(r)]):
                self._prefill_cached(group, version)

    def _seed_shared_prefixes(self, admit: list[RequestState]) -> None:
        """Prefill, once, each long prefix that several of ``admit`` share and the cache lacks.
        (Compared by prefix-cache keys: rows of different adapters never share a prefix.)"""
        rows = sorted(
            (r for r in admit if self.prefix_cache.match_length(r.prompt_key) == 0),
            key=lambda r: tuple(r.prompt_key),
        )
        ids = [r.prompt_key for r in rows]
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
                real = list(rows[i].req.input_ids[:shared])
                self._forward(
                    cache,
                    [rows[i]],
                    input_ids=torch.tensor([real], dtype=torch.long, device=self.device),
                    use_cache=True,
                    logits_to_keep=1,
                )
                self.counters["prefill_tokens"] += shared
                self.prefix_cache.insert(prefix, BatchKV.stack_prefill(cache)[:, :, 0])
                i = j + 1
            else:
                i += 1

    def _prefill_group(self, admit: list[RequestState], version: int) -> None:
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
        out = self._forward(
            cache,
            admit,
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
        )
        self.counters["prefill_tokens"] += sum(lengths)
        self._admit_prefilled(
            admit, out.logits[:, -1, :], BatchKV.stack_prefill(cache), mask, version
        )

    def _prefill_cached(self, admit: list[RequestState], version: int) -> None:
        """Prefill requests whose prompts start with a cached prefix: only the rest is computed.

        Row layout (columns): ``[pad, cached prefix | pad, rest of the prompt]`` — the prefixes
        right-aligned at column P, the rests right-aligned at the end, so the last column holds
        every row's last prompt token. Pad columns are masked out; position ids count real tokens.
        """
        matches = [
            self.prefix_cache.match_parts(r.prompt_key, len(r.req.input_ids) - 1) for r in admit
        ]
        if any(n == 0 for n, _ in matches):  # evicted since it was looked up: prefill it whole
            self._prefill_group(
                [r for r, (n, _) in zip(admit, matches, strict=True) if n == 0], version
            )
            kept = [(r, m) for r, m in zip(admit, matches, strict=True) if m[0] > 0]
            if not kept:
                return
            admit, matches = [r for r, _ in kept], [m for _, m in kept]
        shared = self._joinable_shared_prefix(admit, [n for n, _ in matches])
        skip = shared.length if shared is not None else 0  # columns read from the batch's prefix
        P = max(n for n, _ in matches) - skip
        rests = [len(r.req.input_ids) - n for r, (n, _) in zip(admit, matches, strict=True)]
        S = max(rests)
        L, two, H, _, D = matches[0][1][0].shape
        n_rows = len(admit)
        buf = matches[0][1][0].new_zeros((L, two, n_rows, H, P + S + SPARE_COLUMNS, D))
        mask = torch.zeros((n_rows, P + S + SPARE_COLUMNS), dtype=torch.bool, device=self.device)
        ids = torch.zeros((n_rows, S), dtype=torch.long)
        pos = torch.zeros((n_rows, S), dtype=torch.long)
        for i, (r, (n, parts)) in enumerate(zip(admit, matches, strict=True)):
            col, left = P - (n - skip), skip
            for part in parts:  # the cached edges, copied straight into the batch buffer
                width = part.shape[3]
                if left >= width:  # held once by the batch's shared prefix: not copied
                    left -= width
                    continue
                buf[:, :, i, :, col : col + width - left] = part[:, :, :, left:]
                col += width - left
                left = 0
            mask[i, P - (n - skip) : P] = True
            mask[i, P + S - rests[i] : P + S] = True
            ids[i, S - rests[i] :] = torch.tensor(r.req.input_ids[n:], dtype=torch.long)
            pos[i, S - rests[i] :] = torch.arange(n, n + rests[i])
            pos[i, : S - rests[i]] = n
            self.counters["prefix_cache_hit_tokens"] += n
        kv_state = BatchKV(buf, mask, 0, P)
        out = self._forward(
            kv_state.cache,
            admit,
            input_ids=ids.to(self.device),
            attention_mask=mask[:, : P + S],
            position_ids=pos.to(self.device),
            use_cache=True,
            logits_to_keep=1,
            **({"shared_prefix": shared} if shared is not None else {}),
        )
        kv_state.advance(S)
        self.counters["prefill_tokens"] += sum(rests)
        if shared is not None:
            self.counters["shared_prefix_prefill_row_tokens"] += skip * n_rows
        self._admit_prefilled(
            admit,
            out.logits[:, -1, :],
            buf[..., : P + S, :],
            mask[:, : P + S],
            version,
            skipped=skip,
        )

    def _joinable_shared_prefix(
        self, admit: list[RequestState], cached: list[int]
    ) -> SharedPrefix | None:
        """The running batch's shared prefix, when every row of ``admit`` starts with it, has
        all of it cached (``cached``: each row's cached length) and more after it, and was
        looked up under the same weights: their prefill then reads it once, as a decode step
        does, instead of copying it into every row (13-19 % of a prefill, measured)."""
        shared = self._kv.shared if self._kv is not None else None
        if shared is None or self.prefix_cache.epoch != shared.epoch:
            return None
        n = shared.length
        for r, have in zip(admit, cached, strict=True):
            if have < n or len(r.req.input_ids) <= n or r.prompt_key[:n] != shared.key:
                return None
        return shared

    def _admit_prefilled(
        self,
        admit: list[RequestState],
        logits: torch.Tensor,
        new_kv: torch.Tensor,
        mask: torch.Tensor,
        version: int,
        *,
        skipped: int = 0,
    ) -> None:
        """Sample each prefilled row's first token, cache the prompts' KV and merge the rows that
        go on into the running batch (``new_kv`` ``[L,2,n,H,T,D]``, ``mask`` ``[n,T]``).
        ``skipped``: the rows' columns start after the first ``skipped`` tokens of the prompt,
        the running batch's shared prefix (see :meth:`_joinable_shared_prefix`)."""
        lengths = [len(r.req.input_ids) for r in admit]
        if self.prefix_cache.enabled:
            for i, r in enumerate(admit):
                ids = r.prompt_key
                have = (
                    self.prefix_cache.match_length(ids) if lengths[i] >= _MIN_PREFIX else len(ids)
                )
                if have < len(ids):  # copy only the columns of the tokens not cached yet
                    cols = mask[i].nonzero().squeeze(1)[max(have - skipped, 0) :]
                    kv = new_kv[:, :, i].index_select(3, cols)
                    if have < skipped:  # evicted meanwhile: that part is the shared prefix's
                        assert self._kv is not None and self._kv.shared is not None
                        kv = torch.cat([self._kv.shared.kv[:, :, :, have:skipped], kv], dim=3)
                    self.prefix_cache.insert(ids, kv, start=have)
        tokens, logps, tops = self._sample(admit, logits, self._start_masks(admit))
        now = time.perf_counter()
        for r in admit:
            r.first_token_at = now
            r.kv_epoch = self.prefix_cache.epoch
        self._record(admit, tokens, logps, tops, version)
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
        joining = [admit[i] for i in keep]
        if self._kv is not None and self._kv.shared is not None:
            new_kv, mask = self._join_shared_prefix(self._kv, joining, new_kv, mask, skipped)
        elif skipped:
            raise AssertionError("rows prefilled against a shared prefix the batch no longer holds")
        self._kv = BatchKV.merge(self._kv, new_kv, mask, max_rows=self.max_batch_size)
        if self._running:
            assert self._next_tokens is not None and self._positions is not None
            self._next_tokens = torch.cat([self._next_tokens, new_tokens])
            self._positions = torch.cat([self._positions, new_pos])
        else:
            self._next_tokens, self._positions = new_tokens, new_pos
        self._running.extend(joining)
        if self.share_prefixes and self._kv.shared is None:
            self._share_common_prefix(self._kv)
        logger.debug("admitted %d requests; batch size %d", len(keep), len(self._running))

    def _join_shared_prefix(
        self,
        kv: BatchKV,
        joining: list[RequestState],
        new_kv: torch.Tensor,
        mask: torch.Tensor,
        skipped: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fit rows about to join into a batch that holds a prefix once: the batch keeps
        sharing as much of it as every joining row starts with (the rest goes back into its
        rows, or all of it when that is under ``MIN_SHARED_TOKENS``), and the joining rows
        drop the part that stays shared. Rows prefilled under other weights than the prefix
        (a weight update came in between) share none of it. Rows that hold no columns for
        their first ``skipped`` tokens (prefilled against the shared prefix) keep sharing all
        of them."""
        shared = kv.shared
        assert shared is not None
        keep = shared.length
        if any(r.kv_epoch != shared.epoch for r in joining):
            keep = 0
        for r in joining:
            upto = min(keep, len(r.prompt_key) - 1)
            keep = common_prefix_len(shared.key[:upto], r.prompt_key[:upto])
        if keep < MIN_SHARED_TOKENS:
            keep = 0
        if keep < skipped:
            raise AssertionError(f"rows prefilled against {skipped} shared tokens keep {keep}")
        kv.unshare_to(keep)
        strip = keep - skipped
        return BatchKV.strip_prefix(new_kv, mask, strip) if strip else (new_kv, mask)

    def _share_common_prefix(self, kv: BatchKV) -> None:
        """Hold the prefix that all running rows start with once, if it is long enough (each
        row keeps at least its last prompt token) and they were all prefilled under the same
        weights."""
        if len(self._running) < 2:
            return
        epoch = self._running[0].kv_epoch
        if any(r.kv_epoch != epoch for r in self._running):
            return
        ref = self._running[0].prompt_key
        n = len(ref) - 1
        for r in self._running[1:]:
            upto = min(n, len(r.prompt_key) - 1)
            n = common_prefix_len(ref[:upto], r.prompt_key[:upto])
            if n < MIN_SHARED_TOKENS:
                return
        kv.share(ref[:n], epoch)

    def _start_masks(self, rows: list[RequestState]) -> tuple[list[int], Future[Any]] | None:
        """Start computing the grammar masks of ``rows`` that have a grammar (None: none has)."""
        idx = [i for i, r in enumerate(rows) if r.grammar is not None]
        if not idx:
            return None
        if self._masks is None:
            self._masks = MaskFiller(int(self.model.config.vocab_size))
        return idx, self._masks.start([rows[i].grammar for i in idx])  # type: ignore[misc]

    def _sample(
        self,
        rows: list[RequestState],
        logits: torch.Tensor,
        pending: tuple[list[int], Future[Any]] | None,
    ) -> tuple[list[int], list[float], list[list[tuple[int, float]] | None]]:
        masks = None
        if pending is not None:
            idx, future = pending
            masks = dict(zip(idx, future.result(), strict=True))
            for i in idx:
                r = rows[i]
                if r.grammar is not None and r.max_new - len(r.out_tokens) <= r.close_margin:
                    masks[i] = r.grammar.close(masks[i])
        tokens, logps, tops = sample_rows_top(
            logits,
            [r.sampling for r in rows],
            allowed_tokens(rows, masks),
            [r.top_logprobs for r in rows] if any(r.top_logprobs for r in rows) else None,
        )
        for r, t in zip(rows, tokens, strict=True):
            if r.grammar is not None and not r.grammar.consume(t):
                # only an exhausted or broken grammar gets here (the mask allowed ``t``)
                logger.warning("request %s left its grammar: %s", r.req.rid, r.grammar.error)
                r.grammar = None
                r.grammar_failed = True
        return tokens, logps, tops

    def _record(
        self,
        rows: list[RequestState],
        tokens: list[int],
        logps: list[float],
        tops: list[list[tuple[int, float]] | None],
        version: int,
    ) -> None:
        for r, t, lp, top in zip(rows, tokens, logps, tops, strict=True):
            r.out_tokens.append(t)
            r.out_logprobs.append(lp)
            r.out_versions.append(version)
            if top is not None:
                r.out_top_logprobs.append(top)
        self.counters["tokens_generated"] += len(rows)

    def _check_done(self, r: RequestState) -> bool:
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
        elif r.grammar_failed:
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

    def _hit_stop_string(self, r: RequestState) -> bool:
        tail = self.tokenizer.decode(r.out_tokens[-r.stop_window :], skip_special_tokens=False)
        return any(s in tail for s in r.stop_strs)

    def _retire(self) -> None:
        """Finish rows that are done (or cancelled) and shrink the batch."""
        keep: list[int] = []
        done: list[int] = []
        for i, r in enumerate(self._running):
            (done if self._check_done(r) else keep).append(i)
        if not done:
            return
        if self.prefix_cache.enabled:
            self._cache_outputs(done)
        for i in done:
            r = self._running[i]
            self._finish(r, r.reason)
        if not keep:
            self._running, self._kv = [], None
            self._next_tokens = self._positions = None
            return
        assert (
            self._kv is not None and self._next_tokens is not None and self._positions is not None
        )
        keep = BatchKV.fill_order(keep)  # rows from the end fill the gaps
        self._kv.select(keep)
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self._next_tokens = self._next_tokens.index_select(0, idx)
        self._positions = self._positions.index_select(0, idx)
        self._running = [self._running[i] for i in keep]

    def _cache_outputs(self, rows: list[int]) -> None:
        """Add the generated tokens of finished rows to the prefix cache (their KV is in the
        batch): an agent's next turn starts with this turn's prompt and output, so it then
        prefills only the new part (the tool result), as SGLang's radix cache does."""
        kv = self._kv
        assert kv is not None
        s, e = kv.start, kv.start + kv.length
        shared = kv.shared.length if kv.shared is not None else 0
        for i in rows:
            r = self._running[i]
            if r.reason not in ("stop", "length") or r.kv_epoch != self.prefix_cache.epoch:
                continue  # cancelled/aborted, or computed under weights the cache no longer holds
            ids = r.prompt_key + r.cache_key(r.out_tokens[:-1])  # the last one was never fed
            have = self.prefix_cache.match_length(ids)
            if have >= len(ids) or len(ids) < _MIN_PREFIX:
                continue
            cols = kv.mask_buf[i, s:e].nonzero().squeeze(1)
            if cols.numel() + shared != len(ids):  # not this row's layout: leave the cache alone
                logger.debug("row %d holds %d columns for %d tokens", i, cols.numel(), len(ids))
                continue
            tail = kv.buf[:, :, i, :, s:e].index_select(3, cols[max(have - shared, 0) :])
            if have < shared:  # the cache lost part of the shared prefix: put it back too
                assert kv.shared is not None
                tail = torch.cat([kv.shared.kv[:, :, :, have:], tail], dim=3)
            self.prefix_cache.insert(ids, tail, start=have)

    def _send_chunk(self, r: RequestState) -> None:
        n = len(r.out_tokens)
        if n > r.sent:
            r.deliver(
                StreamChunk(
                    token_ids=r.out_tokens[r.sent : n],
                    logprobs=r.out_logprobs[r.sent : n],
                    versions=r.out_versions[r.sent : n],
                    top_logprobs=r.out_top_logprobs[r.sent : n] if r.top_logprobs else None,
                )
            )
            r.sent = n

    def _finish(self, r: RequestState, reason: str) -> None:
        if reason == "gone":
            return
        r.done = True
        with self._cv:
            self._live.pop(id(r), None)
        if reason == "cancel":  # nobody awaits it any more
            self.counters["aborted"] += 1
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
            explored=r.sampling.explored,
            output_top_logprobs=list(r.out_top_logprobs) if r.top_logprobs else None,
        )
        self.counters["finished" if reason != "abort" else "aborted"] += 1
        if r.stream:
            n = len(r.out_tokens)
            r.deliver(
                StreamChunk(
                    token_ids=r.out_tokens[r.sent : n],
                    logprobs=r.out_logprobs[r.sent : n],
                    versions=r.out_versions[r.sent : n],
                    final=resp,
                    top_logprobs=r.out_top_logprobs[r.sent : n] if r.top_logprobs else None,
                )
            )
            r.sent = n
        else:
            r.deliver(resp)
