"""Security checks (issue 15, item 4) on the service gateway over HTTP: a gateway with its durable
SQLite store over two real proxies on a scripted engine (no model loaded).

- every route of the gateway is classified (public, user key, session, admin) and a route added
  later fails this test until it is classified;
- each non-public route refuses no key, a wrong key and the other role's key (the admin key is
  not a user key; a user key and a proxy's keys are not the admin key);
- a user key cannot reach another key's sessions by any of the three ways of naming one;
- the per-key concurrent-session quota answers 429 with Retry-After (the tokens-per-minute
  quota's 429 + Retry-After is covered in ``test_service_flows.py``).
"""

from __future__ import annotations

import httpx
import pytest
from areal_env_client import SESSION_HEADER

from tests.fixtures.service import SERVICE_USER_KEYS, make_service_stack

ALICE, BOB = SERVICE_USER_KEYS
MSGS = [{"role": "user", "content": "Hi"}]
CHAT = {"model": "m", "messages": MSGS, "max_tokens": 2}

PUBLIC = {("GET", "/health")}
USER = {("POST", "/rl/v1/sessions")}  # a user key, no session yet
SESSION = {  # a user key and one of that key's sessions
    ("GET", "/rl/v1/sessions/{session_id}"),
    ("GET", "/rl/v1/session"),
    ("POST", "/rl/v1/set_reward"),
    ("POST", "/rl/v1/finalize"),
    *((m, "/v1/{path:path}") for m in ("GET", "POST", "PUT", "DELETE", "PATCH")),
}
ADMIN = {
    ("POST", "/admin/keys"),
    ("GET", "/admin/keys"),
    ("DELETE", "/admin/keys/{key_id}"),
    ("GET", "/admin/status"),
}
DOCS = {"/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}


@pytest.fixture(scope="module")
def stack(tokenizer, tmp_path_factory):
    from areal_env.engine.testing import ScriptedEngine
    from areal_env.service.store import open_store

    store = open_store(str(tmp_path_factory.mktemp("svc") / "service.sqlite"))  # durable SQLite
    s = make_service_stack(
        ScriptedEngine(tokenizer, default="Hello there."),
        tokenizer,
        store=store,
        max_sessions_per_key=3,
    )
    yield s
    s.gateway.stop()
    for p in s.proxies:
        p.stop()
    s.source.close()


def _concrete(path: str) -> str:
    return (
        path.replace("{session_id}", "sess-unknown")
        .replace("{key_id}", "key-unknown")
        .replace("{path:path}", "chat/completions")
    )


def _routes(app) -> set[tuple[str, str]]:
    out = set()
    for r in app.routes:
        if getattr(r, "methods", None) and r.path not in DOCS:
            out |= {(m, r.path) for m in r.methods if m != "HEAD"}
    return out


def _call(c: httpx.Client, method: str, path: str, headers: dict) -> httpx.Response:
    body = CHAT if path.startswith("/v1/") else {"reward": 1.0}
    if method in ("GET", "DELETE"):
        return c.request(method, _concrete(path), headers=headers)
    return c.request(method, _concrete(path), json=body, headers=headers)


def test_every_gateway_route_is_classified_and_guarded(stack):
    routes = _routes(stack.gateway.app)
    assert routes, "no routes found on the gateway app"
    known = PUBLIC | USER | SESSION | ADMIN
    assert routes <= known, f"classify the new gateway routes: {sorted(routes - known)}"
    assert known <= routes, f"classified routes that no longer exist: {sorted(known - routes)}"
    admin = stack.gateway.admin_key
    proxy_keys = [p.admin_key for p in stack.proxies]
    with httpx.Client(base_url=stack.base_url, timeout=30) as c:
        sid = c.post("/rl/v1/sessions", headers={"Authorization": f"Bearer {ALICE}"}).json()[
            "session_id"
        ]
        assert c.get("/health").status_code == 200
        wrong = ("sk-areal-" + "x" * 32, ALICE + "x", ALICE[:-1], f"nope:{sid}")
        for method, path in sorted(SESSION | USER | ADMIN):
            for bad in (None, *wrong, *proxy_keys):
                hdrs = {SESSION_HEADER: sid}
                if bad is not None:
                    hdrs["Authorization"] = f"Bearer {bad}"
                r = _call(c, method, path, hdrs)
                assert r.status_code == 401, (method, path, bad, r.status_code, r.text)
            if (method, path) in ADMIN:  # a user key (with or without a session) is not admin
                for key in (ALICE, f"{ALICE}:{sid}"):
                    r = _call(c, method, path, {"Authorization": f"Bearer {key}"})
                    assert r.status_code == 401, (method, path, r.status_code)
            else:  # the admin key is not a user key
                hdrs = {"Authorization": f"Bearer {admin}", SESSION_HEADER: sid}
                r = _call(c, method, path, hdrs)
                assert r.status_code == 401, (method, path, r.status_code, r.text)
        # the session is untouched by all of the above
        r = c.get(f"/rl/v1/sessions/{sid}", headers={"Authorization": f"Bearer {ALICE}"})
        assert r.status_code == 200 and r.json()["state"] != "failed"
        assert r.json()["rewarded"] is False


def test_a_user_key_cannot_reach_another_keys_sessions(stack):
    a = {"Authorization": f"Bearer {ALICE}"}
    b = {"Authorization": f"Bearer {BOB}"}
    with httpx.Client(base_url=stack.base_url, timeout=30) as c:
        sid = c.post("/rl/v1/sessions", headers=a).json()["session_id"]
        assert c.post(
            "/v1/chat/completions", json=CHAT, headers={**a, SESSION_HEADER: sid}
        ).is_success
        # Bob names Alice's session by header, by /s/{id} URL and by "KEY:SESSION" key
        ways = [
            ("", {**b, SESSION_HEADER: sid}),
            (f"/s/{sid}", b),
            ("", {"Authorization": f"Bearer {BOB}:{sid}"}),
        ]
        for prefix, hdrs in ways:
            attempts = [
                c.get(f"/rl/v1/sessions/{sid}", headers=b),
                c.get(prefix + "/rl/v1/session", headers=hdrs),
                c.post(prefix + "/v1/chat/completions", json=CHAT, headers=hdrs),
                c.post(prefix + "/rl/v1/set_reward", json={"reward": 9.0}, headers=hdrs),
                c.post(prefix + "/rl/v1/finalize", json={"final_reward": 9.0}, headers=hdrs),
                c.post(prefix + "/rl/v1/finalize", json={"status": "failed"}, headers=hdrs),
            ]
            for r in attempts:
                assert r.status_code in (403, 404), (prefix, r.request.url, r.status_code, r.text)
                assert sid not in r.text or "unknown session" in r.text
        r = c.get(f"/rl/v1/sessions/{sid}", headers=a)
        assert r.status_code == 200
        assert r.json()["state"] not in ("failed", "done", "finalized")
        assert r.json()["rewarded"] is False
        # Alice's own session still works and finalizes with her reward
        r = c.post(
            "/rl/v1/finalize", json={"final_reward": 1.0}, headers={**a, SESSION_HEADER: sid}
        )
        assert r.status_code == 200, r.text


def test_concurrent_session_quota_answers_429_with_retry_after(stack):
    """``max_sessions_per_key=3``: the 4th open session of one key is refused, with Retry-After;
    the other key is unaffected."""
    a = {"Authorization": f"Bearer {ALICE}"}
    with httpx.Client(base_url=stack.base_url, timeout=30) as c:
        opened = []
        for _ in range(4):
            r = c.post("/rl/v1/sessions", headers=a)
            if r.status_code != 200:
                break
            opened.append(r.json()["session_id"])
        assert r.status_code == 429, r.text
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert int(r.headers["retry-after"]) >= 1
        assert len(opened) <= 3
        bob = c.post("/rl/v1/sessions", headers={"Authorization": f"Bearer {BOB}"})
        assert bob.status_code == 200
        for sid in opened + [bob.json()["session_id"]]:
            hdrs = {**a, SESSION_HEADER: sid} if sid in opened else None
            hdrs = hdrs or {"Authorization": f"Bearer {BOB}", SESSION_HEADER: sid}
            c.post("/rl/v1/finalize", json={"status": "failed", "retry": False}, headers=hdrs)
        assert c.post("/rl/v1/sessions", headers=a).status_code == 200
