"""``areal-env train CONFIG.yaml [section.key=value ...]``: a training run from a YAML config.

The dataset is ``train_dataset`` (a JSONL path) and the agent/workflow is ``workflow`` (an import
string ``pkg.mod:Attr`` or a file path ``path/to/agent.py:Attr``) with ``workflow_kwargs``.
Relative paths in the config file are relative to its folder (``api.config_load``).
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from areal_env.api.cli_args import experiment_parser, fail, load_experiment

logger = logging.getLogger(__name__)


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
    cfg = load_experiment(prog, args)
    if cfg is None:
        return 2
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
