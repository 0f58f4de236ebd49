"""Batched sampling with per-row options, returning logprobs of the distribution sampled from.

RL needs ``logprob(token)`` under exactly the distribution the token was drawn from (temperature,
top-k and top-p applied to the RAW logits), so the trainer's importance ratios start at 1. Rows of
one batch may use different settings; each row draws from its own ``torch.Generator`` so a seeded
request gives the same tokens whatever else shares the batch. Each row's randomness is one
uniform number from its own ``random.Random`` per step, and all rows are drawn at once by
inverse-CDF (``searchsorted`` on the cumulative distribution): one vectorised op per step instead of
one ``multinomial`` call per row, which matters on small, busy CPUs.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass
class RowSampling:
    """Sampling settings of one row (already resolved from a ``GenerationConfig``)."""

    greedy: bool
    temperature: float
    top_k: int
    top_p: float
    rng: random.Random | None  # None for greedy rows
    choices: list[list[int]] | None = None  # constrained start (GenerationConfig.prefix_choices)
    explore: float = 0.0  # GenerationConfig.choice_exploration
    explored: int = 0  # tokens this row took from the exploration draw so far
    decision_pending: bool = False  # GenerationConfig.prefix_decision, until the first token
    guided: bool = False  # GenerationConfig.prefix_guided: every prefix token is the policy's

    def allowed(self, out_tokens: list[int]) -> list[int] | None:
        """Tokens allowed next after ``out_tokens`` (None = any): while the output is still a
        proper prefix of some choice, only the continuations of those choices."""
        if not self.choices:
            return None
        n = len(out_tokens)
        nxt = {c[n] for c in self.choices if len(c) > n and c[:n] == out_tokens}
        if not nxt:
            self.choices = None  # a choice is complete: free from here on
            return None
        return sorted(nxt)


def sampling_log_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Log-probabilities ``[B, V]`` of the sampling distribution per row (``-inf`` = excluded).

    ``temperature`` ``[B]`` (> 0), ``top_k`` ``[B]`` (0 = off), ``top_p`` ``[B]`` (1 = off).
    Top-k is applied first, then top-p on the renormalised remainder (the usual order).
    """
    scaled = logits.float() / temperature[:, None]
    need_k = bool((top_k > 0).any())
    need_p = bool((top_p < 1.0).any())
    if not (need_k or need_p):
        return torch.log_softmax(scaled, dim=-1)
    # Same arithmetic as transformers' TopK/TopP warpers (ascending sort, cumulative mass from the
    # tail): in flat tails many tokens sit near the top-p boundary, and a different summation
    # order would move it, so the trainer's HF-based recompute would disagree.
    sorted_logits, order = scaled.sort(dim=-1, descending=False)
    vocab = scaled.shape[-1]
    if need_k:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
        kth_largest = sorted_logits.gather(1, (vocab - k)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    if need_p:
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # rows with top_p == 1 drop nothing (threshold below any cumulative mass)
        tail = torch.where(top_p < 1.0, 1.0 - top_p.double(), -1.0).to(cum.dtype)
        drop = cum <= tail[:, None]
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.empty_like(scaled).scatter_(1, order, sorted_logits)
    return torch.log_softmax(filtered, dim=-1)


Allowed = list[int] | torch.Tensor | None
"""A row's allowed next tokens: a list of ids (a constrained start), a bool mask over the
vocabulary (a grammar), or None (any token)."""


def _restricted(
    full_row: torch.Tensor, allowed: list[int] | torch.Tensor
) -> tuple[torch.Tensor, int]:
    """``full_row`` with the tokens outside ``allowed`` at ``-inf``; and how many are allowed."""
    if isinstance(allowed, torch.Tensor):
        mask = allowed.to(full_row.device)
        if (
            mask.shape[0] < full_row.shape[0]
        ):  # the model's vocabulary is padded past the tokenizer's
            mask = torch.cat([mask, mask.new_zeros(full_row.shape[0] - mask.shape[0])])
        return full_row.masked_fill(~mask, float("-inf")), int(mask.sum())
    ids = torch.tensor(allowed, dtype=torch.long, device=full_row.device)
    row = torch.full_like(full_row, float("-inf"))
    row[ids] = full_row[ids]
    return row, len(allowed)


def sample_rows(
    logits: torch.Tensor,
    rows: list[RowSampling],
    allowed: list[Allowed] | None = None,
) -> tuple[list[int], list[float]]:
    """Pick one token per row; return the tokens and their logprobs (see ``sample_rows_top``)."""
    tokens, logps, _ = sample_rows_top(logits, rows, allowed)
    return tokens, logps


def sample_rows_top(
    logits: torch.Tensor,
    rows: list[RowSampling],
    allowed: list[Allowed] | None = None,
    top_n: list[int] | None = None,
) -> tuple[list[int], list[float], list[list[tuple[int, float]] | None]]:
    """Pick one token per row; return the tokens, their logprobs and, for rows with
    ``top_n[i] > 0``, the ``top_n[i]`` most likely tokens of the distribution the logprob is
    reported under (as ``(id, logprob)``, most likely first).
    Greedy rows take the argmax and report the logprob under the untempered, untruncated
    distribution (a point mass would give 0 and carry no information for training).
    ``allowed[i]``: row i may only pick one of these tokens (a constrained start's list of ids, or
    a grammar's bool mask); it is drawn from the row's tempered distribution restricted to them.
    Its reported logprob:

    - a choice (several allowed tokens): the model's tempered, *unrestricted* logprob, the one
      the trainer recomputes from the same weights, so the PPO ratio starts at 1. The restricted
      one (what it was drawn from) differs by log Z, the allowed tokens' share of the mass: on
      the demo's tool-name choice Z was 0.23 on average (0.05-0.57), so every ratio started near
      0.23. A failed choice was then past the lower clip and got no gradient, and a right one was
      pushed up until its probability had grown by 1.28/Z, not by 28 %, in one update.
    - a forced token (one allowed token): 0. It is no choice of the policy: reporting its
      unrestricted logprob (-38 at T=0.4) made the ratio explode to e^37 as soon as an update
      raised it, and one such token dominated the loss (approx_kl 3e16 at step 3 of a T=0.4 run).

    A row whose first token stands for a decision the proxy took for the policy
    (``decision_pending``, ``GenerationConfig.prefix_decision``) reports the model's logprob
    for that token even when it was the only one allowed, and counts as explored. A guided row
    (``guided``, ``GenerationConfig.prefix_guided``: the proxy writes a reference call) reports
    the model's logprob for every token of its constrained start and counts as explored.

    A sampled constrained row with ``explore > 0`` (``GenerationConfig.choice_exploration``)
    replaces its draw, with that probability, by a uniform pick among the allowed tokens and
    still reports the model's logprob of the token it took, as above (see the field's docs).
    """
    device = logits.device
    temp = torch.tensor(
        [1.0 if r.greedy else r.temperature for r in rows], dtype=torch.float32, device=device
    )
    top_k = torch.tensor([0 if r.greedy else r.top_k for r in rows], device=device)
    top_p = torch.tensor(
        [1.0 if r.greedy else r.top_p for r in rows], dtype=torch.float64, device=device
    )
    logp = sampling_log_probs(logits, temp, top_k, top_p)
    report = logp
    limits = allowed or []
    constrained = [
        i for i, a in enumerate(limits) if a is not None and not (isinstance(a, list) and not a)
    ]
    n_allowed: dict[int, int] = {}
    if constrained:
        full = torch.log_softmax(logits.float() / temp[:, None], dim=-1)
        logp, report = logp.clone(), logp.clone()
        for i in constrained:
            row, n_allowed[i] = _restricted(full[i], limits[i])  # type: ignore[arg-type]
            if n_allowed[i] == 0:  # nothing allowed (a grammar in error): leave the row free
                logger.warning("row %d: the constraint allows no token; sampling it freely", i)
                n_allowed[i] = -1
                continue
            # Normalised before it is drawn from: at a low temperature every allowed token may
            # be so unlikely that exp() of the unnormalised row underflows to 0 everywhere, and
            # the inverse-CDF draw would then return a token outside the allowed set.
            logp[i] = row - torch.logsumexp(row, dim=-1)
            # Reported: the model's own (tempered, unrestricted) logprob, which is what the
            # trainer recomputes; a forced token reports 0 (no choice, see the docstring).
            report[i] = logp[i] if n_allowed[i] == 1 else full[i]
            if rows[i].decision_pending:  # the proxy's decision for the policy: a choice
                report[i] = full[i]
                rows[i].decision_pending = False
                rows[i].explored += 1
            elif rows[i].guided and isinstance(limits[i], list):  # a reference call's token
                report[i] = full[i]
                rows[i].explored += 1
    chosen = logp.argmax(dim=-1)  # greedy rows (and placeholder for the others)
    sampled = [i for i, r in enumerate(rows) if not r.greedy]
    if sampled:
        idx = torch.tensor(sampled, dtype=torch.long, device=device)
        cdf = logp.index_select(0, idx).exp().double().cumsum(dim=-1)
        u = torch.tensor(
            [rows[i].rng.random() for i in sampled],  # type: ignore[union-attr]
            dtype=torch.float64,
            device=device,
        )
        draw = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        chosen.index_copy_(0, idx, draw.clamp_(max=logp.shape[-1] - 1))
    for i in constrained:
        row_s = rows[i]
        options = limits[i]
        if not isinstance(options, list):  # exploration is for a constrained start's choices
            continue
        if row_s.explore > 0 and row_s.rng is not None and len(options) > 1:
            if row_s.rng.random() < row_s.explore:
                chosen[i] = options[row_s.rng.randrange(len(options))]
                row_s.explored += 1
    token_logp = report.gather(1, chosen[:, None])[:, 0]
    tops: list[list[tuple[int, float]] | None] = [None] * len(rows)
    if top_n and any(top_n):
        k = min(max(top_n), report.shape[-1])
        values, ids = report.topk(k, dim=-1)
        for i, n in enumerate(top_n):
            if n:
                pairs = zip(ids[i, :n].tolist(), values[i, :n].tolist(), strict=True)
                tops[i] = [(t, lp) for t, lp in pairs if lp > float("-inf")]
    return chosen.tolist(), token_logp.tolist(), tops
