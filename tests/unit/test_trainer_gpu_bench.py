"""``bench/gpu_train_step.py --device cpu`` (issue 24): the GPU bench's whole path on a tiny model.

Holds what is not a timing: with bf16 compute over fp32 master weights an lr 1e-6 update moves
>= 95 % of the weights for both strategies, the pure-bf16 opt-in moves almost none, the tree path
computes fewer tokens than the flat one, TRL's step ran on the same batch in the same precision,
and the profile names the update's phases. The GPU figures come from the same script on a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_train_step_bench_on_the_cpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'client'}"}
    cmd = [
        sys.executable,
        str(ROOT / "bench" / "gpu_train_step.py"),
        "--device=cpu",
        "--dtype=bfloat16",
        "--iters=1",
        "--problems=2",
        "--samples=4",
        "--system-len=100",
        "--strategies=single,fsdp,lossy",
        "--profile",
        f"--profile-dir={tmp_path / 'profile'}",
        f"--work-dir={tmp_path / 'models'}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["device"] == "cpu" and out["compute_dtype"] == "bfloat16"
    assert out["rows"] == 8 and out["params"] > 1e6
    res = out["results"]
    for strategy in ("single", "fsdp"):
        assert res[strategy]["changed_fraction"] >= 0.95, res[strategy]
    assert res["lossy"]["changed_fraction"] < 0.05, res["lossy"]
    for strategy, r in res.items():
        tree, flat = r["paths"]["tree"], r["paths"]["flat"]
        assert tree["computed_tokens"] < flat["computed_tokens"] == out["logical_tokens"]
        for path in (tree, flat):
            assert path["update_s"] > 0 and path["peak_gb"] > 0 and path["mfu"] is None
            assert 0 < path["mfu_measured"] < 1, (strategy, path)
    trl = out["trl"]
    assert "error" not in trl, trl  # the [bench] extra (trl, datasets) is installed in CI
    assert trl["bf16"] is True and trl["step_s"] > 0
    assert trl["computed_tokens"] > out["logical_tokens"]  # TRL pads prompts and completions
    for key in ("single_tree_vs_trl", "fsdp_tree_vs_trl", "single_tree_vs_flat"):
        assert out["ratios"][key] > 0
    phases = res["single"]["profile"]["phases"]
    assert {"actor/forward", "actor/backward", "actor/optimizer_step", "tree/mask"} <= set(phases)
    assert (tmp_path / "profile" / "tree_update_trace.json").is_file()


def test_busy_time_counts_overlapping_kernels_once():
    """The bench's GPU busy fraction is the union of kernel intervals: two streams running at
    once are busy once, and gaps are idle (summing the operator table ran past the wall)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from gpu_train_step import busy_seconds

    assert busy_seconds([]) == 0.0
    # [0, 10) and [5, 20) overlap -> 20 us; [30, 40) after a gap -> 10 us; [32, 35) inside it
    intervals = [(30.0, 40.0), (0.0, 10.0), (5.0, 20.0), (32.0, 35.0)]
    assert busy_seconds(intervals) == 30e-6
