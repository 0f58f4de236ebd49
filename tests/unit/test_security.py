"""Security checks (issue 15, item 4) on a real proxy over HTTP (scripted engine, no model).

- every route is classified (public, session, admin): a session key never reaches an admin route,
  the admin key never acts as a session, and a route added later fails this test until it is
  classified;
- one session cannot reach another's data (export, rewards, previous responses, ending);
- no key appears in any log line, error body, header, /health, /metrics or export (all scanned);
- the admin key is refused off loopback unless a strong one is configured;
- body-size and capacity limits hold; path-like names cannot leave the run folder.
"""

from __future__ import annotations

import logging

import httpx
import pytest

from areal_env.api.config import ProxyConfig
from areal_env.proxy.server import ProxyServer, check_admin_key
from tests.fixtures.proxy import open_session

PUBLIC = {"/health", "/metrics", "/v1/models", "/v1/models/{model_id:path}"}
SESSION = {
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/rl/set_reward",
    "/rl/end_session",
}
ADMIN = {"/rl/start_session", "/grant_capacity", "/export_trajectories"}
MSGS = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def proxy(scripted_proxy):
    return scripted_proxy


def _bodies(path: str) -> dict:
    return {
        "/v1/chat/completions": {"model": "m", "messages": MSGS, "max_tokens": 4},
        "/v1/messages": {"model": "m", "messages": MSGS, "max_tokens": 4},
        "/v1/messages/count_tokens": {"model": "m", "messages": MSGS},
        "/v1/responses": {"model": "m", "input": "Hi"},
        "/rl/set_reward": {"reward": 1.0},
        "/rl/end_session": {},
        "/rl/start_session": {},
        "/grant_capacity": {"capacity": 1},
        "/export_trajectories": {"session_id": "sess-x"},
    }.get(path, {})


def _auth(key: str, path: str) -> dict:
    return (
        {"x-api-key": key}
        if path.startswith("/v1/messages")
        else {"Authorization": f"Bearer {key}"}
    )


def test_every_route_is_classified_and_guarded(proxy):
    paths = {r.path for r in proxy.app.routes if hasattr(r, "methods")}
    paths -= {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}
    assert paths <= PUBLIC | SESSION | ADMIN, (
        f"classify the new routes: {paths - PUBLIC - SESSION - ADMIN}"
    )
    _, key = open_session(proxy)
    with httpx.Client(base_url=proxy.base_url, timeout=30) as c:
        for path in SESSION | ADMIN:
            body = _bodies(path)
            for bad in (None, "sk-areal-" + "x" * 32, "nope"):
                hdrs = _auth(bad, path) if bad is not None else {}
                assert c.post(path, json=body, headers=hdrs).status_code == 401, (path, bad)
            if path in ADMIN:  # a session key is not an admin key
                assert c.post(path, json=body, headers=_auth(key, path)).status_code == 401
            else:  # the admin key is not a session key
                r = c.post(path, json=body, headers=_auth(proxy.admin_key, path))
                assert r.status_code == 401, path


def test_sessions_cannot_reach_each_other(proxy):
    sid_a, key_a = open_session(proxy)
    sid_b, key_b = open_session(proxy)
    with httpx.Client(base_url=proxy.base_url, timeout=30) as c:
        ra = c.post(
            "/v1/responses", json={"model": "m", "input": "A's secret"}, headers=_auth(key_a, "")
        )
        assert ra.status_code == 200
        a_id = ra.json()["id"]
        # B cannot continue A's response, reward it, or export anything
        r = c.post(
            "/v1/responses",
            json={"model": "m", "input": "x", "previous_response_id": a_id},
            headers=_auth(key_b, ""),
        )
        assert r.status_code == 404
        r = c.post(
            "/rl/set_reward", json={"completion_id": a_id, "reward": 9.0}, headers=_auth(key_b, "")
        )
        assert r.status_code == 404
        r = c.post("/export_trajectories", json={"session_id": sid_a}, headers=_auth(key_b, ""))
        assert r.status_code == 401
        # ending B leaves A open and its reward untouched
        assert c.post("/rl/end_session", json={}, headers=_auth(key_b, "")).status_code == 200
        exp = c.post(
            "/export_trajectories", json={"session_id": sid_a}, headers=_auth(proxy.admin_key, "")
        ).json()
        assert exp["ended"] is False
        assert [i["reward"] for i in exp["interactions"]] == [None]
        assert "A's secret" in exp["interactions"][0]["prompt_text"]


def test_no_key_in_logs_bodies_headers_metrics_or_exports(proxy, caplog):
    """Drive every route, good and bad, with DEBUG logging on; scan everything that came back
    and every log record for the admin key and every session key (except the one answer that
    hands a new session its key)."""
    caplog.set_level(logging.DEBUG)
    secrets_seen: set[str] = {proxy.admin_key}
    texts: list[str] = []
    with httpx.Client(base_url=proxy.base_url, timeout=30) as c:
        admin = _auth(proxy.admin_key, "")
        for _ in range(2):
            r = c.post("/rl/start_session", json={"task_id": "t"}, headers=admin)
            sid, key = r.json()["session_id"], r.json()["api_key"]
            secrets_seen.add(key)
            for path in sorted(SESSION - {"/rl/end_session"}):
                for hdrs in (_auth(key, path), _auth(key + "x", path), _auth(key[:-1], path)):
                    r = c.post(path, json=_bodies(path), headers=hdrs)
                    texts += [r.text, str(dict(r.headers))]
                r = c.post(path, content=b"{broken", headers=_auth(key, path))
                texts.append(r.text)
            r = c.post(
                "/v1/chat/completions",
                json={"model": "m", "messages": MSGS, "n": 5},
                headers=_auth(key, ""),
            )
            texts.append(r.text)
            r = c.post(
                "/v1/chat/completions",
                json={"model": "m", "messages": MSGS, "stream": True},
                headers=_auth(key, ""),
            )
            texts.append(r.text)
            r = c.post("/rl/end_session", json={}, headers=_auth(key, ""))
            texts.append(r.text)
            r = c.post(
                "/v1/chat/completions",
                json={"model": "m", "messages": MSGS},
                headers=_auth(key, ""),
            )  # ended: 409/410
            texts.append(r.text)
            r = c.post("/export_trajectories", json={"session_id": sid}, headers=admin)
            texts.append(r.text)
            texts.append(c.post("/grant_capacity", json={"capacity": "x"}, headers=admin).text)
            texts.append(c.post("/rl/start_session", json={}, headers=_auth(key, "")).text)
        texts += [c.get("/health").text, c.get("/metrics").text, c.get("/v1/models").text]
    texts += [rec.getMessage() for rec in caplog.records]
    texts += [str(rec.args) for rec in caplog.records]
    blob = "\n".join(texts)
    assert len(caplog.records) > 0 or blob  # something was scanned
    for secret in secrets_seen:
        assert secret not in blob
        assert secret[-16:] not in blob  # not even a tail of it


def test_admin_key_off_loopback():
    for host in ("0.0.0.0", "10.1.2.3", "::"):
        for key in (None, "admin", "short-key", "changeme"):
            with pytest.raises(ValueError, match="admin key"):
                check_admin_key(ProxyConfig(host=host, admin_key=key))
        check_admin_key(ProxyConfig(host=host, admin_key="a-strong-random-secret-0123456789"))
    check_admin_key(ProxyConfig(host="127.0.0.1", admin_key=None))  # generated, loopback only
    with pytest.raises(ValueError):
        check_admin_key(ProxyConfig(host="127.0.0.1", admin_key="   "))


def test_capacity_session_and_body_limits(tokenizer):
    from areal_env.engine.testing import ScriptedEngine

    cfg = ProxyConfig(
        default_max_tokens=4, max_sessions=2, max_interactions_per_session=2, initial_capacity=0
    )
    with ProxyServer(ScriptedEngine(tokenizer, default="ok"), tokenizer, cfg) as p:
        admin = {"Authorization": f"Bearer {p.admin_key}"}
        with httpx.Client(base_url=p.base_url, timeout=30) as c:
            # the trainer's capacity: none granted -> 429
            assert c.post("/rl/start_session", json={}, headers=admin).status_code == 429
            c.post("/grant_capacity", json={"capacity": 10}, headers=admin)
            keys = [
                c.post("/rl/start_session", json={}, headers=admin).json()["api_key"]
                for _ in range(2)
            ]
            assert c.post("/rl/start_session", json={}, headers=admin).status_code in (429, 503)
            s = {"Authorization": f"Bearer {keys[0]}"}
            body = {"model": "m", "messages": MSGS}
            assert [
                c.post("/v1/chat/completions", json=body, headers=s).status_code for _ in range(3)
            ] == [200, 200, 413]
            big = (
                b'{"model":"m","messages":[{"role":"user","content":"' + b"a" * (33 << 20) + b'"}]}'
            )
            r = c.post(
                "/v1/chat/completions",
                content=big,
                headers={**s, "content-type": "application/json"},
            )
            assert r.status_code == 413 and r.json()["error"]["message"]


def test_path_like_names_stay_in_the_run_folder(tmp_path):
    from areal_env.api.config import ConfigError, ExperimentConfig
    from areal_env.trainer.stats import dump_records

    for bad in ("../escape", "..", "a/b", "/abs", ""):
        for field in ("experiment_name", "trial_name"):
            with pytest.raises(ConfigError):
                ExperimentConfig(**{field: bad}).validate()
    root = tmp_path / "run" / "rollout"
    hostile = ["../../etc/passwd", "/abs/path", "..", "a\\..\\b", "nul\x00byte", "x" * 500]
    files = dump_records(root, [{"task_id": t, "version": 0} for t in hostile])
    for f in files:
        assert f.resolve().is_relative_to(root.resolve()), f
    assert len(files) == len(hostile)
