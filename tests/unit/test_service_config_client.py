"""Service config, key store and the client's session hook (no model needed)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import pytest
from areal_env_client import (
    SESSION_HEADER,
    AgentServiceError,
    default_service_url,
    install_session_hook,
    is_transient,
)
from areal_env_client.hooks import ACTIVE_SESSIONS

from areal_env.api.config import ConfigError
from areal_env.api.config_load import config_from_dict
from areal_env.api.service_config import ServiceConfig
from areal_env.service.auth import KeyStore, QuotaExceededError
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
            ACTIVE_SESSIONS.set(((httpx.URL("http://svc:1"), sid),))
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
        "import sys, areal_env_client as c; "
        "bad = [m for m in ('torch', 'transformers', 'fastapi', 'areal_env.proxy', "
        "'areal_env.engine') if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_command_line_options_may_stand_between_overrides():
    from areal_env.service.server import parse_command_line

    config, overrides = parse_command_line(
        ["c.yaml", "rollout.n_samples=2", "--host", "127.0.0.2", "service.port=5", "--port", "7"]
    )
    assert config == "c.yaml"
    assert overrides == [
        "rollout.n_samples=2",
        "service.port=5",
        "service.host=127.0.0.2",
        "service.port=7",
    ]


def test_a_finished_trial_and_a_busy_port_are_refused_before_the_model_loads(tmp_path, capsys):
    import json
    import socket

    from areal_env.service.server import finished_message, serve_training

    cfg, svc = load_service_config(
        None,
        [
            f"fileroot={tmp_path}",
            "experiment_name=e",
            "trial_name=t",
            "trainer.total_train_steps=2",
        ],
    )
    assert finished_message(cfg) is None
    step = cfg.run_dir / "checkpoints" / "step_2"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"step": 2, "version": 2}))
    message = finished_message(cfg)
    assert message is not None and "already finished" in message and "trial_name" in message
    assert asyncio.run(serve_training(cfg, svc)) == 2
    assert "already finished" in capsys.readouterr().err

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg, svc = load_service_config(
            None, [f"fileroot={tmp_path}", "trial_name=busy", f"service.port={port}"]
        )
        assert asyncio.run(serve_training(cfg, svc)) == 2  # fails fast: no engine is created
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "--port" in err and "Traceback" not in err


def test_usage_is_read_from_json_bodies_and_every_stream_shape():
    from areal_env.service.forwarding import usage_tokens

    body = b'{"id": "x", "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}'
    assert usage_tokens("application/json", body, body, whole=True) == 10
    assert usage_tokens("application/json", b"{", b'xx"usage": {"prompt_tokens": 4}}') == 4
    assert usage_tokens("application/json", body, body + body) == 10  # truncated: the tail
    openai_sse = (
        b'data: {"choices": [{"delta": {"content": "a"}}], "usage": null}\n\n'
        b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}\n\n'
        b"data: [DONE]\n\n"
    )
    assert usage_tokens("text/event-stream", openai_sse, openai_sse) == 7
    anthropic_sse = (
        b'event: message_start\ndata: {"type": "message_start", "message": {"usage": '
        b'{"input_tokens": 9, "output_tokens": 1}}}\n\n'
        b'event: message_delta\ndata: {"type": "message_delta", "usage": {"output_tokens": 4}}\n\n'
    )
    assert usage_tokens("text/event-stream", anthropic_sse, b"") == 14
    responses_sse = (
        b'data: {"type": "response.completed", "response": {"usage": '
        b'{"input_tokens": 6, "output_tokens": 2}}}\n\n'
    )
    assert usage_tokens("text/event-stream", b"", responses_sse) == 8
    assert usage_tokens("text/event-stream", b"data: {}\n\n", b"") == 0


def test_session_urls_are_stripped_back_to_the_service():
    from areal_env_client import strip_session_path

    assert strip_session_path("http://h:1/s/sess-abc/v1") == "http://h:1"
    assert strip_session_path("http://h:1/prefix/v1/") == "http://h:1/prefix"
    assert strip_session_path("http://h:1/s/sess-abc") == "http://h:1"
