"""``areal-env demo`` (``make demo``): the main job — a short RL run on the embedded default model.

SmolLM2-135M-Instruct on the CPU, the interception proxy, and a plain OpenAI SDK agent
(``examples/demo/agent.py:CapitalsAgent``) that asks for a country's capital and checks the reply
(1 = right city in at most three words, 0.5 = right city but wordy, 0 = wrong). Ten GRPO steps of
4 prompts × 8 samples; prints where the metrics, the reward plot, the trajectory dumps and the
checkpoint are, and the reward of the first vs the last steps.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from areal_env.api.config import ExperimentConfig, load_config

DEMO_DIR = Path(__file__).resolve().parent.parent / "examples" / "demo"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="areal-env demo", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: config)")
    ap.add_argument("--fileroot", default=None, help="output root (default: ./outputs)")
    ap.add_argument("--config", default=str(DEMO_DIR / "config.yaml"))
    ap.add_argument("overrides", nargs="*", help="dotted config overrides")
    args = ap.parse_args(argv)
    config = Path(args.config)
    if not config.is_file():
        print(
            f"areal-env demo: {config} not found; the demo runs from a source checkout "
            "(it needs examples/demo/)",
            file=sys.stderr,
        )
        return 2
    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"trainer.total_train_steps={args.steps}")
    if args.fileroot is not None:
        overrides.append(f"fileroot={args.fileroot}")
    cfg = load_config(ExperimentConfig, config, overrides)
    from areal_env.trainer.cli import resolve_paths
    from areal_env.trainer.ppo import PPOTrainer

    cfg = resolve_paths(cfg, config)
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
