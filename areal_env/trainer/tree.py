"""Tree training: rows that share token prefixes are packed into one token trie.

Why: in agent RL most tokens of a batch are shared. A GRPO group of 8 samples repeats the same
system prompt with the tool schemas and the same task 8 times; a multi-turn episode repeats its
earlier turns in every later row. Computed row by row (the "flat" path) every copy goes through
the model again. Packed into a trie, each distinct prefix is computed once: the trie's tokens are
laid out as ONE sequence, each token attends to its ancestors only (a tree attention mask), and
its position id is its depth, so every token sees exactly the context it has in its own row and
gets the same hidden state. Logprobs are then read back per row, and the loss's gradient flows
back through the shared tokens once (the sum over the rows that share them).

Layout: rows are sorted lexicographically, so the longest prefix a row shares with any earlier
row is the one it shares with the row just before it (``lcp``). Walking the rows in that order,
a row reuses the first ``lcp`` nodes of its predecessor's path and appends the rest as new nodes.
Every node's ancestors come before it, and the node count is ``sum(len - lcp)``.

Attention: the dense ancestor mask as a 4-D float mask (sdpa or eager) computes ``N^2`` scores,
most of them masked: a node attends only to its ancestors. :func:`enable_tree_attention` (the
actor calls it for sdpa models) registers a thin sdpa wrapper with transformers that uses the
shape of agent batches instead: the *trunk* (the prefix every row shares: the system prompt with
the tool schemas) attends causally to itself, and each *segment* (the nodes below one child of
the trunk: one task's rows) attends to the whole trunk plus, under the tree mask, to itself.
Measured on the demo's batch shape (16 tasks x 2 samples behind a 440-token prompt), attention
took 13.9 s of a 60 s update instead of 29.5 s of 70 s (torch profiler, 2-core CPU).
A packed sequence is bounded by ``micro_batch_tokens`` nodes
(:func:`tree_micro_batches`). The one model call is :func:`tree_logits`; a sharded (FSDP2) model
runs it as a registered forward method so its root parameters are gathered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from areal_env.api.tokens import common_prefix_len

TREE_ATTN = "areal_tree_sdpa"  # the sdpa wrapper registered with transformers
# Attention implementations that accept an arbitrary 4-D mask from transformers.
_MASK_IMPLS = {"sdpa": "additive", "eager": "additive", TREE_ATTN: "segments"}


@dataclass
class PackedTree:
    """Rows packed into a trie, in the order they were given.

    ``paths[i][p]`` is the node holding token ``p`` of row ``i``; ``input_ids``/``position_ids``
    are per node (depth = position); ``n_logical`` is the rows' total length.
    """

    input_ids: torch.Tensor  # [N] long
    position_ids: torch.Tensor  # [N] long
    paths: list[torch.Tensor]  # per row: [len] long node indices
    n_logical: int
    owned_from: list[int]  # per row: its nodes from this depth on were added by it

    @property
    def n_nodes(self) -> int:
        return int(self.input_ids.numel())

    def ancestor_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Bool [N, N]: ``mask[q, k]`` iff node ``k`` is ``q`` or one of its ancestors."""
        n = self.n_nodes
        mask = torch.zeros((n, n), dtype=torch.bool, device=device)
        cache: dict[int, torch.Tensor] = {}
        for path in self.paths:
            length = int(path.numel())
            if length not in cache:
                cache[length] = torch.tril_indices(length, length, device=device)
            qi, ki = cache[length]
            p = path.to(device)
            mask[p[qi], p[ki]] = True
        return mask

    def attention_segments(self) -> TreeSegments:
        """The trunk/segment layout of :func:`segment_tree_attention` (see the module docstring).

        The trunk is the prefix every row shares (nodes ``0..T-1``: the first row in trie order
        lays it out first). Every other node hangs below one child of the trunk's last node; the
        nodes below one child (a segment) are consecutive, because rows sharing a prefix are
        consecutive in trie order, and no node attends across segments.
        """
        n = self.n_nodes
        trunk = n
        for path in self.paths:
            k = int(path.numel())
            off = (path != torch.arange(k)).nonzero()
            trunk = min(trunk, int(off[0]) if off.numel() else k)
        roots: dict[int, list[torch.Tensor]] = {}
        for path in self.paths:
            if int(path.numel()) > trunk:
                roots.setdefault(int(path[trunk]), []).append(path[trunk:])
        spans = []
        for root in sorted(roots):
            nodes = torch.cat(roots[root])
            lo, hi = root, int(nodes.max()) + 1
            spans.append((lo, hi, roots[root]))
        if any(spans[i][1] > spans[i + 1][0] for i in range(len(spans) - 1)):
            raise AssertionError("tree segments overlap: the trie was not laid out in row order")
        width = max((hi - lo for lo, hi, _ in spans), default=1)
        n_seg = len(spans)
        q_idx = torch.zeros((n_seg, width), dtype=torch.long)
        allowed = torch.zeros((n_seg, width, trunk + width), dtype=torch.bool)
        allowed[:, :, :trunk] = True  # every node below the trunk sees all of it
        if trunk == 0:
            allowed[:, :, 0] = True  # padding queries attend somewhere (their output is dropped)
        slot = torch.zeros(n - trunk, dtype=torch.long)
        tril: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for s_i, (lo, hi, parts) in enumerate(spans):
            q_idx[s_i, : hi - lo] = torch.arange(lo, hi)
            slot[lo - trunk : hi - trunk] = s_i * width + torch.arange(hi - lo)
            for part in parts:
                m = int(part.numel())
                if m not in tril:
                    qi, ki = torch.tril_indices(m, m)
                    tril[m] = (qi, ki)
                qi, ki = tril[m]
                local = part - lo
                allowed[s_i, local[qi], trunk + local[ki]] = True
        return TreeSegments(trunk, q_idx, allowed[:, None], slot)


@dataclass
class TreeSegments:
    """Index tensors of :func:`segment_tree_attention` (see ``attention_segments``)."""

    trunk: int  # nodes 0..trunk-1 are shared by every row
    q_idx: torch.Tensor  # [S, W] node of each segment slot (padding slots repeat node 0)
    allowed: torch.Tensor  # [S, 1, W, trunk + W] bool: trunk keys, then the segment's own
    slot: torch.Tensor  # [N - trunk] flat (segment, position) slot of each node below the trunk
    _bias: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)

    def to(self, device: torch.device | str) -> TreeSegments:
        return TreeSegments(
            self.trunk, self.q_idx.to(device), self.allowed.to(device), self.slot.to(device)
        )

    def bias(self, dtype: torch.dtype) -> torch.Tensor:
        """The additive mask of ``allowed``, built once per forward (every layer and the
        checkpointed recompute share this object) instead of once per layer call."""
        b = self._bias.get(dtype)
        if b is None:
            b = torch.zeros(self.allowed.shape, dtype=dtype, device=self.allowed.device)
            b.masked_fill_(~self.allowed, torch.finfo(dtype).min)
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

    The trunk attends causally to itself; each segment's nodes attend to the whole trunk and,
    under the tree mask, to their own segment. That computes ``trunk^2 / 2 + S x W x (trunk +
    W)`` scores instead of the dense mask's ``N^2``: in an agent batch, where a segment is one
    task's rows, about a third (measured in ``bench/train_step.py --case agent``).
    """
    t = seg.trunk
    gqa = key.shape[1] != query.shape[1]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    parts = []
    if t:
        trunk_out = sdpa(
            query[:, :, :t],
            key[:, :, :t],
            value[:, :, :t],
            is_causal=True,
            scale=scaling,
            enable_gqa=gqa,
        )
        parts.append(trunk_out.transpose(1, 2))  # [1, t, H, d]
    if seg.slot.numel():
        n_seg, width = seg.q_idx.shape
        q = query[0][:, seg.q_idx].transpose(0, 1)  # [S, H, W, d]
        k = key[0][:, seg.q_idx].transpose(0, 1)  # [S, Hkv, W, d]
        v = value[0][:, seg.q_idx].transpose(0, 1)
        if t:
            shape = (n_seg, key.shape[1], t, key.shape[3])
            k = torch.cat([key[:, :, :t].expand(shape), k], dim=2)
            v = torch.cat([value[:, :, :t].expand(shape), v], dim=2)
        out = sdpa(q, k, v, attn_mask=seg.bias(q.dtype), scale=scaling, enable_gqa=gqa)
        flat = out.transpose(1, 2).reshape(n_seg * width, out.shape[1], out.shape[3])
        parts.append(flat[seg.slot][None])
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def enable_tree_attention(model: torch.nn.Module) -> bool:
    """Switch an sdpa model to the tree-aware sdpa wrapper (identical for every other call).

    Returns False (and changes nothing) for other attention implementations.
    """
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
        if seg is None:
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kw
            )
        return segment_tree_attention(query, key, value, seg, scaling), None

    AttentionInterface.register(TREE_ATTN, attention)
    AttentionMaskInterface.register(TREE_ATTN, sdpa_mask)
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(TREE_ATTN)
    else:
        cfg._attn_implementation = TREE_ATTN
    return getattr(cfg, "_attn_implementation", None) == TREE_ATTN


def pack_rows(rows: Sequence[Sequence[int]]) -> PackedTree:
    """Pack token rows into a trie (see the module docstring for the layout)."""
    if not rows:
        raise ValueError("pack_rows needs at least one row")
    if any(len(r) == 0 for r in rows):
        raise ValueError("pack_rows got an empty row")
    order = sorted(range(len(rows)), key=lambda i: tuple(rows[i]))
    ids: list[int] = []
    pos: list[int] = []
    owned = [0] * len(rows)
    paths: list[torch.Tensor | None] = [None] * len(rows)
    prev: Sequence[int] = ()
    prev_path: list[int] = []
    for i in order:
        row = rows[i]
        k = common_prefix_len(prev, row)
        start = len(ids)
        path = prev_path[:k] + list(range(start, start + len(row) - k))
        ids.extend(int(t) for t in row[k:])
        pos.extend(range(k, len(row)))
        paths[i] = torch.tensor(path, dtype=torch.long)
        owned[i] = k
        prev, prev_path = row, path
    return PackedTree(
        input_ids=torch.tensor(ids, dtype=torch.long),
        position_ids=torch.tensor(pos, dtype=torch.long),
        paths=[p for p in paths if p is not None],
        n_logical=sum(len(r) for r in rows),
        owned_from=owned,
    )


def packed_size(rows: Sequence[Sequence[int]]) -> int:
    """Trie node count of ``rows`` without building it."""
    total = 0
    prev: tuple[int, ...] = ()
    for row in sorted(tuple(r) for r in rows):
        total += len(row) - common_prefix_len(prev, row)
        prev = row
    return total


def tree_micro_batches(
    rows_tokens: Sequence[Sequence[int]], rows: list[int], max_tokens: int
) -> list[list[int]]:
    """Split ``rows`` into groups whose trie has at most ``max_tokens`` nodes.

    Rows are taken in lexicographic order, so rows that share prefixes land in the same group
    (a single row longer than the budget still gets its own group).
    """
    order = sorted(rows, key=lambda r: tuple(rows_tokens[r]))
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    prev: Sequence[int] = ()
    for r in order:
        row = rows_tokens[r]
        add = len(row) - common_prefix_len(prev, row)
        if cur and size + add > max_tokens:
            out.append(cur)
            cur, size = [], 0
            add = len(row)
        cur.append(r)
        size += add
        prev = row
    if cur:
        out.append(cur)
    return out


def tree_supported(model: torch.nn.Module) -> str | None:
    """None if ``model`` can run a tree forward, else the reason it cannot."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None) or "eager"
    if impl not in _MASK_IMPLS:
        return (
            f"attention implementation {impl!r} takes no custom 4-D mask "
            f"(tree training needs one of {sorted(_MASK_IMPLS)})"
        )
    return None


def _model_mask(model: torch.nn.Module, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The [1, 1, N, N] mask in the form the model's attention implementation expects."""
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    kind = _MASK_IMPLS.get(impl)
    if kind is None:
        raise RuntimeError(tree_supported(model))
    mask4 = mask[None, None]
    if kind == "bool":
        return mask4
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask4, zero, torch.finfo(dtype).min)


def tree_logits(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    nodes: torch.Tensor,
    plain_head: bool,
    **extra: Any,
) -> torch.Tensor:
    """Logits [len(nodes), V] of the packed sequence at ``nodes``.

    The one model call of a tree forward. A LoRA (``peft``) wrapper is looked through (its
    adapters live inside the base model's modules). A sharded (FSDP2) model runs this as a
    registered forward method (``areal_tree_logits``, installed by the actor) so the root's
    parameters (embeddings, final norm, LM head) are gathered before it runs, as for
    ``forward``.
    """
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    kw = {"attention_mask": attention_mask, "position_ids": position_ids, "use_cache": False}
    if plain_head:
        hidden = inner.get_decoder()(input_ids=input_ids, **kw, **extra)[0]
        return inner.get_output_embeddings()(hidden[0, nodes])
    return model(input_ids=input_ids, **kw, **extra).logits[0, nodes]


def tree_token_logprobs(
    model: Any,
    tree: PackedTree,
    scored: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor],
    temperature: float = 1.0,
    *,
    plain_head: bool = True,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (and entropies) of the scored tokens of every packed row, in row-major order.

    ``scored[i]`` is a bool [len_i] mask over row ``i``'s tokens (position 0 is never scored),
    ``targets[i]`` the row's tokens. The order of the result is the flat path's
    (``token_logprobs``): row by row, position by position. Logits are computed once per distinct
    predecessor node, which is all the vocab-sized work there is.
    """
    device = next(model.parameters()).device
    src_parts: list[torch.Tensor] = []
    tgt_parts: list[torch.Tensor] = []
    for path, m, tok in zip(tree.paths, scored, targets, strict=True):
        m = m.bool().cpu()
        if m.numel() and bool(m[0]):
            raise ValueError("position 0 has no predecessor and cannot be scored")
        sel = m.nonzero().squeeze(-1)
        src_parts.append(path[sel - 1])
        tgt_parts.append(tok.cpu().long()[sel])
    src = torch.cat(src_parts).to(device)
    tgt = torch.cat(tgt_parts).to(device)
    ids = tree.input_ids.to(device)[None]
    pos = tree.position_ids.to(device)[None]
    param_dtype = next(model.parameters()).dtype
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    extra: dict = {}
    if _MASK_IMPLS.get(impl) == "segments":
        # the wrapper ignores the mask; a 4-D placeholder keeps transformers from building one
        mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
        extra["tree_segments"] = tree.attention_segments().to(device)
    else:
        mask = _model_mask(model, tree.ancestor_mask(device), param_dtype)
    uniq, inv = torch.unique(src, return_inverse=True)
    fn = getattr(model, "areal_tree_logits", None)  # a sharded model's registered method
    if fn is not None:
        logits = fn(ids, mask, pos, uniq, plain_head, **extra)
    else:
        logits = tree_logits(model, ids, mask, pos, uniq, plain_head, **extra)
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits[inv, tgt] - lse[inv]
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            probs = torch.softmax(logits, dim=-1)
            entropy = (lse - (probs * logits).sum(-1))[inv]
    return logp, entropy


__all__ = [
    "PackedTree",
    "pack_rows",
    "packed_size",
    "tree_micro_batches",
    "tree_supported",
    "enable_tree_attention",
    "segment_tree_attention",
    "tree_logits",
    "tree_token_logprobs",
]
