"""End to end: `areal-env serve-training` trained by two external agent processes, then served.

The agents use only ``areal_env_client`` and the official ``openai`` SDK, over loopback;
GRPO groups form across the two processes (same ``group_id`` from each).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
AGENT = Path(__file__).with_name("service_agent.py")
KEYS = ["alice-e2e-key", "bob-e2e-key"]


def _read_until(proc: subprocess.Popen, needle: str, timeout: float) -> tuple[str, list[str]]:
    lines: list[str] = []
    found: list[str] = []

    def pump() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if needle in line and not found:
                found.append(line)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not found:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError("server did not come up:\n" + "".join(lines[-40:]))
        time.sleep(0.1)
    return found[0], lines


@pytest.mark.slow
def test_two_agent_processes_train_the_service_then_the_checkpoint_is_served(tmp_path):
    config = {
        "experiment_name": "svc",
        "trial_name": "t0",
        "fileroot": str(tmp_path),
        "proxy": {"default_max_tokens": 8},
        "rollout": {"n_samples": 2, "batch_size": 2, "max_head_offpolicyness": 4},
        "actor": {"ppo_n_minibatches": 1, "lr": 1e-5},
        "trainer": {"total_train_steps": 2, "tensorboard": False},
        "service": {"api_keys": KEYS, "num_proxies": 2, "health_interval": 1.0},
    }
    cfg_path = tmp_path / "service.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen(
        [sys.executable, "-m", "areal_env.cli", "serve-training", str(cfg_path)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    agents: list[subprocess.Popen] = []
    try:
        line, log = _read_until(server, "any-agent server listening at", 300)
        url = line.strip().rsplit(" ", 1)[-1]
        assert url.startswith("http://127.0.0.1:")
        for key in KEYS:
            agents.append(
                subprocess.Popen(
                    [sys.executable, str(AGENT), "4"],
                    cwd=REPO,
                    env={**env, "OPENAI_BASE_URL": url + "/v1", "OPENAI_API_KEY": key},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        outputs = []
        for proc in agents:
            out, err = proc.communicate(timeout=400)
            assert proc.returncode == 0, err[-3000:]
            outputs.append(json.loads(out.strip().splitlines()[-1]))
        for out in outputs:
            assert out["errors"] == [None] * 4, out
            assert all(r in (0.0, 1.0) for r in out["rewards"])
        assert server.wait(timeout=400) == 0, "".join(log[-40:])
    finally:
        for proc in [*agents, server]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    run_dir = tmp_path / "svc" / "t0"
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    updates = [not m.get("actor/update_skipped") for m in metrics]
    assert [m["version"] for m in metrics] == [sum(updates[: i + 1]) for i in range(2)]
    for m in metrics:
        # Two groups per step, each with one trajectory from each agent process.
        assert m["groups/accepted"] == 2 and m["episodes/accepted"] == 4
        assert m["groups/incomplete"] == 0
    assert (run_dir / "checkpoints" / "step_2" / "model" / "config.json").is_file()
    dumped = [
        json.loads(x)
        for f in (run_dir / "rollout").rglob("*.jsonl")
        for x in f.read_text().splitlines()
    ]
    users_by_group: dict[str, set[str]] = {}
    for rec in dumped:
        users_by_group.setdefault(rec["group_id"], set()).add(rec["user"])
        assert rec["interactions"] and rec["interactions"][-1]["reward"] in (0.0, 1.0)
    assert len(users_by_group) == 4  # shared-0 .. shared-3
    assert all(len(users) == 2 for users in users_by_group.values())  # one per agent process

    # The trained checkpoint is served through the same OpenAI-compatible API.
    from areal_env.service.inference import serve_checkpoint

    svc = serve_checkpoint(run_dir, port=0, api_keys=["reader"], block=False)
    try:
        client = openai.OpenAI(base_url=svc.base_url + "/v1", api_key="reader", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["svc/t0@step_2"]
        for _ in range(2):  # sessionless calls: each in its own throwaway session
            reply = client.chat.completions.create(
                model="svc/t0@step_2", messages=[{"role": "user", "content": "Hi!"}], max_tokens=6
            )
            assert reply.choices[0].message.role == "assistant"
            assert reply.usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(
                base_url=svc.base_url + "/v1", api_key="nope", max_retries=0
            ).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Hi!"}], max_tokens=2
            )
        assert svc.gateway.gateway.book.sessions == {}  # throwaway sessions are gone
    finally:
        svc.stop()
