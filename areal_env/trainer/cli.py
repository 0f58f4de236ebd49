"""``areal-env train CONFIG.yaml [section.key=value ...]``: a training run from a YAML config.

The dataset is ``train_dataset`` (a JSONL path) and the agent/workflow is ``workflow`` (an import
string ``pkg.mod:Attr`` or a file path ``path/to/agent.py:Attr``) with ``workflow_kwargs``.
Relative paths are tried against the working directory first, then the config file's folder.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any

from areal_env.api.cli_args import experiment_parser, fail, load_experiment
from areal_env.api.config import ExperimentConfig

logger = logging.getLogger(__name__)


def _relocate(value: str | None, base: Path) -> str | None:
    """``value`` if it exists relative to the CWD, else relative to ``base`` if it exists there."""
    if not value or Path(value).exists() or Path(value).is_absolute():
        return value
    cand = base / value
    return str(cand) if cand.exists() else value


def _relocate_workflow(spec: str | None, base: Path) -> str | None:
    if not spec or ".py:" not in spec:
        return spec
    path, attr = spec.rsplit(":", 1)
    return f"{_relocate(path, base)}:{attr}"


def resolve_paths(cfg: ExperimentConfig, config_path: Path) -> ExperimentConfig:
    base = config_path.resolve().parent
    return dataclasses.replace(
        cfg,
        train_dataset=_relocate(cfg.train_dataset, base),
        valid_dataset=_relocate(cfg.valid_dataset, base),
        workflow=_relocate_workflow(cfg.workflow, base),
    )


def summarize(final: dict[str, Any]) -> str:
    keys = [
        "step",
        "reward/first_steps_mean",
        "reward/last_steps_mean",
        "run_dir",
        "metrics_file",
        "reward_plot",
        "dump_dir",
        "checkpoint",
    ]
    return json.dumps({k: final.get(k) for k in keys if k in final}, indent=2)


def main(argv: list[str] | None = None) -> int:
    prog = "areal-env train"
    ap = experiment_parser(
        prog, "Train a model with PPO/GRPO on an agent workflow, from a YAML config."
    )
    args = ap.parse_args(argv)
    loaded = load_experiment(prog, args)
    if loaded is None:
        return 2
    cfg = resolve_paths(loaded, Path(args.config))
    if not cfg.train_dataset:
        return fail(prog, "set train_dataset (a JSONL path) in the config")
    if not cfg.workflow:
        return fail(prog, "set workflow (the agent to train) in the config")
    from areal_env.trainer.ppo import PPOTrainer

    with PPOTrainer(cfg, cfg.train_dataset, cfg.valid_dataset) as trainer:
        final = trainer.train()
    if trainer.dist.is_main:  # under torchrun the other ranks only train
        print(summarize(final))
    return 0


if __name__ == "__main__":
    sys.exit(main())
