"""``bench/train_step.py --case attention``: its baseline (the segment kernel's per-task layout
of until 2026-11-29) computes the same attention, forward and backward, as the library's kernel
and the dense ancestor mask, so the bench's ``segments_vs_tasks`` compares equal work."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from areal_env.trainer.tree import pack_rows
from areal_env.trainer.tree_attention import segment_tree_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from train_step import task_segment_attention, task_segment_layout  # noqa: E402


@pytest.mark.parametrize("seed", range(8))
def test_the_per_task_baseline_equals_the_segment_kernel(seed):
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
    layout = task_segment_layout(tree)
    assert len(layout.sizes) <= len(seg.sizes)  # a task's rows: one segment there, several here
    outs, grads = [], []
    for fn in (
        lambda: segment_tree_attention(*qkv, seg, 0.3),
        lambda: task_segment_attention(*qkv, layout, 0.3),
    ):
        out = fn()
        outs.append(out)
        grads.append(torch.autograd.grad((out * weight).sum(), qkv))
    assert (outs[0] - outs[1]).abs().max() < 1e-5
    for a, b in zip(*grads, strict=True):
        assert (a - b).abs().max() < 1e-5


def test_a_recorded_step_rebuilds_the_batch_it_trained_on(tmp_path):
    """``--tokens RUN_DIR``: the rows of a recorded step come back with their tokens, loss
    masks, the engine's logprobs at the scored positions, rewards and groups."""
    from train_step import recorded_batch

    from areal_env.view.tokens import TokenRecords
    from tests.fixtures.view_runs import make_run

    run = make_run(tmp_path / "run", steps=2, groups=2, group_size=2)
    batch = recorded_batch(str(run.path), 2)
    recs = TokenRecords(run.path)
    recs.refresh()
    rows, rewards, groups = [], [], []
    for part in recs.parts_of(2):
        for entry in part.sessions:
            rows += recs.read_block(part, entry)
            rewards += [r["reward"] for r in entry["rows"]]
            groups += [entry["group"]] * len(entry["rows"])
    assert batch["input_ids"].shape[0] == len(rows) == 16
    for i, row in enumerate(rows):
        n = len(row.input_ids)
        assert batch["input_ids"][i, :n].tolist() == row.input_ids.tolist()
        assert int(batch["attention_mask"][i].sum()) == n
        scored = batch["loss_mask"][i].bool()
        assert scored[:n].tolist() == row.loss_mask.astype(bool).tolist()
        assert torch.allclose(batch["logprobs"][i][scored], torch.tensor(row.rollout_logprob))
    assert batch["rewards"].tolist() == pytest.approx(rewards)
    assert batch["group_ids"].tolist() == groups and len(set(groups)) == 2
    with pytest.raises(SystemExit, match="no step 7"):
        recorded_batch(str(run.path), 7)
    with pytest.raises(SystemExit, match="no token records"):
        recorded_batch(str(tmp_path), None)
