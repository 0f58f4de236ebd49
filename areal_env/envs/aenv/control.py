"""The AEnvironment control plane (scheduler mode), spoken over HTTP.

Contract (aenvironment 0.1.7, ``aenv.client.scheduler_client``; pinned by
tests/unit/test_aenv_scheduler.py against a recording control plane and the real data plane):

* ``POST {host}:8080/env-instance`` with JSON ``{"envName", "datasource", "ttl",
  "environment_variables", "arguments", "owner", "labels", "mount_points"}`` (absent values
  left out; ``environment_variables`` carries ``envNAME``/``envversion`` split from the name),
  headers ``Authorization: Bearer <key>`` and ``env-instance-trace-id``;
  answer ``{"success": true, "data": {"id", "status", "ip", ...}}`` or
  ``{"success": false, "message": ...}``.
* ``GET /env-instance/{id}`` until ``data.status`` is ``Running`` (``Failed`` is final).
* ``DELETE /env-instance/{id}``.

The data plane of an instance is reached through the service's gateway at ``{host}:8081`` with
the routing headers ``AEnvCore-MCPProxy-URL: http://{ip}:8081`` and
``AEnvCore-EnvInstance-ID: {id}``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

from areal_env.http.client import default_ssl_context

CONTROL_PORT = 8080
DATA_PORT = 8081


class ControlPlaneError(RuntimeError):
    """The control plane refused or failed a request; the message says what it answered."""


@dataclass
class Instance:
    id: str
    status: str
    ip: str | None


def _instance(body: Any, what: str) -> Instance:
    if (
        not isinstance(body, dict)
        or not body.get("success")
        or not isinstance(body.get("data"), dict)
    ):
        message = body.get("message") or body.get("errorMessage") if isinstance(body, dict) else ""
        raise ControlPlaneError(f"{what} failed: {message or body!r}")
    data = body["data"]
    if not isinstance(data.get("id"), str):
        raise ControlPlaneError(f"{what}: answer without an instance id: {data!r}")
    return Instance(id=data["id"], status=str(data.get("status", "")), ip=data.get("ip"))


def routing_headers(instance: Instance) -> dict[str, str]:
    """Headers that make the service's gateway route data-plane requests to ``instance``."""
    return {
        "AEnvCore-MCPProxy-URL": f"http://{instance.ip}:{DATA_PORT}",
        "AEnvCore-EnvInstance-ID": instance.id,
    }


class ControlPlaneClient:
    """Create, poll and delete environment instances."""

    def __init__(self, base_url: str, *, api_key: str | None, timeout: float):
        headers = {
            "Content-Type": "application/json",
            "Accept": "application/json",
            "env-instance-trace-id": str(uuid.uuid4()),
        }
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout),
            verify=default_ssl_context(),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def create(self, request: dict[str, Any]) -> Instance:
        r = await self._http.post("/env-instance", json=request)
        return _instance(_json(r), "creating an instance")

    async def get(self, instance_id: str) -> Instance:
        r = await self._http.get(f"/env-instance/{instance_id}")
        return _instance(_json(r), f"reading instance {instance_id}")

    async def delete(self, instance_id: str) -> None:
        r = await self._http.delete(f"/env-instance/{instance_id}")
        body = _json(r)
        if not (isinstance(body, dict) and body.get("success")):
            raise ControlPlaneError(f"deleting instance {instance_id} failed: {body!r}")

    async def wait_running(self, instance: Instance, timeout: float) -> Instance:
        deadline = time.monotonic() + timeout
        delay = 0.2
        while instance.status != "Running" or not instance.ip:
            if instance.status == "Failed":
                raise ControlPlaneError(f"instance {instance.id} failed to start")
            if time.monotonic() + delay > deadline:
                raise ControlPlaneError(
                    f"instance {instance.id} not running after {timeout:.0f}s "
                    f"(status {instance.status!r})"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
            instance = await self.get(instance.id)
        return instance


def _json(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        raise ControlPlaneError(f"HTTP {r.status_code} without JSON: {r.text[:200]}") from None
