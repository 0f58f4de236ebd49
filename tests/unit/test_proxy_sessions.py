"""Sessions, the client lifecycle, concurrency and the protocol-neutral streaming pieces."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from areal_env.http.errors import HTTPError
from areal_env.proxy.client import OpenAIProxyClient, ProxyClientError, grant_capacity
from areal_env.proxy.protocols.common import TextStream, truncate_at_stop
from areal_env.proxy.sessions import SessionRegistry
from tests.fixtures.proxy import export_session

# ---- registry (pure) ---------------------------------------------------------------------------


def _registry(**kw) -> SessionRegistry:
    return SessionRegistry(cache_factory=lambda sid: [], admin_key="admin-key-123", **kw)


def test_registry_keys_capacity_and_expiry():
    reg = _registry(initial_capacity=1, ttl=10.0, ended_ttl=1.0)
    reg.check_admin("admin-key-123")
    for bad in (None, "", "admin-key-124"):
        with pytest.raises(HTTPError) as e:
            reg.check_admin(bad)
        assert e.value.status == 401
    s, key = reg.start(task_id="t")
    assert key.startswith("sk-areal-") and len(key) > 30
    assert key not in repr(s) and key.encode() not in repr(reg.__dict__).encode()
    assert reg.by_key(key) is s
    with pytest.raises(HTTPError) as e:
        reg.start()
    assert e.value.status == 429
    assert reg.grant_capacity(2) == 2
    s2, key2 = reg.start()
    assert key2 != key and s2.id != s.id
    # end → 409 for normal use, still reachable with allow_ended
    reg.end(s2)
    with pytest.raises(HTTPError) as e:
        reg.by_key(key2)
    assert e.value.status == 409
    assert reg.by_key(key2, allow_ended=True) is s2
    # expiry: ended sessions go after ended_ttl, idle ones after ttl, busy ones never
    now = s.last_active
    s.in_flight = 1
    assert reg.expire(now + 5) == 1  # only the ended one
    assert reg.expire(now + 30) == 0  # s is busy (30 s < 4 x ttl)
    assert reg.expire(now + 41) == 1  # "in flight" for over 4 x ttl: a leaked counter, dropped
    for k in (key, key2):
        with pytest.raises(HTTPError) as e:
            reg.by_key(k)
        assert e.value.status == 410
    with pytest.raises(HTTPError) as e:
        reg.by_key("sk-areal-unknown")
    assert e.value.status == 401


def test_registry_max_sessions():
    reg = _registry(max_sessions=2)
    reg.start()
    reg.start()
    with pytest.raises(HTTPError) as e:
        reg.start()
    assert e.value.status == 429


# ---- streaming text ----------------------------------------------------------------------------


def _feed(tokenizer, text: str, **kw) -> tuple[list[str], str, TextStream]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    ts = TextStream(tokenizer, **kw)
    parts = [ts.add([t]) for t in ids]
    parts.append(ts.finish())
    return [p for p in parts if p], "".join(parts), ts


def test_text_stream_plain_and_unicode(tokenizer):
    text = "Hello wörld — ünïcode 日本語 ok"
    parts, joined, _ = _feed(tokenizer, text)
    assert joined == text and len(parts) > 3
    assert all("\ufffd" not in p for p in parts)


def test_text_stream_holds_back_tool_tag(tokenizer):
    text = 'Let me check. <tool_call>[{"name": "add", "arguments": {}}]</tool_call>'
    parts, joined, ts = _feed(tokenizer, text, tool_markers=("<tool_call>",))
    assert joined == "Let me check. "
    assert ts.in_tool_call
    assert not any("<" in p for p in parts)


def test_text_stream_releases_false_alarm(tokenizer):
    text = "a < b and <tool is not a call"
    _, joined, ts = _feed(tokenizer, text, tool_markers=("<tool_call>",))
    assert joined == text and not ts.in_tool_call


def test_text_stream_stop_string(tokenizer):
    _, joined, ts = _feed(tokenizer, "one two STOP three", stop=["STOP"])
    assert joined == "one two " and ts.stopped_at == "STOP"
    assert truncate_at_stop("one two STOP three", ["three", "STOP"]) == ("one two ", "STOP")
    assert truncate_at_stop("abc", None) == ("abc", None)


# ---- client lifecycle over HTTP ----------------------------------------------------------------


async def test_openai_proxy_client_lifecycle(proxy_server):
    async with httpx.AsyncClient() as http:
        await grant_capacity(proxy_server.base_url, proxy_server.admin_key, 1, http_client=http)
        async with OpenAIProxyClient(
            proxy_server.base_url,
            proxy_server.admin_key,
            http_client=http,
            task_id="task-9",
            group_id="g1",
        ) as sess:
            assert sess.openai_base_url == proxy_server.base_url + "/v1"
            assert sess.api_key not in repr(sess)
            client = openai.AsyncOpenAI(
                base_url=sess.openai_base_url, api_key=sess.api_key, http_client=http
            )
            r1 = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
            )
            r2 = await client.chat.completions.create(
                model="m",
                messages=[
                    {"role": "user", "content": "Hi"},
                    r1.choices[0].message.model_dump(exclude_none=True),
                    {"role": "user", "content": "More"},
                ],
                max_tokens=3,
            )
            await sess.set_reward(1.0, r2.id)
            await sess.set_reward(0.5, r1.id)
            with pytest.raises(ProxyClientError) as e:
                await sess.set_reward(1.0, "chatcmpl-not-mine")
            assert e.value.status == 404
            await sess.end()
            await sess.end()  # idempotent
            data = await sess.export(discount=0.5)
        assert data["task_id"] == "task-9" and data["group_id"] == "g1" and data["ended"]
        rows = data["trajectories"]
        assert set(rows) == {r1.id, r2.id}
        assert rows[r2.id]["reward"] == 1.0
        assert rows[r1.id]["reward"] == pytest.approx(0.5 + 0.5 * 1.0)  # own + discounted child
        with pytest.raises(ProxyClientError) as e:
            await OpenAIProxyClient(proxy_server.base_url, "wrong-admin", http_client=http).start()
        assert e.value.status == 401


async def test_client_retries_then_reports_transport_failure():
    sess = OpenAIProxyClient("http://127.0.0.1:9", "k", max_retries=1)  # discard port: refused
    with pytest.raises(ProxyClientError) as e:
        await sess.start()
    assert e.value.status == 0
    await sess.__aexit__(None, None, None)


# ---- concurrency -------------------------------------------------------------------------------


@pytest.mark.slow
async def test_64_concurrent_sessions_are_isolated(proxy_server):
    admin = {"Authorization": f"Bearer {proxy_server.admin_key}"}
    async with httpx.AsyncClient(
        base_url=proxy_server.base_url, timeout=600, limits=httpx.Limits(max_connections=200)
    ) as http:

        async def one(i: int) -> tuple[str, str, list[str]]:
            s = (await http.post("/rl/start_session", json={"task_id": i}, headers=admin)).json()
            client = openai.AsyncOpenAI(
                base_url=proxy_server.openai_base_url,
                api_key=s["api_key"],
                http_client=http,
                max_retries=0,
            )
            msgs = [{"role": "user", "content": f"Say the number {i}."}]
            r1 = await client.chat.completions.create(
                model="m", messages=msgs, max_tokens=2, temperature=1.0
            )
            msgs += [
                r1.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": "Again."},
            ]
            r2 = await client.chat.completions.create(
                model="m", messages=msgs, max_tokens=1, temperature=1.0
            )
            ok = await http.post(
                "/rl/set_reward",
                json={"completion_id": r2.id, "reward": float(i)},
                headers={"Authorization": f"Bearer {s['api_key']}"},
            )
            assert ok.status_code == 200
            return s["session_id"], s["api_key"], [r1.id, r2.id]

        results = await asyncio.gather(*(one(i) for i in range(64)))

        # isolation: each key is refused on every other session's completions
        for i, (_, key, _) in enumerate(results[:8]):
            other_ids = results[(i + 1) % 64][2]
            r = await http.post(
                "/rl/set_reward",
                json={"completion_id": other_ids[0], "reward": 1.0},
                headers={"Authorization": f"Bearer {key}"},
            )
            assert r.status_code == 404
    for i, (sid, _, ids) in enumerate(results):
        data = export_session(proxy_server, sid)
        assert [it["id"] for it in data["interactions"]] == ids
        assert data["interactions"][1]["parent_id"] == ids[0] and data["interactions"][1]["spliced"]
        assert data["trajectories"][ids[1]]["reward"] == float(i)
        assert data["task_id"] == str(i)
