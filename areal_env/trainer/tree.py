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

Layout: the rows in that order walk the trie depth first, so the trie is laid out in preorder: the
nodes below node ``k`` are the interval ``[k, end[k])`` (:meth:`PackedTree.subtree_end`), which
is what the FlexAttention kernel's block mask is built from.

Attention: the dense ancestor mask as a 4-D float mask (sdpa or eager) computes ``N^2`` scores,
most of them masked: a node attends only to its ancestors. ``tree_attention`` holds the kernels
that skip the masked part (trunk/segment sdpa on any device, FlexAttention on CUDA); the actor
registers them with transformers for sdpa models (:func:`tree_attention.enable_tree_attention`).
A packed sequence is bounded by ``micro_batch_tokens`` nodes (:func:`tree_micro_batches`). The
one model call is :func:`tree_logprobs`; a sharded (FSDP2) model runs it as a registered forward
method so its root parameters are gathered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import record_function

from areal_env.api.tokens import common_prefix_len
from areal_env.trainer.logprobs import HeadInputs, head_logprobs, logits_logprobs
from areal_env.trainer.tree_attention import TREE_ATTN, TreeSegments, flex_tree_mask

# Attention implementations that accept an arbitrary 4-D mask from transformers.
_MASK_IMPLS = {"sdpa": "additive", "eager": "additive", TREE_ATTN: "kernel"}


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

    def subtree_end(self) -> torch.Tensor:
        """[N] long: the nodes below node ``k`` (itself included) are ``k .. end[k] - 1``.

        The trie is laid out in preorder (rows in lexicographic order extend the previous
        row's path), so a subtree is one interval, ending after the last node of the last row
        through it; a row's nodes ascend along its path."""
        end = torch.arange(1, self.n_nodes + 1)
        if self.paths:
            idx = torch.cat(self.paths)
            last = torch.cat([p[-1:].expand(p.numel()) + 1 for p in self.paths])
            end.scatter_reduce_(0, idx, last, reduce="amax")
        return end

    def attention_segments(self) -> TreeSegments:
        """The trunk/segment layout of ``tree_attention.segment_tree_attention``.

        The trunk is the prefix every row shares (nodes ``0..T-1``: the first row in trie order
        lays it out first). Every other node was added by exactly one row, as the end of that
        row's path; rows add their nodes in trie order, so those segments are consecutive.
        """
        n = self.n_nodes
        trunk = n
        for path in self.paths:
            k = int(path.numel())
            off = (path != torch.arange(k)).nonzero()
            trunk = min(trunk, int(off[0]) if off.numel() else k)
        added = []
        for path, owned in zip(self.paths, self.owned_from, strict=True):
            first = max(owned, trunk)
            if int(path.numel()) > first:
                added.append((int(path[first]), int(path.numel()) - first, path))
        added.sort(key=lambda a: a[0])
        at = trunk
        for start, size, _ in added:
            if start != at:  # each segment starts where the last one ended
                raise AssertionError("tree segments do not tile the nodes below the trunk")
            at += size
        if at != n:
            raise AssertionError("tree segments do not cover the nodes below the trunk")
        return TreeSegments(trunk, tuple(a[1] for a in added), [a[2] for a in added])


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
    """The [1, 1, N, N] additive mask for an sdpa/eager model without the tree kernels."""
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl not in _MASK_IMPLS:
        raise RuntimeError(tree_supported(model))
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask[None, None], zero, torch.finfo(dtype).min)


def tree_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    nodes: torch.Tensor,
    spec: HeadInputs,
    plain_head: bool,
    **extra: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (and entropies) of the tokens ``spec`` scores, predicted from the packed
    sequence's ``nodes``.

    The one model call of a tree forward. A LoRA (``peft``) wrapper is looked through (its
    adapters live inside the base model's modules). A sharded (FSDP2) model runs this as a
    registered forward method (``areal_tree_logprobs``, installed by the actor) so the root's
    parameters (embeddings, final norm, LM head) are gathered before it runs, as for
    ``forward``.
    """
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    kw = {"attention_mask": attention_mask, "position_ids": position_ids, "use_cache": False}
    if plain_head:
        hidden = inner.get_decoder()(input_ids=input_ids, **kw, **extra)[0][0, nodes]
        head = inner.get_output_embeddings()
        if type(head) is torch.nn.Linear and head.bias is None:
            return head_logprobs(hidden, head.weight, spec)
        return logits_logprobs(head(hidden), spec)
    return logits_logprobs(model(input_ids=input_ids, **kw, **extra).logits[0, nodes], spec)


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
    kernel: str = "sdpa",
    chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (and entropies) of the scored tokens of every packed row, in row-major order.

    ``scored[i]`` is a bool [len_i] mask over row ``i``'s tokens (position 0 is never scored),
    ``targets[i]`` the row's tokens. The order of the result is the flat path's
    (``token_logprobs``): row by row, position by position. The LM head runs once per distinct
    predecessor node, which is all the vocab-sized work there is, ``chunk`` nodes at a time.
    ``kernel``: ``sdpa`` (trunk/segments) or ``flex`` (FlexAttention; CUDA) for models running
    the tree attention function, else the dense mask.
    """
    device = next(model.parameters()).device
    with record_function("tree/index"):
        src_parts: list[torch.Tensor] = []
        tgt_parts: list[torch.Tensor] = []
        for path, m, tok in zip(tree.paths, scored, targets, strict=True):
            m = m.bool().cpu()
            if m.numel() and bool(m[0]):
                raise ValueError("position 0 has no predecessor and cannot be scored")
            sel = m.nonzero().squeeze(-1)
            src_parts.append(path[sel - 1])
            tgt_parts.append(tok.cpu().long()[sel])
        src = torch.cat(src_parts)
        tgt = torch.cat(tgt_parts)
        uniq, inv = torch.unique(src, return_inverse=True)
        # the head takes its tokens grouped by predecessor node (ascending): sort, then undo
        order = torch.argsort(inv, stable=True)
        spec = HeadInputs(
            inv[order].to(device),
            tgt[order].to(device),
            1.0 / temperature,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            chunk=chunk,
        )
        ids = tree.input_ids.to(device)[None]
        pos = tree.position_ids.to(device)[None]
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    extra: dict = {}
    with record_function("tree/mask"):
        if _MASK_IMPLS.get(impl) == "kernel":
            # the kernels ignore the mask; a 4-D placeholder keeps transformers from building one
            mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
            if kernel == "flex":
                extra["tree_flex"] = flex_tree_mask(tree.subtree_end(), device)
            else:
                extra["tree_segments"] = tree.attention_segments().to(device)
        else:
            dtype = next(model.parameters()).dtype
            mask = _model_mask(model, tree.ancestor_mask(device), dtype)
    args = (ids, mask, pos, uniq.to(device), spec, plain_head)
    fn = getattr(model, "areal_tree_logprobs", None)  # a sharded model's registered method
    logp_sorted, ent = fn(*args, **extra) if fn else tree_logprobs(model, *args, **extra)
    logp = logp_sorted[torch.argsort(order).to(device)]
    return logp, (ent[inv.to(device)] if ent is not None else None)
