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

Cost model: the linear layers scale with the node count, attention with the node count squared
(the mask is dense), so a packed sequence is bounded by ``micro_batch_tokens`` nodes
(:func:`tree_micro_batches`). The module is model-agnostic (it only calls the decoder with
``input_ids``, ``position_ids`` and a 4-D mask), so a sharded (FSDP) module runs it unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Attention implementations that accept an arbitrary 4-D mask from transformers.
_MASK_IMPLS = {"sdpa": "bool", "eager": "additive"}


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


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

    @property
    def n_nodes(self) -> int:
        return int(self.input_ids.numel())

    def ancestor_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """Bool [N, N]: ``mask[q, k]`` iff node ``k`` is ``q`` or one of its ancestors."""
        n = self.n_nodes
        mask = torch.zeros((n, n), dtype=torch.bool, device=device)
        cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for path in self.paths:
            length = int(path.numel())
            if length not in cache:
                cache[length] = torch.tril_indices(length, length, device=device)
            qi, ki = cache[length]
            p = path.to(device)
            mask[p[qi], p[ki]] = True
        return mask


def pack_rows(rows: Sequence[Sequence[int]]) -> PackedTree:
    """Pack token rows into a trie (see the module docstring for the layout)."""
    if not rows:
        raise ValueError("pack_rows needs at least one row")
    if any(len(r) == 0 for r in rows):
        raise ValueError("pack_rows got an empty row")
    order = sorted(range(len(rows)), key=lambda i: tuple(rows[i]))
    ids: list[int] = []
    pos: list[int] = []
    paths: list[torch.Tensor | None] = [None] * len(rows)
    prev: Sequence[int] = ()
    prev_path: list[int] = []
    for i in order:
        row = rows[i]
        k = _lcp(prev, row)
        start = len(ids)
        path = prev_path[:k] + list(range(start, start + len(row) - k))
        ids.extend(int(t) for t in row[k:])
        pos.extend(range(k, len(row)))
        paths[i] = torch.tensor(path, dtype=torch.long)
        prev, prev_path = row, path
    return PackedTree(
        input_ids=torch.tensor(ids, dtype=torch.long),
        position_ids=torch.tensor(pos, dtype=torch.long),
        paths=[p for p in paths if p is not None],
        n_logical=sum(len(r) for r in rows),
    )


def packed_size(rows: Sequence[Sequence[int]]) -> int:
    """Trie node count of ``rows`` without building it."""
    total, prev = 0, ()
    for row in sorted(tuple(r) for r in rows):
        total += len(row) - _lcp(prev, row)
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
        add = len(row) - _lcp(prev, row)
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


def tree_token_logprobs(
    model: torch.nn.Module,
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
    mask = _model_mask(model, tree.ancestor_mask(device), param_dtype)
    uniq, inv = torch.unique(src, return_inverse=True)
    if plain_head:
        hidden = model.get_decoder()(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False
        )[0]
        logits = model.get_output_embeddings()(hidden[0, uniq])
    else:
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
        logits = out.logits[0, uniq]
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
    "tree_token_logprobs",
]
