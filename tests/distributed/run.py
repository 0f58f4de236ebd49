"""Run tests/distributed/step_worker.py as one process or as torchrun ranks, and read its results."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_worker(args: list[str], *, nproc: int | None = None, timeout: float = 600) -> list[dict]:
    """``nproc=None``: plain process; else ``torchrun --nproc-per-node nproc``. Returns each
    rank's RESULT line; raises with the output's tail when the job fails."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if nproc is None:
        cmd = [sys.executable, "-m", "tests.distributed.step_worker", *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}",
            "-m",
            "tests.distributed.step_worker",
            *args,
        ]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-6000:]}")
    results = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    return sorted(results, key=lambda r: r["rank"])
