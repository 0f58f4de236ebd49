"""Tree attention kernels: each packed trie node attends to its ancestors only.

Two kernels, one mask (``PackedTree.ancestor_mask`` is the reference both are tested against):

- **sdpa, trunk/segments** (any device; the CPU path): the *trunk* (the prefix every row shares:
  the system prompt with the tool schemas) attends causally to itself, and each *segment* (the
  nodes one row added to the trie) attends causally to its row's path. Measured on the demo's
  batch shape (16 tasks x 2 samples behind a 440-token prompt), attention took 13.9 s of a 60 s
  update instead of 29.5 s of 70 s with the dense mask (torch profiler, 2-core CPU), when a
  segment still held a whole task's rows; one row per segment is 1.7x faster again.
- **FlexAttention with a block mask from the trie** (CUDA): the trie is laid out in preorder
  (see ``tree``), so the nodes below node ``k`` are the interval ``[k, end[k])`` and
  ``k`` is an ancestor of ``q`` iff ``k <= q < end[k]``. The block mask is counted from those
  intervals with a few tensor ops (no dense [N, N] tensor, no Python per element), and the
  kernel computes only the blocks that hold an ancestor (73 % of blocks skipped on the agent
  batch; 0.53 ms per layer forward+backward against 1.19 ms for sdpa with the dense mask, on an
  H200). Sequences are padded to a power-of-two bucket, so the kernel compiles once per bucket;
  padding nodes attend to themselves and no real node sees them. Its backward is not
  implemented on the CPU (torch 2.13), hence the sdpa path there.

:func:`enable_tree_attention` registers one attention function with transformers that runs
plain sdpa for every call without a packed tree, and the kernel named by the call's keyword
(``tree_segments`` or ``tree_flex``) for a tree forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

logger = logging.getLogger(__name__)

TREE_ATTN = "areal_tree_sdpa"  # the attention function registered with transformers
FLEX_BLOCK = 128  # FlexAttention's block size (its default)


# ------------------------------------------------------------------------------------------
# sdpa over trunk and segments
# ------------------------------------------------------------------------------------------


@dataclass
class TreeSegments:
    """The trunk/segment layout of a packed trie (``PackedTree.attention_segments``).

    Nodes ``0..trunk-1`` are the trunk, shared by every row; the nodes after it form
    consecutive segments of ``sizes`` nodes, one per row that adds nodes below the trunk: the
    nodes the row added to the trie (a chain, the end of its path). A segment attends to its
    row's whole path (``keys``: node indices, the segment's own nodes last), causally."""

    trunk: int
    sizes: tuple[int, ...]
    keys: list[torch.Tensor]  # per segment: [K] long, the row's path; its last ``size`` are its own
    _bias: dict[torch.dtype, list[torch.Tensor]] = field(default_factory=dict, repr=False)

    def to(self, device: torch.device | str) -> TreeSegments:
        return TreeSegments(self.trunk, self.sizes, [k.to(device) for k in self.keys])

    def allowed(self, segment: int) -> torch.Tensor:
        """Bool [W, K] of one segment: its ``j``-th node sees the path up to itself."""
        size, n_keys = self.sizes[segment], int(self.keys[segment].numel())
        device = self.keys[segment].device
        last = n_keys - size + torch.arange(size, device=device)
        return torch.arange(n_keys, device=device)[None, :] <= last[:, None]

    def bias(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """Per segment, the additive mask [1, 1, W, K] over its path's keys; built once per
        forward (every layer and the checkpointed recompute share this object) instead of once
        per layer call."""
        b = self._bias.get(dtype)
        if b is None:
            low = torch.finfo(dtype).min
            b = []
            for i, keys in enumerate(self.keys):
                mask = torch.zeros(
                    (1, 1, self.sizes[i], int(keys.numel())), dtype=dtype, device=keys.device
                )
                mask.masked_fill_(~self.allowed(i)[None, None], low)
                b.append(mask)
            self._bias[dtype] = b
        return b


def segment_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    seg: TreeSegments,
    scaling: float | None,
) -> torch.Tensor:
    """Attention of packed nodes (``query`` [1, H, N, d], ``key``/``value`` [1, Hkv, N, d]) under
    the tree mask; returns [1, N, H, d] like transformers' sdpa wrapper.

    The trunk attends causally to itself; each segment (the nodes one row added) is one sdpa
    call over the keys and values of its row's path, gathered with ``index_select`` (whose
    backward adds the gradients back into place), under a causal mask. Every node is a query
    once and scores at most its path: ``trunk^2 / 2 + sum_rows W_r x K_r``. Until 2026-11-29 a
    segment was every node below one child of the trunk (several tasks' rows) under a tree
    mask, and computed ``W x (trunk + W)`` scores: on the demo's recorded minibatches that was
    twice the scores, and forward and backward took 1.69-1.74x as long (fp32; 1.38-2.22x for
    the bf16 reference's forward; ``bench/train_step.py --case attention --tokens RUN_DIR``).
    """
    t = seg.trunk
    gqa = key.shape[1] != query.shape[1]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    qs = query.split([t, *seg.sizes], dim=2)
    parts = []
    if t:
        parts.append(
            sdpa(
                qs[0], key[:, :, :t], value[:, :, :t], is_causal=True, scale=scaling, enable_gqa=gqa
            )
        )
    for q, keys, bias in zip(qs[1:], seg.keys, seg.bias(query.dtype), strict=True):
        k, v = key.index_select(2, keys), value.index_select(2, keys)
        parts.append(sdpa(q, k, v, attn_mask=bias, scale=scaling, enable_gqa=gqa))
    out = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
    return out.transpose(1, 2)


# ------------------------------------------------------------------------------------------
# FlexAttention with a block mask from the trie
# ------------------------------------------------------------------------------------------


def flex_bucket(n: int) -> int:
    """The padded length a packed sequence of ``n`` nodes runs at: the next power of two
    blocks (at most ~10 compiled shapes for any micro-batch up to 64k nodes)."""
    blocks = max(1, -(-n // FLEX_BLOCK))
    return FLEX_BLOCK * (1 << (blocks - 1).bit_length())


class _BucketState:
    """One mask function and one ``end`` buffer per (bucket, device), refilled for each tree:
    a compiled FlexAttention guards on the mask function and the tensors it captures, so a new
    closure per batch would recompile; the same objects with new contents do not."""

    def __init__(self, length: int, device: torch.device) -> None:
        self.end = torch.zeros(length, dtype=torch.int32, device=device)
        end = self.end

        def tree_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return (kv_idx <= q_idx) & (q_idx < end[kv_idx])

        self.mask_mod = tree_mask


_STATES: dict[tuple[int, str], _BucketState] = {}


class FlexTreeMask:
    """A packed trie's FlexAttention block mask (plain class: passed untouched through FSDP2's
    forward, which casts floating tensors in dataclasses)."""

    def __init__(self, block_mask: Any, n_nodes: int, length: int) -> None:
        self.block_mask = block_mask
        self.n_nodes = n_nodes
        self.length = length  # the bucket the nodes are padded to


def block_counts(end: torch.Tensor, length: int) -> torch.Tensor:
    """[Q blocks, KV blocks] number of allowed (query, key) pairs per block, from the subtree
    intervals ``end`` [length] (key ``k`` is seen by the queries ``[k, end[k])``)."""
    nb = length // FLEX_BLOCK
    k = torch.arange(length, device=end.device)
    q_lo = torch.arange(nb, device=end.device) * FLEX_BLOCK
    # overlap of [k, end[k]) with each query block [q_lo, q_lo + B): [length, nb]
    lo = torch.maximum(k[:, None], q_lo[None, :])
    hi = torch.minimum(end.long()[:, None], q_lo[None, :] + FLEX_BLOCK)
    per_key = (hi - lo).clamp_min(0)
    return per_key.view(nb, FLEX_BLOCK, nb).sum(1).T.contiguous()  # [q block, kv block]


def flex_tree_mask(subtree_end: torch.Tensor, device: torch.device | str) -> FlexTreeMask:
    """The block mask of a trie whose node ``k`` has the descendants ``[k, subtree_end[k])``."""
    from torch.nn.attention.flex_attention import BlockMask

    n = int(subtree_end.numel())
    length = flex_bucket(n)
    dev = torch.device(device)
    state = _STATES.get((length, str(dev)))
    if state is None:
        state = _STATES[(length, str(dev))] = _BucketState(length, dev)
    end = torch.arange(1, length + 1, dtype=torch.int32)  # padding nodes: themselves only
    end[:n] = subtree_end.to(torch.int32)
    state.end.copy_(end)
    counts = block_counts(end, length)
    full = counts == FLEX_BLOCK * FLEX_BLOCK
    partial = (counts > 0) & ~full

    def ordered(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num = sel.sum(-1).to(torch.int32)
        idx = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return num[None, None].to(dev), idx[None, None].to(dev)

    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(full)
    block_mask = BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=state.mask_mod,
        seq_lengths=(length, length),
    )
    return FlexTreeMask(block_mask, n, length)


_compiled_flex: Any = None


def flex_tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: FlexTreeMask,
    scaling: float | None,
    *,
    compiled: bool = True,
) -> torch.Tensor:
    """FlexAttention of packed nodes under the trie's block mask; the same shapes in and out
    as :func:`segment_tree_attention`. ``compiled=False`` runs FlexAttention's eager reference
    (dense scores; for tests on the CPU)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    fn: Any = flex_attention
    if compiled:
        if _compiled_flex is None:
            # one compiled kernel per bucket (and per head layout/dtype): more than dynamo's
            # default of 8 variants of one function before it falls back to eager (dense) mode
            cfg: Any = torch._dynamo.config
            for limit in ("recompile_limit", "cache_size_limit"):
                if hasattr(cfg, limit):
                    setattr(cfg, limit, max(int(getattr(cfg, limit)), 64))
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        fn = _compiled_flex
    dev = query.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else value.dtype
    n, pad = query.shape[2], mask.length - query.shape[2]

    def padded(t: torch.Tensor) -> torch.Tensor:
        t = t.to(dtype)
        return torch.nn.functional.pad(t, (0, 0, 0, pad)) if pad else t

    out = fn(
        padded(query),
        padded(key),
        padded(value),
        block_mask=mask.block_mask,
        scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out[:, :, :n].transpose(1, 2)


_PROBES: dict[tuple[Any, ...], str | None] = {}


def flex_probe(
    device: torch.device, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> str | None:
    """None when compiled FlexAttention runs forward and backward on ``device`` for this head
    layout; else why not (a Triton or inductor failure, an unsupported head dim). Run once per
    layout, before training, so that ``tree_attention: auto`` can fall back to sdpa instead of
    failing in the middle of a step."""
    key = (str(device), heads, kv_heads, head_dim, dtype)
    if key not in _PROBES:
        try:
            n = FLEX_BLOCK
            mask = flex_tree_mask(torch.full((n,), n), device)  # one chain: causal
            g = torch.Generator(device=device).manual_seed(0)
            q, k, v = (
                torch.randn(
                    1, h, n, head_dim, device=device, dtype=dtype, generator=g
                ).requires_grad_()
                for h in (heads, kv_heads, kv_heads)
            )
            out = flex_tree_attention(q, k, v, mask, None)
            out.float().sum().backward()
            if not all(t.grad is not None and bool(t.grad.isfinite().all()) for t in (q, k, v)):
                raise RuntimeError("non-finite gradients")
            _PROBES[key] = None
        except Exception as e:  # any failure means: do not use it here
            _PROBES[key] = f"{type(e).__name__}: {str(e)[:300]}"
    return _PROBES[key]


def flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def tree_kernel(setting: str, device: torch.device) -> str:
    """The kernel ``actor.tree_attention`` picks on ``device``: ``flex`` or ``sdpa``."""
    if setting == "sdpa":
        return "sdpa"
    usable = device.type == "cuda" and flex_available()
    if setting == "flex" and not usable:
        from areal_env.api.errors import ConfigError

        raise ConfigError(
            f"actor.tree_attention=flex needs a CUDA device and torch.nn.attention.flex_attention "
            f"(here: {device}, torch {torch.__version__}); FlexAttention's backward is not "
            "implemented on the CPU: set actor.tree_attention=auto or sdpa"
        )
    return "flex" if usable else "sdpa"


# ------------------------------------------------------------------------------------------
# Registration with transformers
# ------------------------------------------------------------------------------------------


def enable_tree_attention(model: torch.nn.Module) -> bool:
    """Switch an sdpa model to the tree-aware attention function (identical for every call
    without a packed tree). Returns False (and changes nothing) for other implementations."""
    cfg: Any = getattr(model, "config", None)
    impl = getattr(cfg, "_attn_implementation", None)
    if impl == TREE_ATTN:
        return True
    if impl != "sdpa":
        return False
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        seg = kw.pop("tree_segments", None)
        flex = kw.pop("tree_flex", None)
        if flex is not None:
            return flex_tree_attention(query, key, value, flex, scaling), None
        if seg is not None:
            return segment_tree_attention(query, key, value, seg, scaling), None
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kw
        )

    AttentionInterface.register(TREE_ATTN, attention)
    AttentionMaskInterface.register(TREE_ATTN, sdpa_mask)
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(TREE_ATTN)
    else:
        cfg._attn_implementation = TREE_ATTN
    return getattr(cfg, "_attn_implementation", None) == TREE_ATTN
