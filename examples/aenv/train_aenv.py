"""Train ``areal_env.AenvAgent`` on the example calculator environment.

    .venv/bin/python examples/aenv/train_aenv.py --steps 2

Starts the aenvironment server(s) for ``env_tools.py`` on 127.0.0.N:8081, waits until they
answer, trains with ``PPOTrainer`` (embedded engine + interception proxy; the held-out split is
evaluated greedily before the first and after the last step) and stops the servers at exit, also
on Ctrl-C or errors; then prints the before/after table. Extra ``key=value`` arguments override
the config (``rollout.n_samples=8``, ``workflow_kwargs.max_turns=2``, ...).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from areal_env.api.config import ExperimentConfig
    from areal_env.trainer.eval import EvalResult

HERE = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(HERE / "config.yaml"), help="experiment YAML")
    p.add_argument(
        "--steps", type=int, default=None, help="training steps (trainer.total_train_steps)"
    )
    p.add_argument(
        "--servers",
        type=int,
        default=1,
        help="environment servers to start (the calculator is stateless: 1 serves all episodes)",
    )
    p.add_argument("--tools", default=str(HERE / "env_tools.py"), help="environment tools file")
    p.add_argument(
        "--fresh",
        action="store_true",
        help="do not resume from a checkpoint of an earlier run (trainer.recover=off)",
    )
    p.add_argument(
        "--metrics-out",
        default=None,
        help="also write the final metrics to this JSON file (bench/learning.py reads it)",
    )
    p.add_argument("overrides", nargs="*", help="dotted config overrides, key=value")
    return p.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    metrics = run(argv)
    report(metrics)
    out = parse_args(argv).metrics_out
    if out:
        plain = {k: v for k, v in metrics.items() if isinstance(v, str | int | float | bool)}
        Path(out).write_text(json.dumps(plain), encoding="utf-8")
    return 0


def run(argv: list[str] | None = None) -> dict:
    """Start the servers, train (evaluating on the held-out split before and after), return the
    trainer's final metrics plus ``wall_s``."""
    args = parse_args(argv)
    from areal_env.api.config import ExperimentConfig, load_config
    from areal_env.envs.aenv.launcher import AenvServerLauncher
    from areal_env.trainer.ppo import PPOTrainer

    overrides = list(args.overrides)
    if args.steps is not None:
        overrides.append(f"trainer.total_train_steps={args.steps}")
    if args.fresh:
        overrides.append("trainer.recover=off")
    cfg = load_config(ExperimentConfig, args.config, overrides)  # paths: relative to the file
    from areal_env.http.logs import configure_run_logging

    # Progress (steps, evaluations) and warnings on the console; every other line (HTTP
    # requests, MCP reconnects, expired idle sessions) in the run's log file.
    log_file = configure_run_logging(
        cfg.run_dir / "logs" / "train.log", quiet=("mcp", "aenv", "uvicorn.access")
    )
    log = logging.getLogger("train_aenv")
    log.info("log file (everything, at INFO): %s", log_file)

    t0 = time.monotonic()
    from areal_env.engine.models import resolve_model_path

    # A fresh clone converts the default model once (tens of seconds): set-up, not training.
    model_dir = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    log.info("model: %s (%.0f s)", model_dir, time.monotonic() - t0)
    # The servers run from the aenvironment SDK in a venv of its own (.venv-aenv, created on
    # first use; aenv_config.server_python or $AREAL_ENV_AENV_PYTHON choose another).
    server_python = (cfg.workflow_kwargs.get("aenv_config") or {}).get("server_python")
    with AenvServerLauncher(
        args.tools,
        num_servers=args.servers,
        log_dir=cfg.run_dir / "aenv-logs",
        python=server_python,
    ) as servers:
        kwargs = dict(cfg.workflow_kwargs)
        aenv_config = dict(kwargs.get("aenv_config") or {})
        aenv_config["aenv_url"] = servers.urls[0]
        kwargs["aenv_config"] = aenv_config
        if len(servers.urls) > 1:
            kwargs["aenv_urls"] = servers.urls
        log.info("environment servers: %s", ", ".join(servers.urls))
        with PPOTrainer(cfg) as trainer:
            setup_s = time.monotonic() - t0
            log.info("set up in %.0f s (model files, environment servers)", setup_s)
            metrics = trainer.train(workflow_kwargs=kwargs)
    metrics["wall_s"] = time.monotonic() - t0
    metrics["setup_s"] = setup_s
    metrics["log_file"] = str(log_file)
    metrics["calls_per_task"] = calls_per_task(cfg)
    return metrics


def calls_per_task(cfg: ExperimentConfig) -> dict[str, int]:
    """``task_id -> calls`` (how many tool calls the solution takes) of every held-out item."""
    from areal_env.trainer.data import load_items

    paths = [p for p in (cfg.valid_dataset, *cfg.extra_valid_datasets.values()) if p]
    return {
        str(item.get("task_id")): int(item.get("calls", 1))
        for path in paths
        for item in load_items(str(path))
    }


def multi_call_line(before: EvalResult, after: EvalResult, calls: dict[str, int]) -> str | None:
    """How many of each held-out set's problems of two or more calls were solved before and
    after training (None when no set has any)."""
    parts = []
    sets = [("held-out", before, after)]
    sets += [
        (name, r, after.extra[name]) for name, r in before.extra.items() if name in after.extra
    ]
    for name, b, a in sets:
        multi = [t for t in a.outcomes if calls.get(t, 1) >= 2 and t in b.outcomes]
        if multi:
            solved_b = sum(b.outcomes[t] for t in multi)
            solved_a = sum(a.outcomes[t] for t in multi)
            parts.append(f"{name} {solved_b}/{len(multi)} -> {solved_a}/{len(multi)}")
    return "problems of two or three calls solved: " + ", ".join(parts) if parts else None


def report(metrics: dict) -> None:
    """Print where everything is and, with a held-out split, the before/after table."""
    from areal_env.trainer.eval import format_before_after, read_eval_log, read_eval_summary

    run_dir = metrics.get("run_dir")
    evals = read_eval_log(run_dir) if run_dir else []
    eval_s = sum(float(e.get("time_s") or 0.0) for e in evals)
    setup_s = float(metrics.get("setup_s") or 0.0)
    train_s = max(0.0, metrics["wall_s"] - setup_s - eval_s)
    print(
        f"\ndone in {metrics['wall_s'] / 60:.1f} min ({metrics.get('step')} steps): set-up "
        f"{setup_s / 60:.1f} min, training {train_s / 60:.1f} min, evaluation "
        f"{eval_s / 60:.1f} min; run folder: {run_dir}"
    )
    first, last = metrics.get("reward/first_steps_mean"), metrics.get("reward/last_steps_mean")
    if first is not None and last is not None:
        print(f"  training reward: first steps {first:.3f} -> last steps {last:.3f}")
    if len(evals) >= 2:
        before = read_eval_summary(run_dir, int(evals[0]["version"]))
        after = read_eval_summary(run_dir, int(evals[-1]["version"]))
        if before is not None and after is not None:
            print()
            print(format_before_after(before, after))
            line = multi_call_line(before, after, metrics.get("calls_per_task") or {})
            if line:
                print(line)
            print()
    for label, key in (
        ("metrics (one JSON line per step)", "metrics_file"),
        ("reward and eval curves", "reward_plot"),
        ("trajectory dumps", "dump_dir"),
        ("eval dumps", "eval_dir"),
        ("checkpoint", "checkpoint"),
        ("log file", "log_file"),
    ):
        if metrics.get(key):
            print(f"  {label + ':':<34}{metrics[key]}")


if __name__ == "__main__":
    sys.exit(main())
