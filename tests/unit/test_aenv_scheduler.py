"""Scheduler mode (a remote AEnvironment service) against a real environment server.

The control plane (create/get/delete instances on :8080) is a small stand-in that records what
it was asked; the data plane on :8081 is the real aenvironment server. No AEnvironment
deployment is available to tests, and this is the only way to check what the adapter sends to
one (credentials, TTL, environment variables, deletion on every exit).
"""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import UTC, datetime

import pytest
import uvicorn
from fastapi import FastAPI, Request

from areal_env.envs.aenv.adapter import AenvEnvironmentAdapter
from areal_env.envs.aenv.config import AenvConfig
from areal_env.envs.base import EnvUnavailableError


class ControlPlane:
    def __init__(self, host: str):
        self.host = host
        self.created: list[dict] = []
        self.deleted: list[str] = []
        self.auth: list[str | None] = []
        self.fail_create = False
        app = FastAPI()
        now = datetime.now(UTC).isoformat()

        @app.post("/env-instance")
        async def create(request: Request):
            self.auth.append(request.headers.get("authorization"))
            body = await request.json()
            if self.fail_create:
                return {"success": False, "message": "quota exceeded"}
            self.created.append(body)
            inst = f"inst-{len(self.created)}"
            return {"success": True, "data": self._instance(inst, now)}

        @app.get("/env-instance/{inst}")
        async def get(inst: str):
            return {"success": True, "data": self._instance(inst, now)}

        @app.delete("/env-instance/{inst}")
        async def delete(inst: str):
            self.deleted.append(inst)
            return {"success": True}

        self.server = uvicorn.Server(
            uvicorn.Config(app, host=host, port=8080, log_level="warning", lifespan="off")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def _instance(self, inst: str, now: str) -> dict:
        return {
            "id": inst,
            "status": "Running",
            "ip": self.host,
            "created_at": now,
            "updated_at": now,
        }

    def __enter__(self) -> ControlPlane:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise TimeoutError("control plane did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def service(aenv_server_factory):
    launcher = aenv_server_factory(1)
    with ControlPlane(launcher.hosts[0]) as cp:
        yield cp


def _cfg(cp: ControlPlane, **kw) -> AenvConfig:
    base = dict(
        env_name="calculator@1.0.0",
        aenv_url=f"http://{cp.host}",
        mode="scheduler",
        api_key="sk-test-123",
        ttl="10m",
        environment_variables={"SPLIT": "train"},
        retry_delay=0.05,
        max_retries=1,
        timeout=10.0,
    )
    base.update(kw)
    return AenvConfig(**base)


async def test_instance_created_used_and_deleted(service):
    async with AenvEnvironmentAdapter(_cfg(service)) as env:
        assert (await env.call_tool("add", {"a": 4, "b": 5})).text == "9"
        assert env.headers["AEnvCore-EnvInstance-ID"] == "inst-1"
        assert env.headers["AEnvCore-MCPProxy-URL"] == f"http://{service.host}:8081"
    (req,) = service.created
    assert req["envName"] == "calculator@1.0.0" and req["ttl"] == "10m"
    assert req["environment_variables"]["SPLIT"] == "train"
    assert req["environment_variables"]["envNAME"] == "calculator"
    assert req["environment_variables"]["envversion"] == "1.0.0"
    assert "owner" not in req and "labels" not in req  # absent options are left out
    assert service.auth == ["Bearer sk-test-123"]
    assert service.deleted == ["inst-1"]


async def test_instance_options_are_sent(service):
    cfg = _cfg(
        service,
        datasource="oss://bucket/data",
        labels={"team": "rl"},
        owner="alice",
        mount_points=[{"id": "OSS_1", "remote_dir": "/data", "local_dir": "/workspace"}],
        arguments=["--split", "train"],
    )
    async with AenvEnvironmentAdapter(cfg) as env:
        assert (await env.call_tool("multiply", {"a": 3, "b": 5})).text == "15"
    (req,) = service.created
    assert req["datasource"] == "oss://bucket/data" and req["owner"] == "alice"
    assert req["labels"] == {"team": "rl"} and req["arguments"] == ["--split", "train"]
    assert req["mount_points"] == [
        {"id": "OSS_1", "remote_dir": "/data", "local_dir": "/workspace"}
    ]


async def test_instance_deleted_when_episode_is_cancelled(service):
    entered = asyncio.Event()

    async def episode():
        async with AenvEnvironmentAdapter(_cfg(service)) as env:
            entered.set()
            await asyncio.sleep(30)
            await env.call_tool("add", {"a": 1, "b": 1})

    task = asyncio.create_task(episode())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert service.deleted == ["inst-1"]


async def test_refused_instance_is_a_clear_error(service, caplog):
    service.fail_create = True
    with pytest.raises(EnvUnavailableError, match="quota exceeded"):
        await AenvEnvironmentAdapter(_cfg(service)).initialize()
    assert "sk-test-123" not in caplog.text
