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
