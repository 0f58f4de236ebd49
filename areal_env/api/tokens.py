"""Token-sequence helpers shared by the engine's prefix cache, its batch scheduler and the
trainer's prefix-shared packing."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share.

    Two lists (or two tuples) are compared by slices, which run in C, bisecting on the first
    mismatch: prompts are hundreds of tokens, and the engine compares every running row's."""
    n = min(len(a), len(b))
    if type(a) is type(b) and isinstance(a, (list, tuple)):
        if a[:n] == b[:n]:
            return n
        lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if a[lo:mid] == b[lo:mid]:
                lo = mid
            else:
                hi = mid
        return lo
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
