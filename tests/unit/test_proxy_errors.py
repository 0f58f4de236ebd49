"""Every error path over raw HTTP: right status, protocol's own error body, never 422/500,
and no effect on other sessions. Plus capacity, session limits, TTL expiry and isolation.

No model: the proxy runs on a ``ScriptedEngine`` with the real tokenizer."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from areal_env.api.config import ProxyConfig
from areal_env.engine.testing import ScriptedEngine
from areal_env.proxy.server import ProxyServer
from tests.fixtures.proxy import open_session

CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "Hi"}]


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def _anthropic_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] and body["error"]["message"]
    return body["error"]


@pytest.fixture(scope="module")
def proxy_server(scripted_proxy):
    return scripted_proxy


@pytest.fixture(scope="module")
def http(proxy_server):
    with httpx.Client(base_url=proxy_server.base_url, timeout=120) as c:
        yield c


@pytest.fixture
def key(proxy_server):
    return open_session(proxy_server)[1]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content"),
        (
            {
                "model": "m",
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ],
            },
            "messages[0].content",
        ),
        ({"model": "m", "messages": MSGS, "n": 17}, "n"),
        ({"model": "m", "messages": MSGS, "response_format": {"type": "xml"}}, "response_format"),
        (
            {
                "model": "m",
                "messages": MSGS,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
                },
            },
            "response_format",
        ),
        (
            {
                "model": "m",
                "messages": MSGS,
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "strict": True,
                            "parameters": {"type": "object", "if": {"required": ["a"]}},
                        },
                    }
                ],
            },
            "tools[0].function.parameters",
        ),
        ({"model": "m", "messages": MSGS, "temperature": "hot"}, "temperature"),
        ({"model": "m", "messages": MSGS, "temperature": 7}, "temperature"),
        ({"model": "m", "messages": MSGS, "top_p": 2}, "top_p"),
        ({"model": "m", "messages": MSGS, "max_tokens": 0}, "max_tokens"),
        (
            {"model": "m", "messages": MSGS, "max_completion_tokens": "many"},
            "max_completion_tokens",
        ),
        ({"model": "m", "messages": MSGS, "stop": [1, 2]}, "stop"),
        ({"model": "m", "messages": MSGS, "seed": 1.5}, "seed"),
        ({"model": "m", "messages": MSGS, "stream": "yes"}, "stream"),
        ({"model": "m", "messages": MSGS, "stream_options": 3}, "stream_options"),
        ({"model": "m", "messages": MSGS, "top_logprobs": 3}, "top_logprobs"),
        ({"model": "m", "messages": MSGS, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({"model": "m", "messages": MSGS, "tools": {"a": 1}}, "tools"),
        ({"model": "m", "messages": MSGS, "tools": [{"type": "retrieval"}]}, "tools[0]"),
        (
            {
                "model": "m",
                "messages": MSGS,
                "tools": [{"type": "function", "function": {"description": "no name"}}],
            },
            "tools[0].name",
        ),
        ({"model": "m", "messages": MSGS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"model": "m", "messages": MSGS, "tool_choice": "required"}, "tool_choice"),
        (
            {
                "model": "m",
                "messages": MSGS,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        (
            {
                "model": "m",
                "messages": [
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": 3}}],
                    }
                ],
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            {"model": "m", "messages": [{"role": "tool", "content": "x"}]},
            "messages[0].tool_call_id",
        ),
    ],
)
def test_chat_validation_errors_are_400(http, key, body, param):
    err = _openai_error(http.post(CHAT, json=body, headers=_auth(key)), 400)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'"text"', b"\xff\xfe"])
def test_malformed_bodies_are_400(http, key, raw):
    r = http.post(CHAT, content=raw, headers={**_auth(key), "content-type": "application/json"})
    _openai_error(r, 400)


def test_unknown_fields_are_ignored(http, key):
    body = {
        "model": "m",
        "messages": MSGS,
        "max_tokens": 2,
        "frobnicate": {"x": 1},
        "user": "u",
        "parallel_tool_calls": True,
        "response_format": {"type": "text"},
        "store": False,
        "metadata": {"a": "b"},
    }
    r = http.post(CHAT, json=body, headers=_auth(key))
    assert r.status_code == 200 and r.json()["model"] == "m"


def test_auth_errors(http, proxy_server):
    _openai_error(http.post(CHAT, json={"model": "m", "messages": MSGS}), 401)
    _openai_error(
        http.post(CHAT, json={"model": "m", "messages": MSGS}, headers=_auth("sk-areal-nope")), 401
    )
    _openai_error(
        http.post(
            CHAT, json={"model": "m", "messages": MSGS}, headers={"Authorization": "Basic abc"}
        ),
        401,
    )
    # the admin key is not a session key, and a session key is not the admin key
    _openai_error(
        http.post(
            CHAT, json={"model": "m", "messages": MSGS}, headers=_auth(proxy_server.admin_key)
        ),
        401,
    )
    _, key = open_session(proxy_server)
    for path, body in [
        ("/rl/start_session", {}),
        ("/grant_capacity", {"capacity": 1}),
        ("/export_trajectories", {"session_id": "x"}),
    ]:
        _openai_error(http.post(path, json=body), 401)
        _openai_error(http.post(path, json=body, headers=_auth(key)), 401)
    _openai_error(http.post("/rl/set_reward", json={"reward": 1.0}), 401)
    _openai_error(http.post("/rl/end_session", json={}), 401)


def test_anthropic_errors_use_anthropic_format(http, key):
    e = _anthropic_error(
        http.post(
            "/v1/messages", json={"model": "m", "messages": MSGS}, headers={"x-api-key": key}
        ),
        400,
    )
    assert e["type"] == "invalid_request_error" and "max_tokens" in e["message"]
    e = _anthropic_error(
        http.post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": MSGS}), 401
    )
    assert e["type"] == "authentication_error"
    bad_blocks = [{"role": "user", "content": [{"type": "image", "source": {}}]}]
    _anthropic_error(
        http.post(
            "/v1/messages",
            json={"model": "m", "max_tokens": 5, "messages": bad_blocks},
            headers={"x-api-key": key},
        ),
        400,
    )
    _anthropic_error(
        http.post(
            "/v1/messages",
            json={
                "model": "m",
                "max_tokens": 5,
                "messages": MSGS,
                "tools": [{"type": "web_search_20250305", "name": "w"}],
            },
            headers={"x-api-key": key},
        ),
        400,
    )
    _anthropic_error(
        http.post(
            "/v1/messages",
            json={"model": "m", "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]},
            headers={"x-api-key": key},
        ),
        400,
    )
    _anthropic_error(http.post("/v1/messages", content=b"{", headers={"x-api-key": key}), 400)


def test_responses_errors(http, key):
    _openai_error(
        http.post("/v1/responses", json={"model": "m", "input": 5}, headers=_auth(key)), 400
    )
    _openai_error(
        http.post(
            "/v1/responses",
            json={"model": "m", "input": "x", "tools": [{"type": "web_search"}]},
            headers=_auth(key),
        ),
        400,
    )
    _openai_error(
        http.post(
            "/v1/responses", json={"model": "m", "input": [{"type": "mystery"}]}, headers=_auth(key)
        ),
        400,
    )
    _openai_error(
        http.post(
            "/v1/responses",
            json={"model": "m", "input": "x", "previous_response_id": "resp_nope"},
            headers=_auth(key),
        ),
        404,
    )


def test_unknown_route_and_method(http, key):
    _openai_error(http.get("/v1/nothing", headers=_auth(key)), 404)
    _openai_error(http.get(CHAT, headers=_auth(key)), 405)
    _openai_error(http.get("/v1/models/other-model"), 404)


def test_rl_endpoint_errors_and_isolation(http, proxy_server):
    sid_a, key_a = open_session(proxy_server)
    sid_b, key_b = open_session(proxy_server)
    # nothing to reward yet
    _openai_error(http.post("/rl/set_reward", json={"reward": 1.0}, headers=_auth(key_a)), 404)
    rb = http.post(
        CHAT, json={"model": "m", "messages": MSGS, "max_tokens": 2}, headers=_auth(key_b)
    )
    assert rb.status_code == 200
    b_id = rb.json()["id"]
    # A cannot touch B's completion; B can
    _openai_error(
        http.post(
            "/rl/set_reward", json={"completion_id": b_id, "reward": 1.0}, headers=_auth(key_a)
        ),
        404,
    )
    for bad in ["x", None, float("nan"), True]:
        body = '{"reward": NaN}' if bad != bad else None
        r = (
            http.post(
                "/rl/set_reward",
                content=body,
                headers={**_auth(key_b), "content-type": "application/json"},
            )
            if body
            else http.post("/rl/set_reward", json={"reward": bad}, headers=_auth(key_b))
        )
        _openai_error(r, 400)
    _openai_error(
        http.post("/rl/set_reward", json={"completion_id": 7, "reward": 1}, headers=_auth(key_b)),
        400,
    )
    # an unknown field (the id's old name, say) is refused, not read as "the last completion"
    unknown = http.post(
        "/rl/set_reward", json={"interaction_id": b_id, "reward": 1}, headers=_auth(key_b)
    )
    _openai_error(unknown, 400)
    assert "interaction_id" in unknown.text and "completion_id" in unknown.text
    ok = http.post(
        "/rl/set_reward", json={"completion_id": b_id, "reward": 0.5}, headers=_auth(key_b)
    )
    assert ok.status_code == 200
    assert ok.json() == {"completion_id": b_id, "reward": 0.5, "train": True}
    # left out of the loss: the export masks its tokens; setting it again trains it again
    out = http.post(
        "/rl/set_reward", json={"reward": 0.0, "train": False}, headers=_auth(key_b)
    ).json()
    assert out == {"completion_id": b_id, "reward": 0.0, "train": False}
    _openai_error(
        http.post("/rl/set_reward", json={"reward": 0, "train": "no"}, headers=_auth(key_b)), 400
    )
    # no id = the last completion; setting replaces, so a retried call never counts twice
    for _ in range(3):
        ok = http.post("/rl/set_reward", json={"reward": 0.25}, headers=_auth(key_b))
        assert ok.json() == {"completion_id": b_id, "reward": 0.25, "train": True}
    # export validation
    admin = _auth(proxy_server.admin_key)
    _openai_error(
        http.post("/export_trajectories", json={"session_id": "sess-nope"}, headers=admin), 404
    )
    _openai_error(http.post("/export_trajectories", json={}, headers=admin), 400)
    _openai_error(
        http.post(
            "/export_trajectories", json={"session_id": sid_b, "style": "zigzag"}, headers=admin
        ),
        400,
    )
    _openai_error(
        http.post("/export_trajectories", json={"session_id": sid_b, "discount": 3}, headers=admin),
        400,
    )
    _openai_error(http.post("/grant_capacity", json={"capacity": -1}, headers=admin), 400)
    _openai_error(http.post("/rl/start_session", json={"metadata": [1]}, headers=admin), 400)
    exp = http.post(
        "/export_trajectories",
        json={"session_id": sid_b, "discount": 0.9, "style": "concat"},
        headers=admin,
    )
    assert exp.status_code == 200 and exp.json()["trajectories"]
    # ending: chat after end is 409, ending twice is 409, export still works
    assert http.post("/rl/end_session", headers=_auth(key_b)).status_code == 200
    _openai_error(http.post(CHAT, json={"model": "m", "messages": MSGS}, headers=_auth(key_b)), 409)
    _openai_error(http.post("/rl/end_session", headers=_auth(key_b)), 409)
    _openai_error(http.post("/rl/set_reward", json={"reward": 1}, headers=_auth(key_b)), 409)
    assert (
        http.post("/export_trajectories", json={"session_id": sid_b}, headers=admin).json()["ended"]
        is True
    )
    # A is unaffected by everything above
    assert (
        http.post(
            CHAT, json={"model": "m", "messages": MSGS, "max_tokens": 2}, headers=_auth(key_a)
        ).status_code
        == 200
    )


def test_prompt_over_context_is_a_400_in_each_protocols_words(http, key, proxy_server):
    """Frameworks key on these: OpenAI's ``context_length_exceeded`` (with its message form)
    and Anthropic's "prompt is too long: M tokens > N maximum" (what Claude-Code-style clients
    compact on). 413 is for bodies over the size limit only."""
    limit = proxy_server.state.max_context_len
    huge = "hello " * (limit + 10)
    for route in (CHAT,):
        err = _openai_error(
            http.post(
                route,
                json={"model": "m", "messages": [{"role": "user", "content": huge}]},
                headers=_auth(key),
            ),
            400,
        )
        assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
        m = re.fullmatch(
            r"This model's maximum context length is (\d+) tokens\. However, your messages "
            r"resulted in (\d+) tokens\. Please reduce the length of the messages\.",
            err["message"],
        )
        assert m and int(m.group(1)) == limit and int(m.group(2)) > limit, err["message"]
    err = _openai_error(
        http.post("/v1/responses", json={"model": "m", "input": huge}, headers=_auth(key)), 400
    )
    assert err["code"] == "context_length_exceeded"
    e = _anthropic_error(
        http.post(
            "/v1/messages",
            json={"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": huge}]},
            headers={"x-api-key": key},
        ),
        400,
    )
    assert e["type"] == "invalid_request_error"
    m = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", e["message"])
    assert m and int(m.group(2)) == limit and int(m.group(1)) > limit, e["message"]


def test_capacity_and_session_limits(tokenizer):
    cfg = ProxyConfig(initial_capacity=0, max_interactions_per_session=1)
    with (
        ProxyServer(ScriptedEngine(tokenizer), tokenizer, cfg) as p,
        httpx.Client(base_url=p.base_url, timeout=120) as http,
    ):
        admin = _auth(p.admin_key)
        _openai_error(http.post("/rl/start_session", json={}, headers=admin), 429)
        assert http.post("/grant_capacity", json={"capacity": 1}, headers=admin).json() == {
            "capacity": 1
        }
        key = http.post("/rl/start_session", json={"task_id": 1}, headers=admin).json()["api_key"]
        _openai_error(http.post("/rl/start_session", json={}, headers=admin), 429)
        r = http.post(
            CHAT, json={"model": "m", "messages": MSGS, "max_tokens": 2}, headers=_auth(key)
        )
        assert r.status_code == 200
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        err = _openai_error(http.post(CHAT, json=body, headers=_auth(key)), 413)
        assert err["code"] == "session_limit"


def test_idle_sessions_expire(tokenizer):
    """An idle session is dropped after the TTL; its key then answers 410 (not 401)."""
    with (
        ProxyServer(ScriptedEngine(tokenizer), tokenizer, ProxyConfig(session_ttl=0.5)) as p,
        httpx.Client(base_url=p.base_url, timeout=60) as http,
    ):
        _, key = open_session(p)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and http.get("/health").json()["sessions_held"] > 0:
            time.sleep(0.1)
        health = http.get("/health").json()
        assert health["sessions_held"] == 0 and health["sessions_expired"] == 1
        _openai_error(
            http.post(CHAT, json={"model": "m", "messages": MSGS}, headers=_auth(key)), 410
        )
        _openai_error(http.post("/rl/set_reward", json={"reward": 1}, headers=_auth(key)), 410)


def test_engine_unavailable_is_503(tokenizer):
    down = ScriptedEngine(tokenizer)
    down.destroy()  # a destroyed engine raises EngineUnavailableError
    with ProxyServer(down, tokenizer) as p, httpx.Client(base_url=p.base_url, timeout=30) as http:
        key = open_session(p)[1]
        err = _openai_error(
            http.post(CHAT, json={"model": "m", "messages": MSGS}, headers=_auth(key)), 503
        )
        assert err["code"] == "engine_unavailable"
        _openai_error(
            http.post(
                CHAT, json={"model": "m", "messages": MSGS, "stream": True}, headers=_auth(key)
            ),
            503,
        )
        _anthropic_error(
            http.post(
                "/v1/messages",
                json={"model": "m", "max_tokens": 3, "messages": MSGS},
                headers={"x-api-key": key},
            ),
            503,
        )
        assert http.get("/health").status_code == 200


def test_refuses_weak_admin_key_off_loopback(tokenizer):
    for key in (None, "admin", "short"):
        with pytest.raises(ValueError, match="admin key"):
            ProxyServer(
                ScriptedEngine(tokenizer), tokenizer, ProxyConfig(host="0.0.0.0", admin_key=key)
            )
    with pytest.raises(ValueError):
        ProxyServer(ScriptedEngine(tokenizer), tokenizer, ProxyConfig(admin_key="  "))


def test_keys_never_logged(tokenizer, caplog):
    import logging

    caplog.set_level(logging.DEBUG)
    with (
        ProxyServer(ScriptedEngine(tokenizer), tokenizer) as p,
        httpx.Client(base_url=p.base_url, timeout=60) as http,
    ):
        key = open_session(p)[1]
        http.post(CHAT, json={"model": "m", "messages": MSGS, "max_tokens": 1}, headers=_auth(key))
        http.post(CHAT, json={"model": "m"}, headers=_auth(key))
        http.post(CHAT, json={"model": "m"}, headers=_auth(key + "x"))
        admin = p.admin_key
    assert key not in caplog.text and admin not in caplog.text


def test_engine_failures_map_to_statuses(http, key, proxy_server):
    """What the engine does wrong reaches the client as the right status, in both formats."""
    from areal_env.engine.testing import Reply

    engine = proxy_server.state.engine
    body = {"model": "m", "messages": MSGS, "max_tokens": 4}
    engine.push(ValueError("bad sampling"))
    assert (
        "bad sampling"
        in _openai_error(http.post(CHAT, json=body, headers=_auth(key)), 400)["message"]
    )
    engine.push(Reply(token_ids=[], stop_reason="abort"))
    assert (
        "aborted" in _openai_error(http.post(CHAT, json=body, headers=_auth(key)), 503)["message"]
    )
    engine.push(Reply(text="partial", stop_reason="abort"))  # partial output counts as length
    r = http.post(CHAT, json=body, headers=_auth(key))
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    engine.push(Reply(text="one two three four five six seven eight"))
    r = http.post(CHAT, json=body, headers=_auth(key))
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 4
    engine.push(RuntimeError("engine bug"))
    e = _anthropic_error(
        http.post(
            "/v1/messages",
            json={"model": "m", "max_tokens": 3, "messages": MSGS},
            headers={"x-api-key": key},
        ),
        500,
    )
    assert e["type"] == "api_error" and "engine bug" not in e["message"]
    assert engine.pending == 0
