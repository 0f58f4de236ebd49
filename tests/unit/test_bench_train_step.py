"""``bench/train_step.py --case attention``: its baseline (the segment kernel's padded layout of
until 2026-11-29) computes the same attention, forward and backward, as the library's kernel and
the dense ancestor mask, so the bench's ``segments_vs_padded`` compares equal work."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from areal_env.trainer.tree import pack_rows
from areal_env.trainer.tree_attention import segment_tree_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from train_step import padded_segment_attention, padded_segment_layout  # noqa: E402


@pytest.mark.parametrize("seed", range(8))
def test_the_padded_baseline_equals_the_segment_kernel(seed):
    rng = random.Random(seed)
    system = [rng.randint(0, 5) for _ in range(rng.randint(1, 40))]
    rows = [
        system + [rng.randint(0, 3) for _ in range(rng.randint(1, 30))]
        for _ in range(rng.randint(2, 10))
    ]
    tree = pack_rows(rows)
    seg = tree.attention_segments()
    if not seg.sizes or not seg.trunk:
        pytest.skip("every row ends in the trunk")
    n = tree.n_nodes
    g = torch.Generator().manual_seed(seed)
    qkv = [torch.randn(1, h, n, 8, generator=g).requires_grad_() for h in (4, 2, 2)]
    weight = torch.randn(1, n, 4, 8, generator=g)
    layout = padded_segment_layout(seg)
    outs, grads = [], []
    for fn in (
        lambda: segment_tree_attention(*qkv, seg, 0.3),
        lambda: padded_segment_attention(*qkv, seg.trunk, layout, 0.3),
    ):
        out = fn()
        outs.append(out)
        grads.append(torch.autograd.grad((out * weight).sum(), qkv))
    assert (outs[0] - outs[1]).abs().max() < 1e-5
    for a, b in zip(*grads, strict=True):
        assert (a - b).abs().max() < 1e-5
