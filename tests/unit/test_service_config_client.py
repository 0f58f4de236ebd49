"""Service config, key store and the client's session hook (no model needed)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import pytest

from areal_env.api.config import ConfigError, config_from_dict
from areal_env.api.service_config import ServiceConfig
from areal_env.service.auth import KeyStore, QuotaExceededError
from areal_env.service.client import (
    _ACTIVE,
    SESSION_HEADER,
    AgentServiceError,
    default_service_url,
    install_session_hook,
    is_transient,
)
from areal_env.service.gateway import Gateway
from areal_env.service.server import load_service_config


def test_non_loopback_needs_user_keys(tmp_path):
    with pytest.raises(ConfigError, match="not a loopback"):
        config_from_dict(ServiceConfig, {"host": "0.0.0.0"})
    with pytest.raises(ValueError, match="non-loopback"):
        Gateway(ServiceConfig(host="10.1.2.3"))
    keys = tmp_path / "keys.txt"
    keys.write_text("# team keys\nkey-one\n\nkey-two\n")
    cfg = config_from_dict(ServiceConfig, {"host": "0.0.0.0", "key_file": str(keys)})
    assert cfg.load_keys() == ["key-one", "key-two"]
    with pytest.raises(ConfigError, match="ssl_certfile"):
        config_from_dict(ServiceConfig, {"ssl_keyfile": "k.pem"})


def test_serve_training_config_splits_the_service_section(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("experiment_name: e\nservice:\n  num_proxies: 2\n  api_keys: [a]\n")
    cfg, svc = load_service_config(str(path), ["service.port=9001", "rollout.n_samples=3"])
    assert cfg.experiment_name == "e" and cfg.rollout.n_samples == 3
    assert (svc.num_proxies, svc.port, svc.api_keys) == (2, 9001, ["a"])
    with pytest.raises(ConfigError, match="service"):
        load_service_config(str(path), ["service.bogus=1"])


def test_keystore_hashes_keys_and_counts_quota():
    store = KeyStore(["secret-a"], max_sessions_per_key=1)
    user = store.lookup("secret-a")
    assert user is not None and store.lookup("secret-b") is None
    assert "secret-a" not in repr(store.__dict__)
    store.acquire(user)
    with pytest.raises(QuotaExceededError):
        store.acquire(user)
    store.release(user)
    store.acquire(user)
    key, issued = store.issue(name="carol", max_sessions=5)
    assert store.lookup(key) is issued and ":" not in key and issued.max_sessions == 5
    assert store.is_admin(store.admin_key) and not store.is_admin("secret-a")


def test_default_service_url_and_transient_errors(monkeypatch):
    monkeypatch.setenv("OPENAI_BASE_URL", "http://10.0.0.1:8000/v1/")
    assert default_service_url() == "http://10.0.0.1:8000"
    assert is_transient(httpx.ConnectError("refused"))
    assert is_transient(AgentServiceError(503, "down")) and is_transient(
        AgentServiceError(429, "q")
    )
    assert not is_transient(AgentServiceError(401, "key")) and not is_transient(ValueError())


async def test_session_header_only_for_matching_service_and_context():
    """The hook tags requests to the session's service, in the session's context only."""
    install_session_hook()
    seen: list[tuple[str, str | None]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((str(request.url), request.headers.get(SESSION_HEADER)))
        return httpx.Response(200, json={})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:

        async def in_session(sid: str) -> None:
            _ACTIVE.set(((httpx.URL("http://svc:1"), sid),))
            await asyncio.sleep(0)
            await client.get("http://svc:1/v1/models")
            await client.get("http://other:1/v1/models")

        await asyncio.gather(in_session("s1"), in_session("s2"))
        await client.get("http://svc:1/v1/models")  # outside any session
    tagged = sorted(h for u, h in seen if u.startswith("http://svc") and h)
    assert tagged == ["s1", "s2"]
    assert all(h is None for u, h in seen if u.startswith("http://other"))
    assert seen[-1][1] is None


def test_client_module_is_light():
    code = (
        "import sys, areal_env.service.client as c; "
        "bad = [m for m in ('torch', 'transformers', 'fastapi', 'areal_env.proxy', "
        "'areal_env.engine') if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
