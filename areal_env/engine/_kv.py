"""A batch KV cache for continuous batching: rows join, leave and grow without per-step copies.

Why not transformers' ``DynamicCache``: it concatenates every layer's keys/values on every decode
step (a full copy of the cache per token) and has no notion of rows joining a running batch.
Here all layers live in ONE preallocated tensor ``[layers, 2, batch, kv_heads, capacity, head_dim]``
whose live columns are ``[start, start + length)``. Sequences are right-aligned (left padding):
every row writes its next token into the same column, and a boolean ``mask`` tells which columns of
a row are real. A decode step writes one column in place; the buffer is only reallocated when the
capacity runs out (amortised), when rows join (``merge``) or when rows leave (``select``).
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, DynamicLayer

_GROW = 64  # extra columns reserved whenever the buffer is (re)allocated


class _BufferLayer(DynamicLayer):
    """One model layer's view into the shared buffer (transformers calls ``update`` per layer)."""

    def __init__(self, owner: BatchKV, idx: int) -> None:
        super().__init__()
        # A weak reference: a strong one would make BatchKV <-> layers a reference cycle, and
        # every replaced batch buffer (one per merge, often a GB) would then live until the
        # cyclic GC ran -- which grew a 4x8 agent rollout to 14 GB.
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

    def __init__(self, buf: torch.Tensor, mask: torch.Tensor, start: int, length: int) -> None:
        self.buf = buf  # [L, 2, B, H, cap, D]
        self.mask_buf = mask  # [B, cap] bool
        self.start = start
        self.length = length
        self.cache = Cache(layers=[_BufferLayer(self, i) for i in range(buf.shape[0])])

    # ---- construction -------------------------------------------------------------------
    @staticmethod
    def stack_prefill(cache: Cache) -> torch.Tensor:
        """``[L, 2, n, H, T, D]`` from a freshly prefilled transformers cache."""
        return torch.stack(
            [torch.stack([layer.keys, layer.values]) for layer in cache.layers]  # type: ignore[misc]
        )

    @property
    def batch_size(self) -> int:
        return self.buf.shape[2]

    @property
    def capacity(self) -> int:
        return self.buf.shape[4]

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
        new_cap = self.length + n + max(_GROW, self.length // 4)
        L, two, B, H, _, D = self.buf.shape
        buf = self.buf.new_zeros((L, two, B, H, new_cap, D))
        buf[..., : self.length, :] = self.buf[..., self.start : self.start + self.length, :]
        mask = self.mask_buf.new_zeros((B, new_cap))
        mask[:, : self.length] = self.mask
        self.buf, self.mask_buf, self.start = buf, mask, 0

    def advance(self, n: int = 1) -> None:
        """Record that the forward pass wrote ``n`` columns."""
        self.length += n

    # ---- rows joining and leaving ------------------------------------------------------
    @classmethod
    def merge(cls, old: BatchKV | None, new_kv: torch.Tensor, new_mask: torch.Tensor) -> BatchKV:
        """Append prefilled rows (``new_kv`` ``[L,2,n,H,T,D]``, ``new_mask`` ``[n,T]``), right-aligned."""
        if old is None:
            L, two, n, H, T, D = new_kv.shape
            buf = new_kv.new_zeros((L, two, n, H, T + _GROW, D))
            buf[..., :T, :] = new_kv
            mask = new_mask.new_zeros((n, T + _GROW))
            mask[:, :T] = new_mask
            return cls(buf, mask, 0, T)
        L, two, n, H, T, D = new_kv.shape
        B, M = old.batch_size, max(old.length, T)
        cap = M + _GROW
        buf = new_kv.new_zeros((L, two, B + n, H, cap, D))
        buf[:, :, :B, :, M - old.length : M] = old.buf[
            :, :, :, :, old.start : old.start + old.length
        ]
        buf[:, :, B:, :, M - T : M] = new_kv
        mask = new_mask.new_zeros((B + n, cap))
        mask[:B, M - old.length : M] = old.mask
        mask[B:, M - T : M] = new_mask
        return cls(buf, mask, 0, M)

    def select(self, keep: list[int]) -> None:
        """Keep only rows ``keep`` (in that order) and drop leading all-padding columns."""
        idx = torch.tensor(keep, dtype=torch.long, device=self.buf.device)
        live = self.mask.index_select(0, idx)
        real_cols = live.any(0).nonzero()
        skip = int(real_cols[0]) if real_cols.numel() else self.length
        s, e = self.start + skip, self.start + self.length
        self.length = e - s
        cap = self.length + _GROW
        L, two, _, H, _, D = self.buf.shape
        buf = self.buf.new_zeros((L, two, len(keep), H, cap, D))
        buf[..., : self.length, :] = self.buf[..., s:e, :].index_select(2, idx)
        mask = self.mask_buf.new_zeros((len(keep), cap))
        mask[:, : self.length] = live[:, skip:]
        self.buf, self.mask_buf, self.start = buf, mask, 0
