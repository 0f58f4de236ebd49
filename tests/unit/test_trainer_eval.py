"""Evaluation statistics and bookkeeping (no model): intervals, paired test, episode metrics."""

from __future__ import annotations

import json

import pytest

from areal_env.trainer.eval import (
    episode_metrics,
    paired_p_value,
    read_eval_log,
    resolve_checkpoint,
    truncate_eval_log,
    two_proportion_p_value,
    wilson_interval,
)


def test_wilson_interval_known_values():
    lo, hi = wilson_interval(8, 64)
    assert lo == pytest.approx(0.0647, abs=1e-3) and hi == pytest.approx(0.2276, abs=1e-3)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_paired_p_value_mcnemar():
    before = {f"t{i}": False for i in range(64)}
    after = dict(before)
    for i in range(15):  # 15 gained, 1 lost
        after[f"t{i}"] = True
    before["t63"] = True
    p = paired_p_value(before, after)
    # exact two-sided binomial: 2 * P(X <= 1 | n=16, 1/2) = 2 * 17 / 65536
    assert p == pytest.approx(2 * 17 / 2**16)
    assert paired_p_value(before, before) == 1.0
    assert paired_p_value({"a": True}, {"b": False}) == 1.0  # nothing shared


def test_two_proportion_p_value():
    assert two_proportion_p_value(10, 64, 30, 64) < 0.001
    assert two_proportion_p_value(10, 64, 11, 64) > 0.5


def _episode(task, reward, accepted=True, calls=(), valid=None, parse_error=False, turns=1):
    its = [
        {
            "num_output_tokens": 10,
            "num_prompt_tokens": 100,
            "tool_calls": list(calls) if i == 0 else [],
            "valid_tool_calls": (valid if valid is not None else len(calls)) if i == 0 else 0,
            "tool_parse_error": parse_error and i == 0,
        }
        for i in range(turns)
    ]
    return {"task_id": task, "reward": reward, "accepted": accepted, "interactions": its}


def test_episode_metrics_counts_rejections_as_failures():
    eps = [
        _episode("a", 1.0, calls=["add"], turns=2),
        _episode("b", 0.0, calls=["nope"], valid=0, turns=2),
        _episode("c", 1.0, accepted=False),  # rejected: a failure, whatever it returned
        _episode("d", 0.0, parse_error=True),
    ]
    m, outcomes, rewards = episode_metrics(eps, success_reward=1.0)
    assert outcomes == {"a": True, "b": False, "c": False, "d": False}
    assert m["success_rate"] == 0.25 and m["n"] == 4 and m["rejected"] == 1
    assert rewards["c"] == 0.0
    # calls: add (valid), nope (invalid), one parse error -> 1 of 3 attempts valid
    assert m["valid_tool_call_rate"] == pytest.approx(1 / 3)
    assert m["tool_call_episodes"] == 0.25
    assert m["turns_mean"] == pytest.approx(6 / 4)
    assert m["output_tokens_mean"] == pytest.approx(60 / 4)


def test_truncate_eval_log_and_checkpoint_resolution(tmp_path):
    (tmp_path / "eval.jsonl").write_text(
        "".join(json.dumps({"step": s, "version": s, "success_rate": 0.1}) + "\n" for s in (0, 4))
    )
    for v in (0, 4):
        (tmp_path / "eval-rollout" / str(v)).mkdir(parents=True)
    truncate_eval_log(tmp_path, 2)
    assert [e["step"] for e in read_eval_log(tmp_path)] == [0]
    assert not (tmp_path / "eval-rollout" / "4").exists()
    truncate_eval_log(tmp_path, -1)
    assert read_eval_log(tmp_path) == []

    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_checkpoint(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="neither"):
        resolve_checkpoint(tmp_path)
    step = tmp_path / "checkpoints" / "step_3"
    (step / "model").mkdir(parents=True)
    (step / "model" / "config.json").write_text("{}")
    (step / "trainer_state.json").write_text(json.dumps({"version": 3}))
    (tmp_path / "checkpoints" / "latest").write_text("step_3")
    folder, state = resolve_checkpoint(tmp_path)
    assert folder == step / "model" and state["version"] == 3


def test_reward_plot_draws_the_eval_curve_beside(tmp_path):
    from areal_env.trainer.stats import plot_reward_curve

    records = [{"step": s, "reward/mean": 0.1 * s, "reward/std": 0.05} for s in (1, 2, 3)]
    evals = [
        {
            "step": s,
            "success_rate": r,
            "success_ci_low": r - 0.1,
            "success_ci_high": r + 0.1,
            "n": 64,
        }
        for s, r in ((0, 0.2), (3, 0.45))
    ]
    alone = plot_reward_curve(records, tmp_path / "a.png")
    both = plot_reward_curve(records, tmp_path / "b.png", evals=evals)
    from PIL import Image

    assert Image.open(both).size[0] > Image.open(alone).size[0]  # a second panel
    assert plot_reward_curve([], tmp_path / "c.png", evals=evals) is not None
    assert plot_reward_curve([], tmp_path / "d.png") is None


def test_format_before_after_table():
    from areal_env.trainer.eval import EvalResult, format_before_after

    tasks = [f"t{i}" for i in range(64)]
    before_out = {t: i < 10 for i, t in enumerate(tasks)}
    after_out = {t: i < 30 for i, t in enumerate(tasks)}
    eps_b = [{"task_id": t, "accepted": True, "reward": float(before_out[t])} for t in tasks]
    eps_a = [{"task_id": t, "accepted": True, "reward": float(after_out[t])} for t in tasks]
    mb, ob, rb = episode_metrics(eps_b)
    ma, oa, ra = episode_metrics(eps_a)
    text = format_before_after(EvalResult(0, 0, mb, ob, rb), EvalResult(8, 8, ma, oa, ra))
    assert "15.6%" in text and "46.9%" in text and "+31.2 points" in text
    assert "20 problems gained, 0 lost" in text and "McNemar" in text


def test_extra_held_out_sets_are_reported_apart(tmp_path):
    from areal_env.trainer.eval import EvalResult, format_before_after, read_eval_summary

    def result(version, main_ok, new_ok):
        mb, ob, rb = episode_metrics(
            [{"task_id": f"v{i}", "accepted": True, "reward": float(ok)} for i, ok in main_ok]
        )
        me, oe, re_ = episode_metrics(
            [{"task_id": f"n{i}", "accepted": True, "reward": float(ok)} for i, ok in new_ok]
        )
        r = EvalResult(
            version, version, mb, ob, rb, {"new": EvalResult(version, version, me, oe, re_)}
        )
        return r

    before = result(0, [(i, i < 2) for i in range(10)], [(i, False) for i in range(8)])
    after = result(5, [(i, i < 8) for i in range(10)], [(i, i < 3) for i in range(8)])
    assert after.flat_metrics()["new/success_rate"] == 3 / 8
    assert after.flat_metrics()["success_rate"] == 0.8
    text = format_before_after(before, after)
    assert "+60.0 points" in text  # the held-out set
    assert "new (8 problems): 0.0% -> 37.5% (+37.5 points): 3 gained, 0 lost" in text
    # the summary round-trips with its extra sets
    folder = tmp_path / "eval-rollout" / "5"
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps(after.to_dict()))
    back = read_eval_summary(tmp_path, 5)
    assert back is not None and back.extra["new"].outcomes == after.extra["new"].outcomes
