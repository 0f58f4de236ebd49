"""`areal-env serve-training` restarted in the middle of a run with agents still running: once
gracefully (SIGTERM: drain, checkpoint, exit) and once with SIGKILL. The agents are the light
client installed alone in a fresh venv (no torch, no openai SDK).

Every trajectory the service acknowledged is trained exactly once, keys keep working, the step
count and the GRPO groups are right.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from areal_env.service.sessions import RESTARTED

REPO = Path(__file__).resolve().parents[2]
AGENT = Path(__file__).with_name("service_light_agent.py")
KEY = "restart-user-key"


@pytest.fixture(scope="session")
def light_client_python(tmp_path_factory) -> Path:
    """A fresh venv with only ``pip install ./client`` (httpx and its few dependencies)."""
    venv = tmp_path_factory.mktemp("light-client-venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", str(REPO / "client")],
        check=True,
        timeout=600,
        capture_output=True,
    )
    return python


@pytest.mark.slow
def test_light_client_installs_alone(light_client_python):
    code = (
        "import importlib.util as u, sys, areal_env_client as c; "
        "print([m for m in ('torch', 'transformers', 'openai', 'areal_env', 'fastapi') "
        "if u.find_spec(m)], c.AgentSession.__name__)"
    )
    out = subprocess.run(
        [str(light_client_python), "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": os.environ["PATH"]},  # no PYTHONPATH: only what the venv installed
        cwd=str(Path(light_client_python).parent),  # not the repo root (`-c` puts cwd on sys.path)
    )
    assert out.stdout.split() == ["[]", "AgentSession"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `areal-env serve-training` process, its output collected in the background."""

    def __init__(self, cfg_path: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "areal_env.cli", "serve-training", str(cfg_path)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.append(line)

    def log(self, n: int = 60) -> str:
        return "".join(self.lines[-n:])

    def wait_for(self, predicate, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited before {what}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}:\n{self.log()}")
            time.sleep(0.2)

    def listening(self, timeout: float = 300) -> None:
        self.wait_for(
            lambda: any("any-agent server listening at" in x for x in self.lines),
            "listening",
            timeout,
        )


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip()]


def _db_rows(run_dir: Path, query: str, params: tuple = ()) -> list[tuple]:
    """Rows of ``query`` on the service store, read while the server writes it (WAL)."""
    path = run_dir / "service.db"
    if not path.is_file():
        return []
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)
    try:
        return db.execute(query, params).fetchall()
    except sqlite3.OperationalError:  # the tables are not created yet
        return []
    finally:
        db.close()


def _open_sessions(run_dir: Path) -> set[str]:
    return {r[0] for r in _db_rows(run_dir, "SELECT id FROM sessions WHERE state = 'open'")}


def _restart_failed(run_dir: Path) -> set[str]:
    """Sessions a start of the service failed because they were open when it last stopped."""
    query = "SELECT id FROM sessions WHERE state = 'failed' AND error = ?"
    return {r[0] for r in _db_rows(run_dir, query, (RESTARTED,))}


def _under_way(run_dir: Path, step: int) -> bool:
    """``step`` has taken its batch (rows consumed at it, not checkpointed yet) or is done."""
    query = "SELECT COUNT(*) FROM trajectories WHERE consumed_step = ?"
    consumed = _db_rows(run_dir, query, (step,))
    return step in _steps(run_dir) or bool(consumed and consumed[0][0])


@pytest.mark.slow
def test_restarts_train_each_acknowledged_trajectory_exactly_once(tmp_path, light_client_python):
    port = _free_port()
    steps, batch, group = 4, 2, 2
    config = {
        "experiment_name": "svc",
        "trial_name": "restart",
        "fileroot": str(tmp_path),
        "proxy": {"default_max_tokens": 6},
        "gconfig": {"max_new_tokens": 6, "temperature": 1.0},
        # Staleness-bounded admission (one version ahead) keeps the agents waiting for the trainer:
        # they are still running at each restart.
        "rollout": {"n_samples": group, "batch_size": batch, "max_head_offpolicyness": 1},
        "actor": {"ppo_n_minibatches": 1, "lr": 1e-5},
        "trainer": {"total_train_steps": steps, "save_freq_steps": 1, "tensorboard": False},
        "service": {
            "port": port,
            "api_keys": [KEY],
            "health_interval": 1.0,
            "drain_timeout": 20,
            "drain_retry_after": 2,
        },
    }
    cfg_path = tmp_path / "service.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    run_dir = tmp_path / "svc" / "restart"
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    servers = [Server(cfg_path, env)]
    agent = None
    try:
        servers[0].listening()
        n_items = steps * batch  # one GRPO group per item: exactly what 4 steps consume
        agent = subprocess.Popen(
            # Each episode thinks 1 s after its model call: sessions stay open long enough that a
            # kill timed by the store's state finds some open, on fast machines too.
            [str(light_client_python), str(AGENT), str(n_items), str(group), "1.0"],
            env={
                "PATH": os.environ["PATH"],
                "OPENAI_BASE_URL": f"http://127.0.0.1:{port}/v1",
                "OPENAI_API_KEY": KEY,
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        # 1. Graceful: SIGTERM after step 1 -> drain, checkpoint, exit 0.
        servers[0].wait_for(lambda: 1 in _steps(run_dir), "step 1", 600)
        servers[0].proc.send_signal(signal.SIGTERM)
        assert servers[0].proc.wait(timeout=180) == 0, servers[0].log()
        assert any("drain" in x for x in servers[0].lines), servers[0].log()
        assert any(x.startswith("stopped at step ") for x in servers[0].lines), servers[0].log()
        assert not any("training finished" in x for x in servers[0].lines), servers[0].log()
        assert agent.poll() is None, "the agents should still be running"

        # 2. SIGKILL once the next step has taken its batch (while it trains, or just after),
        # with agent sessions open: timed by the store's state, not by a clock.
        servers.append(Server(cfg_path, env))
        servers[1].listening()
        models = httpx.get(
            f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {KEY}"}
        )
        assert [m["id"] for m in models.json()["data"]] == ["svc/restart"]  # not a cache path
        next_step = max(_steps(run_dir)) + 1  # 2, or 3 if the drain finished step 2
        assert next_step <= steps
        servers[1].wait_for(
            lambda: _under_way(run_dir, next_step) and bool(_open_sessions(run_dir)),
            f"step {next_step} under way with agent sessions open",
            600,
        )
        servers[1].proc.kill()
        servers[1].proc.wait(timeout=60)
        assert agent.poll() is None, "the agents should still be running"
        open_at_kill = _open_sessions(run_dir)
        failed_before = _restart_failed(run_dir)

        # 3. Restart and finish.
        servers.append(Server(cfg_path, env))
        servers[2].listening()
        # The premise: sessions were open when the server died; the restart failed them, and
        # their agents must run those episodes again in the same groups.
        assert open_at_kill, "no agent session was open at the SIGKILL"
        assert _restart_failed(run_dir) - failed_before == open_at_kill
        out, err = agent.communicate(timeout=900)
        assert agent.returncode == 0, err[-3000:]
        assert servers[2].proc.wait(timeout=600) == 0, servers[2].log()
    finally:
        for proc in [agent] + [s.proc for s in servers]:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()

    result = json.loads(out.strip().splitlines()[-1])
    assert result["torch"] is False
    assert result["errors"] == [None] * (steps * batch * group), result["errors"]
    assert result["attempts"] > steps * batch * group  # restarts made the agents retry
    acknowledged = {sid for sessions in result["sessions"] for sid in sessions}
    assert len(acknowledged) == steps * batch * group

    # Training reached the last step, and every step trained `batch` full groups.
    recorded = _steps(run_dir)
    assert max(recorded) == steps and set(recorded) == set(range(1, steps + 1))
    metrics = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        metrics[m["step"]] = m  # a redone step (after SIGKILL) counts once, as last written
    for m in metrics.values():
        assert m["groups/accepted"] == batch and m["groups/incomplete"] == 0
        assert m["rejected/stale"] == 0
    assert (run_dir / "checkpoints" / f"step_{steps}" / "model" / "config.json").is_file()

    # The store's ledger: each acknowledged trajectory trained exactly once, whole groups per step.
    db = sqlite3.connect(run_dir / "service.db")
    ledger = db.execute("SELECT session_id, step, outcome FROM consumed").fetchall()
    groups = dict(db.execute("SELECT id, group_id FROM sessions").fetchall())
    trained = [(sid, step) for sid, step, outcome in ledger if outcome == "trained"]
    trained_ids = [sid for sid, _ in trained]
    assert len(trained_ids) == len(set(trained_ids))
    assert acknowledged <= set(trained_ids)
    per_step: dict[int, list[str]] = {}
    for sid, step in trained:
        per_step.setdefault(step, []).append(groups[sid])
    assert sorted(per_step) == list(range(1, steps + 1))
    for step, group_ids in per_step.items():
        assert len(group_ids) == batch * group, (step, group_ids)
        assert all(group_ids.count(g) == group for g in group_ids), (step, group_ids)
    # ... and the dumps of the surviving timeline name each session once.
    dumped = [
        json.loads(x)["session_id"]
        for f in (run_dir / "rollout").rglob("*.jsonl")
        for x in f.read_text().splitlines()
    ]
    assert sorted(dumped) == sorted(trained_ids)
    assert db.execute("SELECT COUNT(*) FROM trajectories").fetchone()[0] == 0
