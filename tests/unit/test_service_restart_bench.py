"""``bench/service_restart.py``, short: SIGTERM, SIGINT and SIGKILL at random points of a
``serve-training`` run with agents still running, on SQLite and on a real PostgreSQL server;
no acknowledged sample is lost, none is dropped by the runner. And what ``serve-training``
says and returns when stopped: "stopped at step N" (also when idle), 130 after a second Ctrl-C.
A tiny random model keeps it short (the bench counts samples, not what a model learns)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KEY = "stop-test-key"


@pytest.mark.slow
@pytest.mark.extended
def test_restarts_lose_and_drop_no_sample(postgres_url):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "client")])}
    args = ["--store", "both", "--agents", "2", "--items", "24", "--restarts", "3"]
    args += ["--max-delay", "4", "--postgres-url", postgres_url, "--seed", "1"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "service_restart.py"), *args],
        capture_output=True,
        text=True,
        timeout=1500,
        env=env,
        cwd=ROOT,
    )
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    total = json.loads(lines[-1])
    assert total["lost"] == 0 and total["dropped"] == 0
    for line in lines[:-1]:
        run = json.loads(line)
        assert run["attempted"] == run["acknowledged"] == run["trained"] == 48, run
        assert run["trained_twice"] == 0 and run["pending_left"] == 0
        assert run["steps"] == run["total_steps"] == 12 and run["final_exit"] == 0
        assert sorted(s["signal"] for s in run["stops"]) == ["SIGINT", "SIGKILL", "SIGTERM"]
        for stop in run["stops"]:
            if stop["signal"] == "SIGKILL":
                assert stop["exit"] == -signal.SIGKILL
            else:  # a clean stop says where it stopped, and exits 0
                assert stop["exit"] == 0 and stop["said"].startswith("stopped at step "), stop
        assert run["store_at_last_start"].endswith(" issued keys")  # the store's run, named
        assert f"run bench/restart-{run['store']}:" in run["store_at_last_start"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Service:
    def __init__(self, config: Path) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "client")])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "areal_env.cli", "serve-training", str(config)],
            env={**env, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.append(line)

    def wait_for(self, text: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not any(x.startswith(text) for x in self.lines):
            assert self.proc.poll() is None, "".join(self.lines[-40:])
            assert time.monotonic() < deadline, "".join(self.lines[-40:])
            time.sleep(0.1)

    def said(self) -> list[str]:
        return [x.strip() for x in self.lines if not x[:4].isdigit()]  # not log lines


@pytest.mark.slow
def test_stop_messages_and_exit_statuses(model_path, tmp_path):
    from tests.gpu.make_tiny_model import make_tiny_model

    port = _free_port()
    config = tmp_path / "service.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "experiment_name": "stops",
                "trial_name": "t",
                "fileroot": str(tmp_path / "out"),
                "model": {"path": str(make_tiny_model(model_path, str(tmp_path / "tiny")))},
                "rollout": {"n_samples": 2, "batch_size": 1},
                "trainer": {"total_train_steps": 3, "tensorboard": False, "progress": False},
                "service": {"port": port, "api_keys": [KEY], "drain_timeout": 120},
            }
        )
    )
    idle = _Service(config)
    idle.wait_for("areal-env any-agent server listening at")
    idle.proc.send_signal(signal.SIGINT)  # Ctrl-C with no agent: nothing trained
    assert idle.proc.wait(timeout=120) == 0
    said = idle.said()
    assert (
        "stopped at step 0 (no step trained in this run): run the same command again to resume"
        in said
    )
    assert not any("training finished" in x or "None" in x for x in said), said

    busy = _Service(config)
    busy.wait_for("areal-env any-agent server listening at")
    r = httpx.post(
        f"http://127.0.0.1:{port}/rl/v1/sessions",
        json={"group_id": "g"},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    assert r.status_code == 200  # an open session: the drain waits for it
    busy.proc.send_signal(signal.SIGTERM)
    busy.wait_for("draining: 1 open sessions may still finish")
    busy.proc.send_signal(signal.SIGINT)  # the second signal: leave now
    assert busy.proc.wait(timeout=60) == 130
    assert any(x.startswith("exiting now") for x in busy.said())
