"""A proxy process of the service SIGKILLed (issue 15, item 3).

One backend proxy runs in its own process (``bench/hardening.py --serve-proxy``: a real proxy on
a scripted engine), the other in this one, behind a real gateway. After the kill: the dead
proxy's session fails fast with a clear error (no hang), the health probe marks the backend down
and fails its sessions (finalize answers ``failed``, never waits), the other session goes on
and finalizes, and new sessions land on the survivor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from areal_env.api.config import ProxyConfig
from areal_env.api.service_config import ServiceConfig
from areal_env.engine.testing import ScriptedEngine
from areal_env.proxy.server import ProxyServer
from areal_env.service.gateway import GatewayServer
from areal_env.service.source import ExternalTrajectorySource

ROOT = Path(__file__).resolve().parents[2]
USER = "user-kill-test-key-0123456789"
MSG = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.slow
def test_killed_proxy_process_fails_its_sessions_and_the_others_go_on(tokenizer):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "hardening.py"), "--serve-proxy"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    local = ProxyServer(ScriptedEngine(tokenizer, default="Hi."), tokenizer, ProxyConfig()).start()
    gw = None
    try:
        info = json.loads(child.stdout.readline())
        source = ExternalTrajectorySource(n_samples=1, batch_size=1)
        gw = GatewayServer(
            ServiceConfig(api_keys=[USER], health_interval=0.2, health_failures=2),
            backends=[(info["base_url"], info["admin_key"]), (local.base_url, local.admin_key)],
            source=source,
        ).start()
        with httpx.Client(base_url=gw.base_url, timeout=30) as c:
            user = {"Authorization": f"Bearer {USER}"}
            sids = [
                c.post("/rl/v1/sessions", json={}, headers=user).json()["session_id"]
                for _ in range(2)
            ]
            keys = {s: {"Authorization": f"Bearer {USER}:{s}"} for s in sids}
            for s in sids:
                assert c.post("/v1/chat/completions", json=MSG, headers=keys[s]).status_code == 200
            owner = {s: gw.gateway.book.sessions[s].backend.base_url for s in sids}
            assert sorted(owner.values()) == sorted([info["base_url"], local.base_url])
            doomed = next(s for s in sids if owner[s] == info["base_url"])
            alive = next(s for s in sids if s != doomed)

            child.kill()  # SIGKILL: no cleanup, sockets reset
            child.wait(timeout=10)
            t0 = time.monotonic()
            r = c.post("/v1/chat/completions", json=MSG, headers=keys[doomed])
            assert r.status_code == 503 and "start a new session" in r.text
            assert time.monotonic() - t0 < 10  # a clear error, not a hang
            time.sleep(1.0)  # the health probe marks the backend down
            r = c.post("/rl/v1/finalize", json={"final_reward": 1.0}, headers=keys[doomed])
            assert r.status_code in (200, 409, 410, 503), r.text
            if r.status_code == 200:
                assert r.json()["status"] == "failed"
            # the other session and new ones go on, on the survivor
            assert c.post("/v1/chat/completions", json=MSG, headers=keys[alive]).status_code == 200
            r = c.post("/rl/v1/finalize", json={"final_reward": 1.0}, headers=keys[alive])
            assert r.status_code == 200 and r.json()["status"] == "ok"
            fresh = c.post("/rl/v1/sessions", json={}, headers=user).json()["session_id"]
            assert gw.gateway.book.sessions[fresh].backend.base_url == local.base_url
            r = c.post(
                "/v1/chat/completions",
                json=MSG,
                headers={"Authorization": f"Bearer {USER}:{fresh}"},
            )
            assert r.status_code == 200
        assert source.total_failed >= 1
    finally:
        if gw is not None:
            gw.stop()
        local.stop()
        if child.poll() is None:
            child.kill()
            child.wait()
