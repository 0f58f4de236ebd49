"""``areal-env demo`` (``make demo``): the main job — a short RL run on the embedded default model.

By default it trains ``areal_env.AenvAgent`` on the example AEnvironment calculator
(``examples/aenv``): the demo starts the aenvironment server, SmolLM2-135M-Instruct runs on the
CPU behind the interception proxy, the agent solves arithmetic word problems that mix the four
operations and need one to three calls of the environment's ``add``/``subtract``/``multiply``/
``divide`` tools, and the environment's reward function pays only for a right final answer.
``--recipe`` picks the training recipe (``chains``, the default, or ``one-call``; ``RECIPES``).
The held-out problems, and as many in phrasings the training templates never use, are evaluated
greedily before and after training; the demo prints the before/after table (success, valid tool
calls, mean turns) with the paired p-value and draws the eval curve beside the reward curve.
``--example capitals`` runs the plain-OpenAI-SDK capitals agent (``examples/demo``) instead.
Each run is a new trial (``demo-<timestamp>``) and prints where its metrics, reward plot,
trajectory dumps and checkpoint are.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

from areal_env.api.config import ExperimentConfig, load_config

ROOT = Path(__file__).resolve().parent.parent
DEMO_DIR = ROOT / "examples" / "demo"
AENV_DIR = ROOT / "examples" / "aenv"


def _trial_name() -> str:
    return "demo-" + time.strftime("%Y%m%d-%H%M%S")


RECIPES = {"chains": AENV_DIR / "config_chains.yaml", "one-call": AENV_DIR / "config.yaml"}
"""``--recipe``: the calculator demo's training recipes (docs/training.md, "The demo").
``chains`` (the default) answers through a tool, imitates one guided episode per group and
learns the two- and three-call problems too; ``one-call`` learns which tool a word problem needs
and a plain answer after it, in about two thirds of the time."""


def aenv_argv(
    recipe: str, steps: int | None, fileroot: str | None, overrides: list[str]
) -> list[str]:
    """The arguments of ``examples/aenv/train_aenv.py`` for one demo run."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
    argv = ["--config", str(RECIPES[recipe]), f"trial_name={_trial_name()}", *overrides]
    if steps is not None:
        argv = ["--steps", str(steps), *argv]
    if fileroot is not None:
        argv.append(f"fileroot={fileroot}")
    return argv


def _run_aenv_example(
    recipe: str, steps: int | None, fileroot: str | None, overrides: list[str]
) -> int:
    """Load ``examples/aenv/train_aenv.py`` by path (examples are not a package) and run it."""
    script = AENV_DIR / "train_aenv.py"
    if not script.is_file():
        print(
            f"areal-env demo: {script} not found; the demo runs from a source checkout",
            file=sys.stderr,
        )
        return 2
    spec = importlib.util.spec_from_file_location("areal_env_demo_train_aenv", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return int(module.main(aenv_argv(recipe, steps, fileroot, overrides)) or 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="areal-env demo", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--example",
        choices=("aenv", "capitals"),
        default="aenv",
        help="aenv: AenvAgent on the calculator environment (default); capitals: OpenAI SDK agent",
    )
    ap.add_argument(
        "--recipe",
        choices=tuple(RECIPES),
        default="chains",
        help="--example aenv: chains (default; examples/aenv/config_chains.yaml: learns two- "
        "and three-call problems too) or one-call (config.yaml: one call, then a plain "
        "answer; about two thirds of the time)",
    )
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: config)")
    ap.add_argument("--fileroot", default=None, help="output root (default: ./outputs)")
    ap.add_argument(
        "--config", default=str(DEMO_DIR / "config.yaml"), help="config of --example capitals"
    )
    ap.add_argument("overrides", nargs="*", help="dotted config overrides")
    args = ap.parse_args(argv)
    if args.example == "aenv":
        return _run_aenv_example(args.recipe, args.steps, args.fileroot, list(args.overrides))
    config = Path(args.config)
    if not config.is_file():
        print(
            f"areal-env demo: {config} not found; the demo runs from a source checkout "
            "(it needs examples/demo/)",
            file=sys.stderr,
        )
        return 2
    overrides = [f"trial_name={_trial_name()}", *args.overrides]
    if args.steps is not None:
        overrides.append(f"trainer.total_train_steps={args.steps}")
    if args.fileroot is not None:
        overrides.append(f"fileroot={args.fileroot}")
    cfg = load_config(ExperimentConfig, config, overrides)
    from areal_env.trainer.ppo import PPOTrainer

    t0 = time.monotonic()
    print(
        f"areal-env demo: {cfg.trainer.total_train_steps} GRPO steps of "
        f"{cfg.rollout.batch_size} prompts x {cfg.rollout.n_samples} samples on {cfg.model.path} "
        f"(agent {cfg.workflow})",
        flush=True,
    )
    with PPOTrainer(cfg, cfg.train_dataset) as trainer:
        final = trainer.train()
    minutes = (time.monotonic() - t0) / 60
    first = final.get("reward/first_steps_mean")
    last = final.get("reward/last_steps_mean")
    print()
    print(f"demo finished in {minutes:.1f} min ({final.get('step')} steps)")
    if first is not None and last is not None:
        print(f"  reward: first steps {first:.3f} -> last steps {last:.3f}")
    print(f"  metrics (one JSON line per step): {final['metrics_file']}")
    if cfg.trainer.tensorboard:
        print(
            f"  TensorBoard:                      tensorboard --logdir {final['run_dir']}/tensorboard"
        )
    print(f"  reward curve:                     {final['reward_plot']}")
    print(f"  trajectory dumps:                 {final['dump_dir']}/<version>/<task_id>.jsonl")
    print(f"  checkpoint:                       {final['checkpoint']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
