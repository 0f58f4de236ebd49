"""A request's state inside ``LocalEngine``'s batch worker, and the pure helpers that group and
constrain rows (used by ``engine.local``, which makes the state, and ``engine.batch_worker``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from areal_env.api.io import ModelRequest
from areal_env.engine.grammar import RowGrammar
from areal_env.engine.json_end import JsonEnd
from areal_env.engine.sampler import Allowed, RowSampling


@dataclass(eq=False)  # identity semantics: requests are compared/removed by object
class RequestState:
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
    kv_epoch: int = -1  # the prefix cache's epoch when this row was prefilled
    grammar: RowGrammar | None = None  # GenerationConfig.constraint, compiled
    grammar_failed: bool = False  # a token the grammar refused: the row ends there
    close_margin: int = 0  # the budget's last tokens, where the grammar closes what is open
    top_logprobs: int = 0  # GenerationConfig.top_logprobs
    out_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    adapter: int = 0  # the row's LoRA adapter slot (engine.adapters.AdapterSet); 0 = the base
    key_offset: int = 0
    """Added to every token id of the row's prefix-cache keys (``slot * vocab``): KV computed
    under one adapter is never reused under another (the keys of each adapter live in a range
    of their own), while rows of the same adapter still share their prefixes."""
    _prompt_key: list[int] | None = None

    def cache_key(self, ids: list[int]) -> list[int]:
        """``ids`` as this row's prefix-cache key (``ids`` itself for the base weights)."""
        if not self.key_offset:
            return ids
        off = self.key_offset
        return [t + off for t in ids]

    @property
    def prompt_key(self) -> list[int]:
        """The prompt's prefix-cache key (computed once)."""
        if self._prompt_key is None:
            self._prompt_key = self.cache_key(list(self.req.input_ids))
        return self._prompt_key


def allowed_tokens(
    rows: list[RequestState], masks: dict[int, torch.Tensor] | None = None
) -> list[Allowed] | None:
    """Each row's allowed next tokens: its grammar's mask (``masks[i]`` for row ``i``), or the
    continuations of its constrained start; None when no row is constrained."""
    if not masks and not any(r.sampling.choices for r in rows):
        return None
    out: list[Allowed] = []
    for i, r in enumerate(rows):
        mask = masks.get(i) if masks else None
        out.append(mask if mask is not None else r.sampling.allowed(r.out_tokens))
    return out


def length_groups(
    reqs: list[RequestState],
    max_waste: float = 0.2,
    size: Callable[[RequestState], int] = lambda r: len(r.req.input_ids),
) -> list[list[RequestState]]:
    """Split requests (longest first) so that each group's left padding stays under ``max_waste``.

    Padding is wasted compute in the prefill forward; one extra forward costs far less.
    ``size`` is the tokens a request prefills (its prompt, or the part beyond a cached prefix).
    """
    ordered = sorted(reqs, key=size, reverse=True)
    groups: list[list[RequestState]] = []
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
