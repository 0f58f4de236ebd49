"""A radix cache of prompt KV: requests that share a prompt prefix reuse its keys and values.

Why: agent traffic repeats a long prefix in every request (the system prompt with the tool
schemas, a GRPO group's task, earlier turns of the same episode). Re-encoding it dominates the
prefill time of short completions. Keys/values at position ``i`` depend only on tokens ``0..i``
(and the weights), so the KV of any prefix of an earlier prompt can be copied instead of recomputed.

Layout: a radix tree over token ids. Each edge holds its tokens and their KV
``[layers, 2, kv_heads, n, head_dim]``; a shared prefix is stored once, and a lookup concatenates
the KV along the matched path (it may end inside an edge). Memory is bounded by ``max_tokens``:
least recently used leaves are evicted first. The owner clears the cache when the weights change
(cached KV is only valid for the weights that produced it). Not thread-safe: the engine's worker
thread is its only user.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from areal_env.api.tokens import common_prefix_len

_EPOCHS = itertools.count(1)  # process-wide, so a replaced cache never reuses an old epoch


class _Node:
    __slots__ = ("key", "kv", "children", "parent", "used")

    def __init__(
        self, key: tuple[int, ...], kv: torch.Tensor | None, parent: _Node | None, used: int
    ) -> None:
        self.key = key
        self.kv = kv  # [L, 2, H, len(key), D]
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.used = used


class PrefixCache:
    """Radix tree of token prefixes -> KV, with LRU eviction under a token budget."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens!r}")
        self.max_tokens = max_tokens
        self.epoch = next(_EPOCHS)  # changes whenever the cached KV stops matching the weights
        self._clock = itertools.count(1)
        self._root = _Node((), None, None, 0)
        self.tokens = 0  # tokens stored
        self.hits = 0  # lookups that reused something
        self.lookups = 0
        self.evicted = 0

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    def clear(self) -> None:
        """Drop everything (after a weight update). KV computed before this call (a running
        row's) must not be inserted afterwards: compare ``epoch``."""
        self.epoch = next(_EPOCHS)
        self._root = _Node((), None, None, 0)
        self.tokens = 0

    # ---- lookup ----------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], limit: int | None = None) -> tuple[int, torch.Tensor]:
        """Longest cached prefix of ``tokens`` (at most ``limit`` tokens): its length and KV
        ``[L, 2, H, n, D]`` (a new tensor; n = 0 gives an empty one only when something is cached).
        """
        n, parts = self.match_parts(tokens, limit)
        return (n, torch.cat(parts, dim=3)) if n else (0, torch.empty(0))

    def match_parts(
        self, tokens: Sequence[int], limit: int | None = None
    ) -> tuple[int, list[torch.Tensor]]:
        """Like ``match``, but the KV as views of the cache's edges, in order (no copy): a caller
        that writes the prefix into its own buffer copies it once instead of twice. The cache never
        writes into a stored tensor (splits and evictions replace or drop them), so the views keep
        their values whatever happens to the cache afterwards."""
        self.lookups += 1
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        node, pos = self._root, 0
        parts: list[torch.Tensor] = []
        now = next(self._clock)
        while pos < limit:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = common_prefix_len(child.key, tokens[pos:limit])
            assert child.kv is not None
            child.used = now
            parts.append(child.kv[:, :, :, :k] if k < len(child.key) else child.kv)
            pos += k
            if k < len(child.key):
                break
            node = child
        if pos:
            self.hits += 1
        return pos, parts

    def match_length(self, tokens: Sequence[int], limit: int | None = None) -> int:
        """Length of the longest cached prefix, without copying (and without touching LRU)."""
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        node, pos = self._root, 0
        while pos < limit:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = common_prefix_len(child.key, tokens[pos:limit])
            pos += k
            if k < len(child.key):
                break
            node = child
        return pos

    # ---- insertion -------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], kv: torch.Tensor, start: int = 0) -> int:
        """Store ``tokens`` with the KV ``[L, 2, H, len(tokens) - start, D]`` of
        ``tokens[start:]``; returns the tokens added. ``start`` lets a caller copy only what
        ``match_length`` says is missing; it must not exceed the cached prefix.

        Only the part beyond what is cached is copied (``clone``, so the caller's buffers are not
        kept alive). Sequences longer than the whole budget are not stored.
        """
        if not self.enabled or not tokens or len(tokens) > self.max_tokens:
            return 0
        if kv.shape[3] != len(tokens) - start:
            raise ValueError(
                f"kv holds {kv.shape[3]} positions for {len(tokens) - start} tokens "
                f"({len(tokens)} from {start})"
            )
        now = next(self._clock)
        node, pos = self._root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            k = common_prefix_len(child.key, tokens[pos:])
            child.used = now
            if k < len(child.key):
                child = self._split(child, k)
            pos += k
            node = child
        if pos < start:
            raise ValueError(f"kv starts at token {start} but only {pos} tokens are cached")
        added = len(tokens) - pos
        if added:
            leaf = _Node(tuple(tokens[pos:]), kv[:, :, :, pos - start :].clone(), node, now)
            node.children[tokens[pos]] = leaf
            self.tokens += added
        self._evict(protect=node if not added else leaf)
        return added

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut ``node``'s edge after ``k`` tokens; returns the new upper node."""
        assert node.kv is not None and node.parent is not None
        upper = _Node(node.key[:k], node.kv[:, :, :, :k].clone(), node.parent, node.used)
        node.parent.children[node.key[0]] = upper
        node.key, node.kv = node.key[k:], node.kv[:, :, :, k:].clone()
        node.parent = upper
        upper.children[node.key[0]] = node
        return upper

    def _evict(self, protect: _Node) -> None:
        """Drop least recently used leaves until the budget holds (never ``protect``'s path)."""
        if self.tokens <= self.max_tokens:
            return
        keep: set[int] = set()
        n: _Node | None = protect
        while n is not None:
            keep.add(id(n))
            n = n.parent
        leaves = [x for x in self._nodes() if not x.children and id(x) not in keep]
        leaves.sort(key=lambda x: x.used)
        while self.tokens > self.max_tokens and leaves:
            leaf = leaves.pop(0)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self.tokens -= len(leaf.key)
            self.evicted += len(leaf.key)
            if parent is not self._root and not parent.children and id(parent) not in keep:
                # the parent became a leaf: it competes by its own last use
                i = 0
                while i < len(leaves) and leaves[i].used <= parent.used:
                    i += 1
                leaves.insert(i, parent)

    def _nodes(self) -> list[_Node]:
        out, stack = [], list(self._root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out


__all__ = ["PrefixCache"]
