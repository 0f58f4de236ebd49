"""How many evaluation episodes the embedded engine should decode together.

    .venv/bin/python bench/eval_batch.py [--batches 32,64] [--rounds 2] [--limit N]

``make demo`` evaluates the untrained model and the trained one greedily on its held-out sets
(64 problems each, four turns for the untrained model). Each evaluation is one
``areal-env eval examples/aenv/config_chains.yaml`` in a process of its own, with
``rollout.max_concurrent_rollouts`` and ``engine.max_batch_size`` set to each batch size of
``--batches`` in turn (alternating order from round to round, so that a change of machine speed
hits every side), ``--rounds`` times. Training is not run: its rollouts put
``rollout.batch_size`` x ``rollout.n_samples`` episodes in flight whatever the limit.

Per batch size: the median evaluation time (the evaluation's own ``time_s``), the process's peak
resident memory, and its metrics (success rate, valid tool calls, output tokens), which must
agree between the sizes for greedy decoding (``same_metrics``). Last line, one JSON object:
``{"<B>_vs_<first>": speed-up of batch B against the first size, "eval_s": {...},
"peak_rss_gb": {...}, "same_metrics": true, ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "aenv" / "config_chains.yaml"
ENV_TOOLS = ROOT / "examples" / "aenv" / "env_tools.py"
COMPARED = ("success_rate", "valid_tool_call_rate", "turns_mean", "output_tokens_mean")


def evaluate(batch: int, out: Path, limit: int | None) -> tuple[dict, float]:
    """One ``areal-env eval`` at ``batch`` episodes in flight: its metrics and the peak resident
    memory (GB) of the process and the children it waited for."""
    cmd = [
        sys.executable,
        "-m",
        "areal_env.cli",
        "eval",
        str(CONFIG),
        "--env-tools",
        str(ENV_TOOLS),
        "--out",
        str(out),
        "--json",
        f"rollout.max_concurrent_rollouts={batch}",
        f"engine.max_batch_size={batch}",
    ]
    if limit:
        cmd += ["--limit", str(limit)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    log = out.with_suffix(".stdout")
    out.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as sink:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.DEVNULL, text=True
        )
        # wait4, not wait: the rusage of this child (and the children it waited for) alone
        _, status, usage = os.wait4(proc.pid, 0)
    stdout = log.read_text()
    code = os.waitstatus_to_exitcode(status)
    if code:
        raise SystemExit(f"areal-env eval at batch {batch} failed ({code}):\n{stdout[-2000:]}")
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise SystemExit(f"areal-env eval at batch {batch} printed no JSON line:\n{stdout[-2000:]}")
    return json.loads(lines[-1]), usage.ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="32,64", help="batch sizes, the first is the baseline")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--limit", type=int, default=None, help="evaluate the first N problems only")
    args = ap.parse_args(argv)
    sizes = [int(b) for b in args.batches.split(",")]
    times: dict[int, list[float]] = {b: [] for b in sizes}
    peaks: dict[int, list[float]] = {b: [] for b in sizes}
    metrics: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix="areal-env-eval-batch-") as tmp:
        for r in range(args.rounds):
            for b in sizes if r % 2 == 0 else sizes[::-1]:
                result, peak = evaluate(b, Path(tmp) / f"b{b}-r{r}", args.limit)
                times[b].append(float(result["time_s"]))
                peaks[b].append(peak)
                metrics[b] = {k: result.get(k) for k in COMPARED}
                print(
                    f"round {r + 1} batch {b}: {result['time_s']:.1f} s, peak {peak:.2f} GB, "
                    f"{metrics[b]}",
                    file=sys.stderr,
                )
    med = {b: statistics.median(t) for b, t in times.items()}
    base = sizes[0]
    summary: dict = {f"{b}_vs_{base}": round(med[base] / med[b], 3) for b in sizes[1:]}
    summary["eval_s"] = {str(b): round(med[b], 1) for b in sizes}
    summary["peak_rss_gb"] = {str(b): round(max(peaks[b]), 2) for b in sizes}
    summary["same_metrics"] = all(metrics[b] == metrics[base] for b in sizes)
    summary["metrics"] = {str(b): metrics[b] for b in sizes}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
