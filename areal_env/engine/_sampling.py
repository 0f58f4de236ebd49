"""Batched sampling with per-row options, returning logprobs of the distribution sampled from.

RL needs ``logprob(token)`` under exactly the distribution the token was drawn from (temperature,
top-k and top-p applied to the RAW logits), so the trainer's importance ratios start at 1. Rows of
one batch may use different settings; each row draws from its own ``torch.Generator`` so a seeded
request gives the same tokens whatever else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RowSampling:
    """Sampling settings of one row (already resolved from a ``GenerationConfig``)."""

    greedy: bool
    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator | None


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
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    vocab = scaled.shape[-1]
    if need_k:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
        ranks = torch.arange(vocab, device=scaled.device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    if need_p:
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # rows with top_p == 1 never drop anything (avoid float noise at the tail)
        p = torch.where(top_p < 1.0, top_p, torch.full_like(top_p, float("inf")))
        drop = mass_before >= p[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(scaled, float("-inf")).scatter(1, order, sorted_logits)
    return torch.log_softmax(filtered, dim=-1)


def sample_rows(logits: torch.Tensor, rows: list[RowSampling]) -> tuple[list[int], list[float]]:
    """Pick one token per row; return the tokens and their logprobs (plain Python lists).

    Greedy rows take the argmax and report the logprob under the untempered, untruncated
    distribution (a point mass would give 0 and carry no information for training).
    """
    device = logits.device
    temp = torch.tensor(
        [1.0 if r.greedy else r.temperature for r in rows], dtype=torch.float32, device=device
    )
    top_k = torch.tensor([0 if r.greedy else r.top_k for r in rows], device=device)
    top_p = torch.tensor(
        [1.0 if r.greedy else r.top_p for r in rows], dtype=torch.float32, device=device
    )
    logp = sampling_log_probs(logits, temp, top_k, top_p)
    tokens: list[int] = []
    sampled_rows = [i for i, r in enumerate(rows) if not r.greedy]
    chosen = logp.argmax(dim=-1)  # greedy rows (and placeholder for the others)
    if sampled_rows:
        probs = logp.exp()
        for i in sampled_rows:
            chosen[i] = torch.multinomial(probs[i], 1, generator=rows[i].generator)[0]
    token_logp = logp.gather(1, chosen[:, None])[:, 0]
    tokens = chosen.tolist()
    return tokens, token_logp.tolist()
