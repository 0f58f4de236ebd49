"""Per-key request rate limits (issue 15): the proxy's ``proxy.rate_limit_rps`` /
``rate_limit_burst`` (a token bucket per session key on the model routes) and the service's
``service.requests_per_second`` / ``requests_burst`` (one per user key).

Real proxy on 127.0.0.1 (scripted engine, the real tokenizer), real openai and anthropic SDKs:
past the burst a key gets a 429 in its protocol's own error format with ``Retry-After`` (and
``retry-after-ms``), which the SDKs raise as ``RateLimitError`` or honour when retrying; other
keys are unaffected; the RL routes stay open so a limited agent can still reward and end its
session. The refill rate is slow enough that no assertion depends on timing."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from areal_env.api.config import ProxyConfig
from areal_env.api.config_load import config_from_dict
from areal_env.api.errors import ConfigError
from areal_env.engine.testing import ScriptedEngine
from areal_env.http.ratelimit import TokenBucket
from areal_env.proxy.server import ProxyServer
from tests.fixtures.proxy import open_session
from tests.fixtures.service import SERVICE_USER_KEYS, make_service_stack

MSGS = [{"role": "user", "content": "Hi"}]


def test_token_bucket_burst_then_rate():
    b = TokenBucket(rate=2.0, burst=3)
    t = b.stamp
    assert [b.take(t) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take(t) == pytest.approx(0.5)  # empty: one token every 1/rate s
    assert b.take(t + 0.5) == 0.0
    assert b.take(t + 100) == 0.0  # refills to the burst, no further
    assert [b.take(t + 100) for _ in range(3)] == [0.0, 0.0, pytest.approx(0.5)]
    with pytest.raises(ValueError, match="rate"):
        TokenBucket(rate=0, burst=1)


@pytest.mark.parametrize(
    "section, match",
    [
        ({"rate_limit_rps": 0}, r"proxy.rate_limit_rps=0 must be a number > 0.*or null"),
        ({"rate_limit_rps": "fast"}, r"rate_limit_rps='fast' must be a number > 0"),
        ({"rate_limit_burst": 4}, r"rate_limit_burst=4 is set but proxy.rate_limit_rps is not"),
        ({"rate_limit_rps": 2, "rate_limit_burst": 0}, r"rate_limit_burst=0 must be an integer"),
    ],
)
def test_config_errors_say_how_to_fix(section, match):
    with pytest.raises(ConfigError, match=match):
        ProxyConfig(**section).validate()


def test_other_proxy_checks_still_run():
    with pytest.raises(ConfigError, match="session_ttl"):
        ProxyConfig(session_ttl=0, rate_limit_rps=1).validate()
    with pytest.raises(ConfigError, match="max_sessions"):
        ProxyConfig(max_sessions=0).validate()


def test_config_defaults():
    assert ProxyConfig().rate_limit() is None  # off by default
    assert ProxyConfig(rate_limit_rps=2.5).rate_limit() == (2.5, 3)  # one second's worth
    assert ProxyConfig(rate_limit_rps=0.2).rate_limit() == (0.2, 1)
    cfg = config_from_dict(ProxyConfig, {"rate_limit_rps": 5, "rate_limit_burst": 10})
    assert cfg.rate_limit() == (5.0, 10)


@pytest.fixture(scope="module")
def limited(tokenizer):
    """0.05 requests/s (one token per 20 s), burst 2: the third quick request is refused."""
    engine = ScriptedEngine(tokenizer, default="Hello there.")
    cfg = ProxyConfig(default_max_tokens=16, rate_limit_rps=0.05, rate_limit_burst=2)
    with ProxyServer(engine, tokenizer, cfg, model_name="m") as server:
        yield server


def _health(server) -> dict:
    return httpx.get(server.base_url + "/health").json()


def test_openai_sdk_gets_429_with_retry_after(limited):
    sid, key = open_session(limited)
    client = openai.OpenAI(base_url=limited.base_url + "/v1", api_key=key, max_retries=0)
    for _ in range(2):  # the burst
        r = client.chat.completions.create(model="m", messages=MSGS)
        assert r.choices[0].message.content == "Hello there."
    before = _health(limited)["rate_limited"]
    with pytest.raises(openai.RateLimitError) as err:
        client.chat.completions.create(model="m", messages=MSGS)
    resp = err.value.response
    assert resp.status_code == 429
    assert 1 <= int(resp.headers["retry-after"]) <= 20
    assert 0 < int(resp.headers["retry-after-ms"]) <= 20_000
    body = resp.json()["error"]
    assert body["type"] == "rate_limit_error" and body["code"] == "rate_limit_exceeded"
    assert "0.05 model requests per second (burst 2)" in body["message"]
    assert key not in resp.text
    # the Responses API shares the key's bucket
    with pytest.raises(openai.RateLimitError):
        client.responses.create(model="m", input="Hi")
    assert _health(limited)["rate_limited"] == before + 2

    # another session's key has its own bucket
    _, other = open_session(limited)
    fresh = openai.OpenAI(base_url=limited.base_url + "/v1", api_key=other, max_retries=0)
    assert fresh.chat.completions.create(model="m", messages=MSGS).choices[0].message.content

    # the RL routes are not limited: the limited agent can still reward and end its session
    auth = {"Authorization": f"Bearer {key}"}
    r = httpx.post(limited.base_url + "/rl/set_reward", json={"reward": 1.0}, headers=auth)
    assert r.status_code == 200, r.text
    r = httpx.post(limited.base_url + "/rl/end_session", json={}, headers=auth)
    assert r.status_code == 200 and r.json()["num_interactions"] == 2


def test_anthropic_sdk_gets_its_own_error_format(limited):
    _, key = open_session(limited)
    client = anthropic.Anthropic(base_url=limited.base_url, api_key=key, max_retries=0)
    for _ in range(2):
        client.messages.create(model="m", max_tokens=16, messages=MSGS)
    with pytest.raises(anthropic.RateLimitError) as err:
        client.messages.create(model="m", max_tokens=16, messages=MSGS)
    resp = err.value.response
    assert resp.status_code == 429 and int(resp.headers["retry-after"]) >= 1
    body = resp.json()
    assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
    # count_tokens is a model route too
    r = httpx.post(
        limited.base_url + "/v1/messages/count_tokens",
        json={"model": "m", "messages": MSGS},
        headers={"x-api-key": key},
    )
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"


def test_sdk_retry_honours_retry_after(tokenizer):
    """With retries on, the openai SDK waits what ``retry-after-ms`` says and then succeeds:
    the 429 costs the agent a short wait, not a failed episode."""
    engine = ScriptedEngine(tokenizer, default="Hello there.")
    # one request per 2 s: the second, sent right after the first, is refused once (~2 s wait)
    cfg = ProxyConfig(default_max_tokens=16, rate_limit_rps=0.5, rate_limit_burst=1)
    with ProxyServer(engine, tokenizer, cfg, model_name="m") as server:
        _, key = open_session(server)
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=2)
        answers = [
            client.chat.completions.create(model="m", messages=MSGS).choices[0].message.content
            for _ in range(2)
        ]
        assert answers == ["Hello there."] * 2
        health = _health(server)
        assert health["rate_limited"] == 1  # refused once, then the SDK waited long enough
        assert health["stats"]["completions"] == 2  # each answered once


# ---- the service: the same bucket per user key (configured or admin-issued) -------------------


def test_service_per_key_request_rate(tokenizer):
    """``service.requests_per_second``: a user key's model calls through the gateway (real
    gateway over two real proxies, the real openai SDK) are limited across its sessions; the
    429 carries Retry-After in OpenAI's format; another key is unaffected; sessions still
    finalize."""
    from areal_env.api.service_config import ServiceConfig

    with pytest.raises(ConfigError, match=r"service.requests_burst=3 is set but"):
        ServiceConfig(requests_burst=3).validate()
    stack = make_service_stack(
        ScriptedEngine(tokenizer, default="Hello there."),
        tokenizer,
        requests_per_second=0.05,
        requests_burst=2,
    )
    try:
        alice, bob = SERVICE_USER_KEYS

        def session(key: str) -> tuple[str, openai.OpenAI]:
            r = httpx.post(
                stack.base_url + "/rl/v1/sessions", headers={"Authorization": f"Bearer {key}"}
            )
            assert r.status_code == 200, r.text
            sid = r.json()["session_id"]
            url = f"{stack.base_url}/s/{sid}/v1"
            return sid, openai.OpenAI(base_url=url, api_key=key, max_retries=0)

        (s1, c1), (s2, c2) = session(alice), session(alice)
        c1.chat.completions.create(model="m", messages=MSGS)
        c2.chat.completions.create(model="m", messages=MSGS)  # the burst, across sessions
        with pytest.raises(openai.RateLimitError) as err:
            c1.chat.completions.create(model="m", messages=MSGS)
        resp = err.value.response
        assert 1 <= int(resp.headers["retry-after"]) <= 20
        body = resp.json()["error"]
        assert body["type"] == "rate_limit_error" and body["code"] == "rate_limit_exceeded"
        assert alice not in resp.text
        assert stack.gateway.gateway.book.counters["rejected_rate"] == 1
        _, cb = session(bob)  # Bob's own bucket
        assert cb.chat.completions.create(model="m", messages=MSGS).choices[0].message.content
        for sid in (s1, s2):  # finalize is not a model call: not limited
            r = httpx.post(
                f"{stack.base_url}/s/{sid}/rl/v1/finalize",
                json={"final_reward": 1.0},
                headers={"Authorization": f"Bearer {alice}"},
            )
            assert r.status_code == 200, r.text
    finally:
        stack.gateway.stop()
        for p in stack.proxies:
            p.stop()
        stack.source.close()
