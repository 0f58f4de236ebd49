"""A batch KV cache for continuous batching: rows join, leave and grow without per-step copies.

Why not transformers' ``DynamicCache``: it concatenates every layer's keys/values on every decode
step (a full copy of the cache per token) and has no notion of rows joining a running batch.
Here all layers live in ONE preallocated tensor ``[layers, 2, row capacity, kv_heads, column
capacity, head_dim]``; rows ``[0, rows)`` are live and their live columns are
``[start, start + length)``. Sequences are right-aligned (left padding): every row writes its next
token into the same column, and a boolean ``mask`` tells which columns of a row are real.

Why rows and columns have spare capacity: the batch's KV is most of the engine's memory traffic
(32 agent rows behind a 500-token system prompt hold about 1 GB). Copying all of it whenever a
row leaves or joins cost as much as the decoding itself (measured on the demo's traffic: 9 s of a
24 s rollout). So a decode step writes one column in place; a joining row is written into a spare
row (only its own KV is copied); a leaving row's slot is filled by a row from the end (only the
moved rows are copied) and leading columns that became all padding are skipped by moving
``start``. The storage is reallocated only when rows or columns run out (amortised).

Storage is allocated uninitialised (untouched pages cost no memory, so spare rows are free until
used). Every column that enters a row's live window is written (prompt, decoded token) or zeroed
(padding) first, so masked columns hold finite values and attention gives them weight exactly 0.

A prompt prefix that every row starts with can be held once (``shared``, a
``shared_prefix.SharedPrefix``): the rows then keep only their columns after it, and a decode
step reads the prefix once instead of once per row. ``share`` moves a running batch to a shared
prefix without copying the rows (their prefix columns are masked out and skipped), ``unshare_to``
gives the rows back the part of it that a joining row does not share, and ``strip_prefix`` takes
the prefix off freshly prefilled rows before they join.
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, DynamicLayer

from areal_env.engine.shared_prefix import SharedPrefix

SPARE_COLUMNS = 64  # extra columns reserved whenever the buffer is (re)allocated


def _headroom(length: int) -> int:
    """Free columns kept left of the live window on (re)allocation: agent turns come back a few
    dozen tokens longer than the rows still decoding, and they join in place when it fits."""
    return max(SPARE_COLUMNS, length // 4)


class _BufferLayer(DynamicLayer):
    """One model layer's view into the shared buffer (transformers calls ``update`` per layer)."""

    def __init__(self, owner: BatchKV, idx: int) -> None:
        super().__init__()
        # A weak reference: a strong one would make BatchKV <-> layers a reference cycle, and
        # every replaced batch buffer (often a GB) would then live until the cyclic GC ran --
        # which grew a 4x8 agent rollout to 14 GB.
        self._owner = weakref.ref(owner)
        self.idx = idx
        self.is_initialized = True

    @property
    def owner(self) -> BatchKV:
        owner = self._owner()
        if owner is None:
            raise RuntimeError("the BatchKV this cache layer belongs to is gone")
        return owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        o = self.owner
        n = key_states.shape[-2]
        end = o.start + o.length
        buf = o.buf
        buf[self.idx, 0, :, :, end : end + n] = key_states
        buf[self.idx, 1, :, :, end : end + n] = value_states
        return buf[self.idx, 0, :, :, o.start : end + n], buf[self.idx, 1, :, :, o.start : end + n]

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length + query_length, 0


class BatchKV:
    """Keys/values and padding mask of the running batch (see module docstring)."""

    def __init__(
        self,
        buf: torch.Tensor,
        mask: torch.Tensor,
        start: int,
        length: int,
        rows: int | None = None,
    ) -> None:
        self.storage = buf  # [L, 2, R, H, cap, D]; rows >= self.rows are spare
        self.mask_storage = mask  # [R, cap] bool
        self.rows = buf.shape[2] if rows is None else rows
        self.start = start
        self.length = length
        self.shared: SharedPrefix | None = None
        """The prefix every row starts with, held once (the rows' columns follow it)."""
        self.cache = Cache(layers=[_BufferLayer(self, i) for i in range(buf.shape[0])])

    # ---- construction -------------------------------------------------------------------
    @staticmethod
    def stack_prefill(cache: Cache) -> torch.Tensor:
        """``[L, 2, n, H, T, D]`` from a freshly prefilled transformers cache."""
        return torch.stack(
            [torch.stack([layer.keys, layer.values]) for layer in cache.layers]  # type: ignore[misc]
        )

    @property
    def buf(self) -> torch.Tensor:
        """The live rows' storage ``[L, 2, rows, H, cap, D]`` (a view)."""
        return self.storage[:, :, : self.rows]

    @property
    def mask_buf(self) -> torch.Tensor:
        """The live rows' mask storage ``[rows, cap]`` (a view)."""
        return self.mask_storage[: self.rows]

    @property
    def batch_size(self) -> int:
        return self.rows

    @property
    def row_capacity(self) -> int:
        return self.storage.shape[2]

    @property
    def capacity(self) -> int:
        return self.storage.shape[4]

    @property
    def mask(self) -> torch.Tensor:
        """Live mask ``[B, length]``."""
        return self.mask_buf[:, self.start : self.start + self.length]

    def mask_for_step(self, n: int = 1) -> torch.Tensor:
        """Mask ``[B, length + n]`` with the next ``n`` columns marked real (for a decode step)."""
        self.ensure_room(n)
        end = self.start + self.length
        self.mask_buf[:, end : end + n] = True
        return self.mask_buf[:, self.start : end + n]

    def ensure_room(self, n: int) -> None:
        """Make room for ``n`` more columns, compacting/reallocating only when needed."""
        if self.start + self.length + n <= self.capacity:
            return
        head = _headroom(self.length)
        self._reallocate(self.row_capacity, head + self.length + n + head, head)

    def _reallocate(self, row_cap: int, cap: int, start: int) -> None:
        """New storage; the live rows' live columns are copied to begin at ``start``. The rest is
        left uninitialised (``torch.empty``: pages never touched cost no memory); whatever
        enters the live window later is written or zeroed first (``merge``, decode steps)."""
        L, two, _, H, _, D = self.storage.shape
        buf = self.storage.new_empty((L, two, row_cap, H, cap, D))
        s, e, r = self.start, self.start + self.length, self.rows
        buf[:, :, :r, :, start : start + self.length] = self.storage[:, :, :r, :, s:e]
        mask = self.mask_storage.new_zeros((row_cap, cap))
        mask[:r, start : start + self.length] = self.mask_storage[:r, s:e]
        self.storage, self.mask_storage, self.start = buf, mask, start

    def advance(self, n: int = 1) -> None:
        """Record that the forward pass wrote ``n`` columns."""
        self.length += n

    # ---- rows joining and leaving ------------------------------------------------------
    @classmethod
    def merge(
        cls,
        old: BatchKV | None,
        new_kv: torch.Tensor,
        new_mask: torch.Tensor,
        max_rows: int | None = None,
    ) -> BatchKV:
        """Append prefilled rows (``new_kv`` ``[L,2,n,H,T,D]``, ``new_mask`` ``[n,T]``),
        right-aligned with the running ones. Writes them into ``old``'s spare rows (and returns
        ``old``) when it has room; otherwise returns a new, larger ``BatchKV`` whose row capacity
        doubles up to ``max_rows`` (the engine's batch limit), so a batch filling up in waves is
        copied only a few times."""
        L, two, n, H, T, D = new_kv.shape
        if old is None:  # spare rows up to max_rows: untouched, they cost no memory
            head = _headroom(T)
            row_cap = max(n, max_rows or n)
            buf = new_kv.new_empty((L, two, row_cap, H, head + T + SPARE_COLUMNS, D))
            buf[:, :, :n, :, head : head + T] = new_kv
            mask = new_mask.new_zeros((row_cap, head + T + SPARE_COLUMNS))
            mask[:n, head : head + T] = new_mask
            return cls(buf, mask, head, T, rows=n)
        rows, end = old.rows + n, old.start + old.length
        if rows <= old.row_capacity and T <= end:
            kv = old  # in place: the live window widens to the left if the new rows are longer
        else:
            row_cap = rows if max_rows is None else max(rows, min(max_rows, 2 * old.row_capacity))
            M = max(old.length, T)
            head = _headroom(M)
            kv = cls(old.storage, old.mask_storage, old.start, old.length, old.rows)
            kv.shared = old.shared
            kv._reallocate(row_cap, head + M + SPARE_COLUMNS, head + M - old.length)
            end = head + M
        if T > kv.length:  # the old rows gain padding columns on the left: zeroed, masked
            kv.storage[:, :, : kv.rows, :, end - T : kv.start] = 0
            kv.mask_storage[: kv.rows, end - T : kv.start] = False
            kv.start, kv.length = end - T, T
        kv.storage[:, :, kv.rows : rows, :, kv.start : end - T] = 0
        kv.storage[:, :, kv.rows : rows, :, end - T : end] = new_kv
        kv.mask_storage[kv.rows : rows, kv.start : end - T] = False
        kv.mask_storage[kv.rows : rows, end - T : end] = new_mask
        kv.rows = rows
        return kv

    @staticmethod
    def fill_order(keep: list[int]) -> list[int]:
        """The row order ``select`` should be given to keep ``keep`` with the fewest copies:
        kept rows already within the new batch stay where they are, and rows from the end fill
        the slots of the rows that leave."""
        n = len(keep)
        kept = set(keep)
        holes = [j for j in range(n) if j not in kept]
        movers = [i for i in keep if i >= n]
        order = list(range(n))
        for j, i in zip(holes, movers, strict=True):
            order[j] = i
        return order

    def select(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (row ``j`` becomes old row ``keep[j]``) and skip leading
        all-padding columns. Only rows that change slot are copied."""
        moved = [(j, i) for j, i in enumerate(keep) if i != j]
        if moved:
            s, e = self.start, self.start + self.length
            dst = torch.tensor([j for j, _ in moved], dtype=torch.long, device=self.storage.device)
            src = torch.tensor([i for _, i in moved], dtype=torch.long, device=self.storage.device)
            live = self.storage[:, :, :, :, s:e]
            live.index_copy_(2, dst, live.index_select(2, src))
            self.mask_storage.index_copy_(0, dst, self.mask_storage.index_select(0, src))
        self.rows = len(keep)
        self._skip_padding()

    # ---- a prefix held once ------------------------------------------------------------
    def share(self, key: list[int], epoch: int = 0) -> None:
        """Hold the first ``len(key)`` tokens of every row once: every live row must start
        with them, computed under the same weights ``epoch`` (the caller checks). Nothing is
        copied but the prefix itself: each row's first ``len(key)`` real columns are masked
        out, and leading columns that are now padding in every row are skipped."""
        n = len(key)
        if self.shared is not None:
            raise RuntimeError("the batch already holds a shared prefix: unshare_to(0) first")
        live = self.mask
        real = live.cumsum(1)
        if bool((real[:, -1] <= n).any()):
            raise ValueError(f"a row holds no more than the {n} tokens it would share")
        cols = live[0].nonzero().squeeze(1)[:n] + self.start  # row 0's prefix columns
        self.shared = SharedPrefix(key, self.buf[:, :, 0].index_select(3, cols), epoch)
        live &= real > n
        self._skip_padding()

    def unshare_to(self, n: int) -> None:
        """Keep only the first ``n`` tokens of the shared prefix shared; the rest of it goes
        back into every row, in front of the row's own columns (order does not matter to
        attention: the keys carry their positions)."""
        shared = self.shared
        if shared is None or n >= shared.length:
            return
        back = shared.length - n
        if self.start < back:
            head = back + _headroom(self.length)
            self._reallocate(self.row_capacity, head + self.length + SPARE_COLUMNS, head)
        s = self.start - back
        self.buf[:, :, :, :, s : self.start] = shared.kv[:, :, None, :, n:]
        self.mask_buf[:, s : self.start] = True
        self.start, self.length = s, self.length + back
        self.shared = shared.truncated(n) if n > 0 else None

    @staticmethod
    def strip_prefix(
        new_kv: torch.Tensor, new_mask: torch.Tensor, n: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Freshly prefilled rows (``[L,2,rows,H,T,D]``, mask ``[rows,T]``) without their first
        ``n`` real columns (a prefix the batch holds once): masked out, and the leading columns
        that are padding in every row dropped (a view of ``new_kv``)."""
        mask = new_mask & (new_mask.cumsum(1) > n)
        skip = _leading_padding(mask)
        return new_kv[:, :, :, :, skip:], mask[:, skip:]

    def _skip_padding(self) -> None:
        """Move ``start`` past the leading columns that are padding in every live row."""
        skip = _leading_padding(self.mask)
        self.start += skip
        self.length -= skip


def _leading_padding(mask: torch.Tensor) -> int:
    """How many leading columns of ``mask`` ``[rows, columns]`` are padding in every row."""
    real_cols = mask.any(0).nonzero()
    return int(real_cols[0]) if real_cols.numel() else mask.shape[1]
