"""Data loading/position, atomic checkpoints, metrics/plot/dump files (no training loop)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from areal_env.trainer import checkpoint as ckpt
from areal_env.trainer.data import DataLoader, load_items
from areal_env.trainer.stats import MetricsLogger, dump_records, plot_reward_curve


def test_dataset_sources_and_resumable_position(tmp_path):
    items = [{"q": i} for i in range(10)]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in items) + "\n")
    assert list(load_items(str(path))) == items
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(items)
    assert load_items(ds)[3] == {"q": 3}
    with pytest.raises(TypeError, match="list of dicts"):
        load_items(42)
    with pytest.raises(ValueError, match="fewer than one batch"):
        DataLoader(items[:2], 3)

    full = DataLoader(items, 3, seed=5)
    assert len(full) == 3  # the partial batch is dropped
    seq = [[x["q"] for x in full.next_batch()] for _ in range(7)]  # crosses two epochs
    assert len(set(sum(seq[:3], []))) == 9  # no repeats within an epoch
    assert seq[:3] != seq[3:6]  # reshuffled per epoch
    # a loader restored from a saved position continues identically
    part = DataLoader(items, 3, seed=5)
    for _ in range(4):
        part.next_batch()
    state = json.loads(json.dumps(part.state_dict()))
    resumed = DataLoader(items, 3, seed=5)
    resumed.load_state_dict(state)
    assert [[x["q"] for x in resumed.next_batch()] for _ in range(3)] == seq[4:7]
    # items get a task id when they have none; existing ids are kept
    b = DataLoader([{"id": "a"}, {"x": 1}], 2, shuffle=False).next_batch()
    assert b[0]["id"] == "a" and "task_id" not in b[0] and b[1]["task_id"] == "1"


def test_checkpoint_atomic_save_and_restore(tmp_path, model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.model.norm.weight.data.fill_(0.5)
    loss = model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum()
    loss.backward()
    opt.step()
    torch.manual_seed(123)
    expected_rand = torch.rand(3)
    torch.manual_seed(123)
    root = tmp_path / "ckpts"
    ckpt.save_checkpoint(
        root, 1, model=model, tokenizer=None, optimizer=opt, trainer_state={"version": 1}
    )
    ckpt.save_checkpoint(
        root,
        2,
        model=model,
        tokenizer=None,
        optimizer=opt,
        trainer_state={"version": 2, "data": {"epoch": 0, "batch_index": 2}},
        keep_last=1,
    )
    assert (root / "latest").read_text().strip() == "step_2"
    assert not (root / "step_1").exists()  # pruned
    assert not [p for p in root.iterdir() if p.name.startswith(".step_")]  # no temp folders
    # a half-written folder (no trainer state) is never picked
    (root / "step_9").mkdir()
    os.unlink(root / "latest")
    assert ckpt.latest_checkpoint(root).name == "step_2"

    fresh = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    torch.manual_seed(999)
    state = ckpt.restore_checkpoint(root / "step_2", model=fresh, optimizer=fresh_opt)
    assert state["step"] == 2 and state["data"]["batch_index"] == 2
    assert torch.equal(fresh.model.norm.weight, model.model.norm.weight)
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    assert torch.equal(torch.rand(3), expected_rand)  # RNG state restored


def test_metrics_plot_and_dumps(tmp_path):
    m = MetricsLogger(tmp_path, tensorboard=True)
    for step in (1, 2, 3):
        m.log(step, {"reward/mean": 0.1 * step, "reward/std": 0.05, "actor/loss": float("nan")})
    m.truncate_after(2)
    rows = m.read()
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["actor/loss"] is None  # NaN is written as null (valid JSON)
    m.close()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    png = plot_reward_curve(rows, tmp_path / "reward_curve.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_reward_curve([{"step": 1}], tmp_path / "none.png") is None
    files = dump_records(
        tmp_path / "rollout",
        [
            {"task_id": "a/b", "version": 3, "completion": "x"},
            {"task_id": "a/b", "version": 3, "completion": "y"},
            {"task_id": "c", "version": 4, "completion": "z"},
        ],
    )
    assert sorted(p.relative_to(tmp_path).as_posix() for p in files) == [
        "rollout/3/a_b.jsonl",
        "rollout/4/c.jsonl",
    ]
    lines = (tmp_path / "rollout/3/a_b.jsonl").read_text().splitlines()
    assert [json.loads(x)["completion"] for x in lines] == ["x", "y"]
