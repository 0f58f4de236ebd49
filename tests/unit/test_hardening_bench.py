"""``bench/hardening.py --quick`` (issue 15): fuzzing every HTTP surface and a 256-session soak.

The bench prints figures; this test holds the promises that are not timings: no 5xx, no dropped
connection, no hang, every error in its protocol's format, every server healthy after, and in the
soak no error, no descriptor/task leak, every session reclaimed and memory growth <= 10 %; the
faults it injects (retried rewards, a killed inference server, a full disk, an environment server
killed or frozen mid-episode) lose nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.extended
def test_hardening_quick():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "hardening.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    fig = json.loads(proc.stdout.strip().splitlines()[-1])
    failures = proc.stderr[-4000:]
    assert fig["fuzz_requests"] >= 600
    for key in (
        "fuzz_5xx",
        "fuzz_dropped",
        "fuzz_hangs",
        "fuzz_bad_error_format",
        "fuzz_expected_4xx_got_2xx",
    ):
        assert fig[key] == 0, (key, failures)
    assert fig["fuzz_healthy_after"] is True
    assert fig["faults_injected"] >= 4 and fig["faults_lost_data"] == 0, fig
    assert {"env_server_kill_mid_episode", "env_server_hang_mid_episode"} <= set(fig["faults"])
    assert fig["soak_sessions"] == 256 and fig["soak_requests"] >= 1500
    assert fig["soak_errors"] == 0, failures
    assert fig["soak_fd_leak"] <= 0 and fig["soak_task_leak"] <= 0, fig
    assert fig["soak_sessions_left"] == 0, fig
    assert fig["soak_rss_growth"] <= 0.10, fig
