"""``areal-env demo --recipe``: each recipe runs train_aenv.py with its own committed config."""

from __future__ import annotations

import importlib.util

import pytest

from areal_env import demo
from areal_env.api.config import ExperimentConfig, load_config


def _train_aenv():
    spec = importlib.util.spec_from_file_location(
        "test_demo_train_aenv", demo.AENV_DIR / "train_aenv.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("recipe", "answer_tool", "train_file"),
    [("one-call", None, "train.jsonl"), ("chains", "answer", "train_chains.jsonl")],
)
def test_each_recipe_runs_its_config(recipe, answer_tool, train_file, tmp_path):
    argv = demo.aenv_argv(recipe, 3, str(tmp_path), ["rollout.n_samples=2"])
    args = _train_aenv().parse_args(argv)
    assert args.steps == 3
    cfg = load_config(ExperimentConfig, args.config, args.overrides)
    assert cfg.workflow_kwargs.get("answer_tool") == answer_tool
    assert cfg.train_dataset.endswith(train_file)
    assert cfg.rollout.n_samples == 2  # the user's overrides still apply
    assert cfg.fileroot == str(tmp_path)
    assert cfg.trial_name.startswith("demo-")


def test_an_unknown_recipe_is_refused():
    with pytest.raises(ValueError, match="chains, one-call"):
        demo.aenv_argv("deep", None, None, [])
    with pytest.raises(SystemExit):
        demo.main(["--recipe", "deep"])


def test_the_report_counts_multi_call_problems_per_set():
    from areal_env.trainer.eval import EvalResult

    calls = {"valid-0": 1, "valid-1": 2, "valid-2": 3, "new-0": 2, "new-1": 1}

    def result(held: dict[str, bool], new: dict[str, bool]) -> EvalResult:
        extra = {"new_phrasing": EvalResult(0, 0, {}, outcomes=new)}
        return EvalResult(0, 0, {}, outcomes=held, extra=extra)

    before = result(
        {"valid-0": True, "valid-1": False, "valid-2": False}, {"new-0": False, "new-1": True}
    )
    after = result(
        {"valid-0": True, "valid-1": True, "valid-2": False}, {"new-0": True, "new-1": True}
    )
    line = _train_aenv().multi_call_line(before, after, calls)
    assert line == (
        "problems of two or three calls solved: held-out 0/2 -> 1/2, new_phrasing 0/1 -> 1/1"
    )
    assert _train_aenv().multi_call_line(before, after, {}) is None


def test_calls_per_task_covers_every_held_out_set():
    cfg = load_config(ExperimentConfig, demo.RECIPES["chains"], [])
    calls = _train_aenv().calls_per_task(cfg)
    assert len(calls) == 128  # 64 held-out problems and 64 new phrasings
    assert sum(n >= 2 for n in calls.values()) == 35  # 18 + 17 of two or three calls
