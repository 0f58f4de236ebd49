"""Train the planner and the writer (``config.yaml``) together on the calculator environment.

    .venv/bin/python examples/multi_agent/train.py            # 10 steps, ~30-40 min on 2 cores
    .venv/bin/python examples/multi_agent/train.py --steps 2  # a quick look

Starts the aenvironment server for ``examples/aenv/env_tools.py`` (as ``examples/aenv`` does),
trains both policies with ``PPOTrainer`` (held-out evaluation before, every 5 steps and after),
stops the server, then prints each policy's training reward (first and last steps) and held-out
success per evaluation. Extra ``key=value`` arguments override the config. The curves are in
the run folder's ``reward_curve.png`` (a line per policy in both panels).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "examples" / "aenv"))

from train_aenv import run  # noqa: E402  (examples/aenv/train_aenv.py: servers + PPOTrainer)

POLICIES = ("planner", "writer")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--config" or a.startswith("--config=") for a in args):
        args = ["--config", str(HERE / "config.yaml"), *args]
    args.append(f"workflow={HERE / 'agent.py'}:PlannerWriterAgent")
    metrics = run(args)
    report(Path(metrics["run_dir"]), metrics)
    return 0


def report(run_dir: Path, metrics: dict) -> None:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals_path = run_dir / "eval.jsonl"
    evals = (
        [json.loads(x) for x in evals_path.read_text().splitlines()] if evals_path.is_file() else []
    )
    print(f"\ndone in {metrics['wall_s'] / 60:.1f} min, {len(records)} steps; run folder {run_dir}")
    for name in POLICIES:
        key = f"policy/{name}/reward/mean"
        rewards = [r[key] for r in records if r.get(key) is not None]
        if rewards:
            k = max(1, min(3, len(rewards) // 2))
            print(
                f"  {name:8} training reward: first {k} steps {sum(rewards[:k]) / k:.3f} -> "
                f"last {k} steps {sum(rewards[-k:]) / k:.3f}  (per step: "
                + " ".join(f"{x:.2f}" for x in rewards)
                + ")"
            )
    if evals:
        print("  held-out success (greedy):")
        for e in evals:
            parts = [
                f"{name} {100 * e.get(f'policy/{name}/success_rate', 0.0):5.1f}%"
                for name in POLICIES
            ]
            team = 100 * e.get("team/success_rate", 0.0)
            print(f"    step {e['step']:>2}: " + ", ".join(parts) + f", team {team:5.1f}%")
    print(f"  curves: {run_dir / 'reward_curve.png'}")


if __name__ == "__main__":
    sys.exit(main())
