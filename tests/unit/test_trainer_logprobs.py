"""The chunked LM head: logprobs, entropies and their gradients equal full-logits autograd."""

from __future__ import annotations

import pytest
import torch

from areal_env.trainer.logprobs import (
    HeadInputs,
    head_logprobs,
    inverse_temperatures,
    logits_logprobs,
)


def _case(seed: int, n_pos: int = 7, vocab: int = 50, hidden: int = 6, fanout: bool = False):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n_pos, hidden, dtype=torch.float64, generator=g)
    w = torch.randn(vocab, hidden, dtype=torch.float64, generator=g)
    if fanout:  # a trie: some positions predict several tokens, one predicts none
        rows = torch.tensor(sorted([0, 0, 1, 2, 2, 2, 4, 5, 5, 6][: n_pos + 3]))
    else:
        rows = torch.arange(n_pos)
    targets = torch.randint(0, vocab, (rows.numel(),), generator=g)
    return h, w, rows, targets


def _reference(h, w, spec):
    """Plain autograd over the full logits (what the trainer computed before chunking)."""
    return logits_logprobs(h @ w.T, spec)


@pytest.mark.parametrize("chunk", [0, 1, 3, 100])
@pytest.mark.parametrize("temperature", ["one", "scalar", "per_position"])
@pytest.mark.parametrize("fanout", [False, True])
def test_chunked_head_equals_full_logits_with_gradients(chunk, temperature, fanout):
    h, w, rows, targets = _case(chunk * 7 + len(temperature), fanout=fanout)
    inv: float | torch.Tensor = {"one": 1.0, "scalar": 1 / 0.7}.get(temperature, 0.0)
    if temperature == "per_position":
        inv = 1 / (0.5 + torch.rand(h.shape[0], generator=torch.Generator().manual_seed(1)))
    g = torch.Generator().manual_seed(5)
    g_logp = torch.randn(rows.numel(), dtype=torch.float64, generator=g)
    g_ent = torch.randn(h.shape[0], dtype=torch.float64, generator=g)
    results = []
    for fn in (_reference, head_logprobs):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        spec = HeadInputs(rows, targets, inv, with_entropy=True, entropy_grad=True, chunk=chunk)
        logp, ent = fn(hh, ww, spec)
        assert ent is not None
        ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
        results.append((logp.detach(), ent.detach(), hh.grad, ww.grad))
    for ref, got in zip(*results, strict=True):
        assert got.shape == ref.shape
        assert (got.double() - ref.double()).abs().max() < 1e-10
    assert results[0][2].abs().max() > 1e-3  # gradients are not trivially zero


def test_entropy_without_gradient_and_logprobs_only():
    h, w, rows, targets = _case(3)
    hh = h.clone().requires_grad_()
    logp, ent = head_logprobs(hh, w, HeadInputs(rows, targets, with_entropy=True))
    assert ent is not None and not ent.requires_grad
    logp.sum().backward()
    ref_h = h.clone().requires_grad_()
    ref, _ = _reference(ref_h, w, HeadInputs(rows, targets))
    ref.sum().backward()
    assert (hh.grad - ref_h.grad).abs().max() < 1e-10
    logp2, none = head_logprobs(h, w, HeadInputs(rows, targets, chunk=2))
    assert none is None and (logp2 - ref.detach()).abs().max() < 1e-10


def test_low_precision_compute_keeps_fp32_gradients_of_fp32_weights():
    """Under bf16 autocast the matmuls run in bf16; the weight's gradient is fp32 and close to
    the fp32 one (the bf16 rounding of the logits, not more)."""
    h, w, rows, targets = _case(4, n_pos=32, vocab=300, hidden=16)
    h, w = h.float(), w.float()
    grads = []
    for autocast in (False, True):
        ww = w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logp, _ = head_logprobs(h, ww, HeadInputs(rows, targets, chunk=8))
        assert logp.dtype == torch.float32
        logp.sum().backward()
        assert ww.grad is not None and ww.grad.dtype == torch.float32
        grads.append(ww.grad)
    rel = float((grads[0] - grads[1]).norm() / grads[0].norm())
    assert 0 < rel < 2e-2


def test_inverse_temperatures():
    assert inverse_temperatures(0.5) == 2.0
    assert inverse_temperatures(torch.full((4,), 0.8)) == pytest.approx(1.25)
    per = inverse_temperatures(torch.tensor([0.5, 1.0]))
    assert isinstance(per, torch.Tensor) and per.tolist() == [2.0, 1.0]
