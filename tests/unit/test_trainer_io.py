"""Data loading/position, atomic checkpoints, metrics/plot/dump files (no training loop)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from areal_env.api.config import ConfigError, RolloutConfig
from areal_env.api.episode import Episode
from areal_env.trainer import checkpoint as ckpt
from areal_env.trainer.data import DataLoader, SignalOrder, load_items, make_loader
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


def _kinds_items() -> list[dict]:
    """60 items of three kinds (a: 20, b: 30, c: 10) and one without a kind."""
    kinds = ["a"] * 20 + ["b"] * 30 + ["c"] * 10
    return [{"id": f"t{i}", "kind": k} for i, k in enumerate(kinds)] + [{"id": "none"}]


def _episodes(batch, reward_of):
    return [
        Episode(task_id=x["id"], accepted=True, score=reward_of(x, j))
        for x in batch
        for j in range(4)
    ]


def test_signal_order_draws_where_rewards_vary():
    """Nothing seen: shares follow the dataset's mix. Then the kind whose rewards vary gains
    per item over the always-failing and always-solved kinds, at first by little (a few
    failures prove little), and by ``1 / floor`` once their episodes add up; batches follow the
    shares (whole slots first) and each kind's items cycle."""
    items = _kinds_items()
    order = SignalOrder(items, "kind", seed=3, floor=0.25)
    assert order.names == ["(none)", "a", "b", "c"]
    assert order.weights() == pytest.approx([1 / 61, 20 / 61, 30 / 61, 10 / 61])
    loader = DataLoader(items, 8, seed=3, order=order)
    first = loader.next_batch()
    assert len(first) == 8 and len({x["id"] for x in first}) == 8
    # kind a: half solved; b: never; c and the kindless item: always
    outcome = {"a": lambda j: float(j % 2), "b": lambda j: 0.0, "c": lambda j: 1.0}

    def step() -> list[dict]:
        batch = loader.next_batch()
        loader.record(_episodes(batch, lambda x, j: outcome.get(x.get("kind"), lambda j: 1.0)(j)))
        return batch

    def per_item() -> dict[str, float]:
        w = dict(zip(order.names, order.weights(), strict=True))
        return {"a": w["a"] / 20, "b": w["b"] / 30, "c": w["c"] / 10}

    # one problem of kind a half solved, one of kind b failed 4 times: b's signal moves only
    # halfway down (prior of 4 episodes at the best signal); c, not seen, keeps the best
    probe = SignalOrder(items, "kind", seed=3, floor=0.25)
    probe.record([(0, 1.0), (0, 0.0), (0, 1.0), (0, 0.0)] + [(20, 0.0)] * 4)
    w = dict(zip(probe.names, probe.weights(), strict=True))
    assert w["b"] / 30 == pytest.approx(0.5 * w["a"] / 20)
    assert w["c"] / 10 == pytest.approx(w["a"] / 20)
    drawn_a: list[str] = []
    counts = {"a": 0, "b": 0, "c": 0, None: 0}
    for _ in range(20):
        for x in step():
            counts[x.get("kind")] += 1
            if x.get("kind") == "a":
                drawn_a.append(x["id"])
    late = per_item()
    assert late["a"] / late["b"] == pytest.approx(4.0)  # at the floor
    assert late["a"] / late["c"] == pytest.approx(4.0)
    share_a = dict(zip(order.names, order.weights(), strict=True))["a"]
    assert share_a == pytest.approx(20 / (20 + 0.25 * 41), rel=0.02)  # 0.66
    assert counts["a"] >= 20 * 8 * 0.55 and sum(counts.values()) == 160
    times = [drawn_a.count(f"t{i}") for i in range(20)]
    assert max(times) - min(times) <= 2  # kind a's items cycle: each about as often
    assert order.stats()["sampling/share/a"] == pytest.approx(share_a)


def test_signal_order_resumes_identically_and_rejects_other_groups():
    items = _kinds_items()

    def run(loader, batches):
        out = []
        for _ in range(batches):
            batch = loader.next_batch()
            out.append([x["id"] for x in batch])
            loader.record(_episodes(batch, lambda x, j: float(x["id"] < "t3" and j < 2)))
        return out

    def fresh():
        return DataLoader(items, 6, seed=9, order=SignalOrder(items, "kind", seed=9))

    whole = run(fresh(), 6)
    part = fresh()
    run(part, 3)
    state = json.loads(json.dumps(part.state_dict()))
    resumed = fresh()
    resumed.load_state_dict(state)
    assert run(resumed, 3) == whole[3:]
    other = DataLoader(items[:50], 6, seed=9, order=SignalOrder(items[:50], "kind", seed=9))
    with pytest.raises(ValueError, match="signal sampling groups differ"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="none of the 3 training items"):
        SignalOrder([{"q": 1}, {"q": 2}, {"q": 3}], "kind", seed=1)


def test_prompt_sampling_config_errors():
    with pytest.raises(ConfigError, match="needs rollout.signal_key"):
        RolloutConfig(prompt_sampling="signal").validate()
    with pytest.raises(ConfigError, match="valid: shuffle, signal"):
        RolloutConfig(prompt_sampling="hardest").validate()  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="signal_floor"):
        RolloutConfig(signal_floor=0.0).validate()
    loader = make_loader(
        _kinds_items(), RolloutConfig(prompt_sampling="signal", signal_key="kind"), seed=1
    )
    assert isinstance(loader.order, SignalOrder) and loader.order.floor == 0.25


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
