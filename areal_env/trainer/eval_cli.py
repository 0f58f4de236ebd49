"""``areal-env eval CONFIG.yaml [--checkpoint DIR] [key=value ...]``: held-out evaluation.

Evaluates a checkpoint (a ``checkpoints/step_N`` folder, a run folder, or any HF model folder)
or, without ``--checkpoint``, the config's base model, greedily on ``valid_dataset`` (or
``--dataset``), with the config's agent, and prints success rate (95% CI), mean reward, valid
tool-call rate, mean turns and tokens. ``--env-tools FILE`` starts aenvironment servers for that
tools file first (as ``examples/aenv`` needs) and points ``workflow_kwargs.aenv_config`` at them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys

from areal_env.api.cli_args import experiment_parser, fail, load_experiment


def main(argv: list[str] | None = None) -> int:
    prog = "areal-env eval"
    ap = experiment_parser(
        prog, __doc__.splitlines()[0], overrides_help="dotted overrides, e.g. model.num_threads=1"
    )
    ap.add_argument("--checkpoint", default=None, help="checkpoint/run/HF folder (default: base)")
    ap.add_argument("--dataset", default=None, help="JSONL to evaluate on (default: valid_dataset)")
    ap.add_argument("--limit", type=int, default=None, help="evaluate only the first N items")
    ap.add_argument("--out", default=None, help="output folder (default: run_dir/eval-<label>)")
    ap.add_argument("--env-tools", default=None, help="start aenvironment servers for this file")
    ap.add_argument("--json", action="store_true", help="print the metrics as one JSON line too")
    args = ap.parse_intermixed_args(argv)
    cfg = load_experiment(prog, args)
    if cfg is None:
        return 2
    from areal_env.http.logs import configure_run_logging
    from areal_env.trainer.data import load_items
    from areal_env.trainer.eval import arun_evaluation, format_result

    # Results and warnings on the console; HTTP, MCP client and session lines in the log file.
    log_file = configure_run_logging(
        cfg.run_dir / "logs" / "eval.log", quiet=("mcp", "aenv", "uvicorn.access")
    )

    dataset = args.dataset or cfg.valid_dataset
    if not dataset:
        return fail(prog, "no held-out data: set valid_dataset in the config or pass --dataset")
    items = list(load_items(dataset))[: args.limit]
    kwargs = dict(cfg.workflow_kwargs)
    with contextlib.ExitStack() as stack:
        if args.env_tools:
            from areal_env.envs.aenv.launcher import AenvServerLauncher

            servers = stack.enter_context(
                AenvServerLauncher(args.env_tools, log_dir=cfg.run_dir / "aenv-logs")
            )
            aenv = dict(kwargs.get("aenv_config") or {})
            aenv["aenv_url"] = servers.urls[0]
            kwargs["aenv_config"] = aenv
        try:
            result = asyncio.run(
                arun_evaluation(
                    cfg,
                    items,
                    checkpoint=args.checkpoint,
                    workflow_kwargs=kwargs,
                    out_dir=args.out,
                )
            )
        except FileNotFoundError as e:
            return fail(prog, str(e))
    out = args.out or "run_dir"
    print(format_result(result, args.out))
    print(f"log file: {log_file}")
    if args.json:
        print(json.dumps({"version": result.version, **result.metrics, "out": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
