"""Does the main job prove a better agent? Runs what ``make demo`` runs and measures it.

    .venv/bin/python bench/learning.py [--steps N] [key=value ...]

Trains ``AenvAgent`` on the example AEnvironment task (``examples/aenv``: real aenvironment
server, embedded SmolLM2-135M, interception proxy) exactly as ``make demo`` does, in a fresh trial
under a temporary folder. The trainer evaluates the held-out split greedily before the first and
after the last step; the baseline (``heldout_before``) is the untrained model measured in the
same run. ``p_value`` is the exact McNemar test of the paired per-problem outcomes.

Last line: ``{"heldout_before", "heldout_after", "p_value", "wall_s", "n_heldout", ...}``.
Targets (issue 16, 2-core CPU): after - before >= 0.20, p < 0.01, wall_s <= 900.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "aenv" / "train_aenv.py"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: config)")
    ap.add_argument("--fileroot", default=None, help="output root (default: a temporary folder)")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides")
    args = ap.parse_intermixed_args(argv)

    from areal_env.trainer.eval import compare_evaluations, read_eval_log, read_eval_summary

    spec = importlib.util.spec_from_file_location("bench_train_aenv", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with tempfile.TemporaryDirectory(prefix="areal-env-learning-") as tmp:
        fileroot = args.fileroot or tmp
        argv_run = [
            "--fresh",
            f"fileroot={fileroot}",
            f"trial_name=learning-{time.strftime('%Y%m%d-%H%M%S')}",
            "trainer.progress=false",
            *args.overrides,
        ]
        if args.steps is not None:
            argv_run = ["--steps", str(args.steps), *argv_run]
        t0 = time.monotonic()
        metrics = module.run(argv_run)
        wall = time.monotonic() - t0
        module.report(metrics)
        run_dir = metrics["run_dir"]
        evals = read_eval_log(run_dir)
        if len(evals) < 2:
            print("no before/after evaluation: is valid_dataset set?", file=sys.stderr)
            return 1
        before = read_eval_summary(run_dir, int(evals[0]["version"]))
        after = read_eval_summary(run_dir, int(evals[-1]["version"]))
        assert before is not None and after is not None
        cmp = compare_evaluations(before, after)
        steps = [e for e in _read_metrics(Path(run_dir) / "metrics.jsonl")]
        out = {
            "heldout_before": cmp["success_before"],
            "heldout_after": cmp["success_after"],
            "p_value": cmp["p_value"],
            "wall_s": round(wall, 1),
            "n_heldout": int(cmp["n"]),
            "gained": int(cmp["gained"]),
            "lost": int(cmp["lost"]),
            "steps": metrics.get("step"),
            "train_reward_per_step": [round(s.get("reward/mean", 0.0), 3) for s in steps],
            "zero_variance_groups_per_step": [int(s.get("groups/zero_variance", 0)) for s in steps],
            "eval_s": [round(e.get("time_s", 0.0), 1) for e in evals],
            "step_s": [round(s.get("time/step_s", 0.0), 1) for s in steps],
            "peak_rss_gb_per_step": [round(s.get("mem/peak_rss_gb", 0.0), 2) for s in steps],
            "peak_rss_gb": round(max((s.get("mem/peak_rss_gb", 0.0) for s in steps), default=0), 2),
        }
    print(json.dumps(out))
    return 0


def _read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


if __name__ == "__main__":
    sys.exit(main())
