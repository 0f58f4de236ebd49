"""Scale-out figures, all measured in one run on this machine's model (default SmolLM2-135M).

- ``mem_per_rank_2_vs_1``: bytes one rank holds for parameters + gradients + AdamW states with
  FSDP2 over 2 torchrun ranks (gloo), divided by the same bytes in one process (target <= 0.6);
- ``step_s_2_vs_1``: the AdamW update's wall time at 2 ranks / 1 process, same batch (on a
  2-core CPU the ranks share the cores, so this says nothing about GPU speed-up);
- ``fsdp_equal``: after an SGD step and an AdamW step, every weight of the 2-rank run is within
  1e-5 of the 1-process run, with the same loss and gradient norm;
- ``lora_push_bytes_vs_full``: bytes of a LoRA (r=8, attention projections) weight push (the
  adapter folder) / bytes of a full push (the HF folder) (target <= 0.05);
- ``lora_step_s_vs_full``: LoRA update time / full update time, same batch;
- ``weight_sync_s``: seconds for two running ``areal-env serve`` servers to load a full push
  (one folder written once, every server loads it: ``SGLangEngine.update_weights``);
  ``lora_sync_s``: the same for the adapter folder.

The workers are ``tests/distributed/step_worker.py`` (the same code the tests run).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from areal_env.engine.models import DEFAULT_MODEL, resolve_model_path  # noqa: E402
from tests.distributed.run import run_worker  # noqa: E402

logger = logging.getLogger("bench.scale")


def _max_diff(a_path: Path, b_path: Path) -> float:
    from safetensors.torch import load_file

    a, b = load_file(str(a_path)), load_file(str(b_path))
    if set(a) != set(b):
        return float("inf")
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _sync_time(model_path: str, folders: list[Path], tmp: Path) -> list[float]:
    """Seconds for 2 ``areal-env serve`` servers to load each folder (one push each)."""
    from areal_env.engine.launcher import launch_servers
    from areal_env.engine.sglang import SGLangEngine

    group = launch_servers(
        model_path,
        num_servers=2,
        base_port=0,
        command=[sys.executable, "-m", "areal_env.cli", "serve"],
        extra_args=["--num-threads", "1", "--log-level", "warning"],
        log_dir=tmp / "serve-logs",
        startup_timeout=300,
    )
    try:
        eng = SGLangEngine(group.addresses)
        eng.initialize()
        out = []
        for f in folders:
            t0 = time.perf_counter()
            eng.update_weights(str(f))
            out.append(time.perf_counter() - t0)
        eng.destroy()
        return out
    finally:
        group.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model = str(resolve_model_path(args.model))
    tmp = Path(tempfile.mkdtemp(prefix="areal-scale-bench-"))
    try:
        common = ["--model", model, "--steps", "sgd,adamw"]
        logger.info("1 process (strategy single) ...")
        (single,) = run_worker(
            [
                *common,
                "--strategy",
                "single",
                "--out",
                str(tmp / "s"),
                "--push-dir",
                str(tmp / "full"),
            ]
        )
        logger.info("2 torchrun ranks (strategy fsdp, gloo) ...")
        ranks = run_worker([*common, "--strategy", "fsdp", "--out", str(tmp / "f")], nproc=2)
        logger.info("LoRA, 1 process ...")
        (lora,) = run_worker(
            [
                "--model",
                model,
                "--steps",
                "adamw,adamw",
                "--strategy",
                "single",
                "--lora",
                "--push-dir",
                str(tmp / "adapter"),
            ]
        )
        diffs = [
            _max_diff(tmp / "s" / f"{i}_{n}.st", tmp / "f" / f"{i}_{n}.st")
            for i, n in enumerate(["sgd", "adamw"])
        ]
        same_stats = all(
            abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * abs(a["grad_norm"])
            for a, b in zip(single["steps"], ranks[0]["steps"], strict=True)
        )
        logger.info("weight sync to 2 areal-env serve servers ...")
        full_s, lora_s = _sync_time(model, [tmp / "full", tmp / "adapter"], tmp)
        # AdamW step of the full run vs the second (warm) AdamW step of the LoRA run
        full_step = single["steps"][1]["step_s"]
        lora_step = lora["steps"][1]["step_s"]
        fsdp_step = max(r["steps"][1]["step_s"] for r in ranks)
        result = {
            "mem_per_rank_2_vs_1": round(
                max(r["state_bytes"] for r in ranks) / single["state_bytes"], 4
            ),
            "step_s_2_vs_1": round(fsdp_step / full_step, 3),
            "fsdp_equal": bool(max(diffs) < 1e-5 and same_stats),
            "lora_push_bytes_vs_full": round(lora["push_bytes"] / single["push_bytes"], 5),
            "lora_step_s_vs_full": round(lora_step / full_step, 3),
            "weight_sync_s": round(full_s, 3),
            "lora_sync_s": round(lora_s, 3),
            "fsdp_max_abs_diff": max(diffs),
            "state_bytes_1": single["state_bytes"],
            "state_bytes_per_rank_2": [r["state_bytes"] for r in ranks],
            "full_push_bytes": single["push_bytes"],
            "lora_push_bytes": lora["push_bytes"],
            "step_s_1": round(full_step, 3),
            "step_s_2": round(fsdp_step, 3),
            "lora_step_s": round(lora_step, 3),
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
