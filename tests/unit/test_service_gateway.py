"""The service gateway over two real proxies on the real model: auth, affinity, failover."""

from __future__ import annotations

import asyncio
import subprocess

import httpx
import openai
import pytest
from areal_env_client import SESSION_HEADER, AgentServiceError, AgentSession

from tests.fixtures.batches import as_tensors, episode_dicts
from tests.fixtures.service import SERVICE_USER_KEYS, make_service_stack

ALICE, BOB = SERVICE_USER_KEYS
MSG = [{"role": "user", "content": "Say hi."}]


def bearer(key: str, session: str | None = None) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {key}"}
    if session:
        headers[SESSION_HEADER] = session
    return headers


async def test_auth_refuses_unauthenticated_and_cross_user_access(service_stack):
    url = service_stack.base_url
    async with httpx.AsyncClient(base_url=url, timeout=60) as h:
        assert (await h.post("/rl/v1/sessions")).status_code == 401
        assert (await h.post("/rl/v1/sessions", headers=bearer("wrong"))).status_code == 401
        r = await h.post("/v1/chat/completions", json={"model": "m", "messages": MSG})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = await h.post("/v1/messages", json={"model": "m", "max_tokens": 4, "messages": MSG})
        assert r.status_code == 401 and r.json()["type"] == "error"  # Anthropic error shape

        sid = (await h.post("/rl/v1/sessions", headers=bearer(ALICE))).json()["session_id"]
        body = {"model": "m", "messages": MSG, "max_tokens": 4}
        ok = await h.post("/v1/chat/completions", json=body, headers=bearer(ALICE, sid))
        assert ok.status_code == 200, ok.text
        cid = ok.json()["id"]
        # Bob cannot use, reward, finalize or even see Alice's session.
        for path, payload in (
            ("/v1/chat/completions", body),
            ("/rl/v1/set_reward", {"completion_id": cid, "reward": 1.0}),
            ("/rl/v1/finalize", {"final_reward": 1.0}),
        ):
            r = await h.post(path, json=payload, headers=bearer(BOB, sid))
            assert r.status_code == 404, (path, r.text)
        assert (await h.get(f"/rl/v1/sessions/{sid}", headers=bearer(BOB))).status_code == 404
        # An unknown field (the id's old name, say) is refused, not read as "the last one".
        r = await h.post(
            "/rl/v1/set_reward",
            json={"interaction_id": cid, "reward": 1.0},
            headers=bearer(ALICE, sid),
        )
        assert r.status_code == 400 and "interaction_id" in r.text, r.text
        # Bob's key with Alice's session id in the key form is refused as well.
        r = await h.post("/v1/chat/completions", json=body, headers=bearer(f"{BOB}:{sid}"))
        assert r.status_code == 404
        # The proxies' own keys are never handed out, and a proxy session key is no user key.
        assert (
            "api_key" not in (await h.get(f"/rl/v1/sessions/{sid}", headers=bearer(ALICE))).json()
        )
        r = await h.post(
            "/v1/chat/completions",
            json=body,
            headers=bearer(service_stack.proxies[0].admin_key, sid),
        )
        assert r.status_code == 401

        # Admin-issued keys.
        assert (await h.post("/admin/keys", headers=bearer(ALICE))).status_code == 401
        r = await h.post(
            "/admin/keys", json={"name": "carol"}, headers=bearer(service_stack.gateway.admin_key)
        )
        carol = r.json()["api_key"]
        assert (await h.post("/rl/v1/sessions", headers=bearer(carol))).status_code == 200


async def test_quota_on_concurrent_sessions(engine, tokenizer):
    stack = make_service_stack(engine, tokenizer, max_sessions_per_key=2)
    try:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as h:
            ids = [
                (await h.post("/rl/v1/sessions", headers=bearer(ALICE))).json()["session_id"]
                for _ in range(2)
            ]
            r = await h.post("/rl/v1/sessions", headers=bearer(ALICE))
            assert r.status_code == 429 and "quota" in r.json()["error"]["message"]
            # Other keys have their own quota; finalizing frees a slot.
            assert (await h.post("/rl/v1/sessions", headers=bearer(BOB))).status_code == 200
            r = await h.post(
                "/rl/v1/finalize", json={"status": "failed"}, headers=bearer(ALICE, ids[0])
            )
            assert r.json()["status"] == "failed"
            assert (await h.post("/rl/v1/sessions", headers=bearer(ALICE))).status_code == 200
            # A finalized session takes no more calls.
            r = await h.post(
                "/v1/chat/completions",
                json={"model": "m", "messages": MSG},
                headers=bearer(ALICE, ids[0]),
            )
            assert r.status_code in (409, 410)  # finalized, or failed for good
    finally:
        stack.gateway.stop()
        for p in stack.proxies:
            p.stop()


async def test_spread_over_two_proxies_and_survive_one_dying(service_stack):
    url = service_stack.base_url
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=ALICE, max_retries=0)
    sessions = [AgentSession(url, ALICE, group_id=f"g{i}") for i in range(4)]
    for s in sessions:
        await s.__aenter__()
    try:
        owners = [service_stack.backend_of(s.session_id) for s in sessions]
        assert sorted(owners) == [0, 0, 1, 1]  # least-loaded placement
        victim = owners[0]
        survivor_sessions = [s for s, o in zip(sessions, owners, strict=True) if o != victim]
        doomed = [s for s, o in zip(sessions, owners, strict=True) if o == victim]
        # Streaming goes through the gateway chunk by chunk.
        s0 = survivor_sessions[0]
        stream = await client.chat.completions.create(
            model="m", messages=MSG, max_tokens=6, stream=True, extra_headers=s0.headers
        )
        chunks = [c async for c in stream]
        assert len(chunks) >= 3

        service_stack.proxies[victim].stop()
        with pytest.raises(openai.APIStatusError) as err:
            await client.chat.completions.create(
                model="m", messages=MSG, max_tokens=4, extra_headers=doomed[0].headers
            )
        assert err.value.status_code == 503
        assert "start a new session" in str(err.value)
        await asyncio.sleep(0.5)  # the health probe has failed the other doomed session too
        state = service_stack.gateway.gateway.book.sessions[doomed[1].session_id].state
        assert state == "failed"

        # New sessions land on the survivor and work end to end.
        for _ in range(2):
            async with AgentSession(url, ALICE) as fresh:
                assert service_stack.backend_of(fresh.session_id) != victim
                r = await client.chat.completions.create(model="m", messages=MSG, max_tokens=4)
                assert r.choices[0].message.role == "assistant"
                await fresh.finalize(0.5)
        health = httpx.get(url + "/health").json()
        assert health["backends_healthy"] == 1
    finally:
        for s in reversed(sessions):
            s._deactivate()
            try:
                await s.finalize(status="failed")
            except AgentServiceError:
                pass
            await s._close_async()
    assert service_stack.source.total_failed >= 2


@pytest.mark.slow
async def test_concurrent_sessions_in_one_process_stay_separate(service_stack):
    url = service_stack.base_url
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=BOB, max_retries=0)

    async def agent(i: int) -> tuple[str, list[str]]:
        async with AgentSession(url, BOB, group_id=f"pair-{i // 2}") as s:  # 2 per group
            ids = []
            for turn in range(2):
                r = await client.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": f"Agent {i}, turn {turn}."}],
                    max_tokens=3,
                )
                ids.append(r.id)
                await asyncio.sleep(0)
            await s.set_reward(0.25, ids[0], train=i != 0)  # agent 0: out of the loss
            await s.finalize(float(i))
            return s.session_id, ids

    results = await asyncio.gather(*(agent(i) for i in range(4)))
    source = service_stack.source
    source.batch_size = 2
    batch, stats = as_tensors(await source.rollout_batch(trainer_version=0, timeout=30))
    assert stats["episodes/accepted"] == 4 and stats["groups/accepted"] == 2
    by_session = {e["session_id"]: e for e in episode_dicts(source.last_batch)}
    for i, (sid, ids) in enumerate(results):
        episode = by_session[sid]
        assert sorted(it["id"] for it in episode["interactions"]) == sorted(ids)
        rewards = {it["id"]: it["reward"] for it in episode["interactions"]}
        assert rewards[ids[0]] == 0.25 and rewards[ids[1]] == float(i)
        trained = {it["id"]: it["trained"] for it in episode["interactions"]}
        assert trained == {ids[0]: i != 0, ids[1]: True}
    assert batch["input_ids"].shape[0] == 8  # 4 sessions x 2 completions (individual rows)


def test_sync_session_with_sync_openai_client(service_stack):
    url = service_stack.base_url
    client = openai.OpenAI(base_url=url + "/v1", api_key=ALICE, max_retries=0)
    with AgentSession(url, ALICE, group_id="sync") as s:
        r = client.chat.completions.create(model="m", messages=MSG, max_tokens=3)
        s.set_reward(1.0, completion_id=r.id)
        out = s.finalize()
    assert out["status"] == "ok" and out["num_completions"] == 1
    with AgentSession(url, ALICE, group_id="sync") as s3:
        r = client.chat.completions.create(model="m", messages=MSG, max_tokens=3)
        got = s3.set_reward(0.75, r.id, train=False)
        assert got["completion_id"] == r.id and got["reward"] == 0.75 and got["train"] is False
        assert s3.set_reward(0.75, r.id)["train"] is True
        s3.finalize()
    with pytest.raises(ValueError, match="boom"):
        with AgentSession(url, ALICE, group_id="sync-failed") as s2:
            client.chat.completions.create(model="m", messages=MSG, max_tokens=3)
            raise ValueError("boom")
    assert s2.finalized["status"] == "failed"
    assert service_stack.gateway.gateway.book.sessions[s2.session_id].state == "failed"


@pytest.mark.slow
async def test_anthropic_and_responses_sdks_and_session_scoped_key(service_stack):
    import anthropic

    url = service_stack.base_url
    service_stack.source.n_samples = 1
    async with AgentSession(url, ALICE, group_id="sdks") as s:
        claude = anthropic.AsyncAnthropic(base_url=url, api_key=ALICE, max_retries=0)
        msg = await claude.messages.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": "Hello"}]
        )
        assert msg.role == "assistant" and msg.stop_reason in ("end_turn", "max_tokens")
        oai = openai.AsyncOpenAI(base_url=url + "/v1", api_key=ALICE, max_retries=0)
        resp = await oai.responses.create(model="m", input="Hello", max_output_tokens=4)
        assert resp.output
        # An agent that can only set an API key: USER_KEY:SESSION_ID, no header hook needed.
        s._deactivate()
        keyed = openai.AsyncOpenAI(base_url=url + "/v1", api_key=s.session_api_key, max_retries=0)
        chat = await keyed.chat.completions.create(model="m", messages=MSG, max_tokens=3)
        async with httpx.AsyncClient(timeout=60) as h:  # compatibility endpoints, by hand
            r = await h.post(
                url + "/rl/v1/set_reward",
                json={"completion_id": chat.id, "reward": 2.0},
                headers=bearer(s.session_api_key),
            )
            assert r.status_code == 200, r.text
            r = await h.post(
                url + "/rl/v1/set_reward",
                json={"completion_id": "nope", "reward": 2.0},
                headers=bearer(s.session_api_key),
            )
            assert r.status_code == 404
            r = await h.post(
                url + "/rl/v1/finalize",
                json={"final_reward": 1.0},
                headers=bearer(s.session_api_key),
            )
            assert r.json()["status"] == "ok" and r.json()["num_completions"] == 3
        s.finalized = r.json()
    _, stats = as_tensors(await service_stack.source.rollout_batch(trainer_version=0, timeout=10))
    episode = episode_dicts(service_stack.source.last_batch)[0]
    rewards = {it["id"]: it["reward"] for it in episode["interactions"]}
    assert rewards[chat.id] == 1.0  # 2.0 set on it, replaced by the final 1.0 (the last one)


@pytest.mark.slow
async def test_runner_retries_transient_failures(engine, tokenizer):
    """Quota 429s are transient: the runner backs off and every item still completes."""
    from areal_env_client import AgentRunner, current_session

    stack = make_service_stack(engine, tokenizer, max_sessions_per_key=1, n_samples=2)
    try:
        client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=BOB, max_retries=0)

        async def agent(item: dict) -> float | None:
            r = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": item["q"]}], max_tokens=3
            )
            if item["q"] == "manual":
                await current_session().finalize(0.5)
                return None
            return float(len(r.choices[0].message.content or ""))

        runner = AgentRunner(stack.base_url, BOB)
        items = [{"q": "one"}, {"q": "manual"}]
        results = await runner.run(
            agent, items, concurrency=3, group_size=2, backoff=0.05, max_retries=20, progress=False
        )
        assert all(r.ok for r in results), [r.errors for r in results]
        # some starts were refused (429, one session per key) and waited out: waits, not attempts
        assert max(w for r in results for w in r.waits) >= 1
        assert all(a == 1 for r in results for a in r.attempts)
        assert results[1].rewards == [None, None]
        stack.source.batch_size = 2
        batch, stats = as_tensors(await stack.source.rollout_batch(trainer_version=0, timeout=30))
        assert stats["groups/accepted"] == 2 and stats["groups/incomplete"] == 0
        groups = {e["group_id"] for e in episode_dicts(stack.source.last_batch)}
        assert len(groups) == 2
    finally:
        stack.gateway.stop()
        for p in stack.proxies:
            p.stop()


def test_tls_via_uvicorn_options(engine, tokenizer, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    stack = make_service_stack(engine, tokenizer, ssl_keyfile=str(key), ssl_certfile=str(cert))
    try:
        url = stack.base_url
        assert url.startswith("https://")
        with pytest.raises(httpx.ConnectError):  # not trusted without the certificate
            httpx.get(url + "/health")
        with AgentSession(url, ALICE, verify=str(cert)) as s:
            client = openai.OpenAI(
                base_url=url + "/v1",
                api_key=ALICE,
                max_retries=0,
                http_client=httpx.Client(verify=str(cert)),
            )
            r = client.chat.completions.create(model="m", messages=MSG, max_tokens=3)
            assert r.choices[0].message.role == "assistant"
            assert s.finalize(1.0)["status"] == "ok"
    finally:
        stack.gateway.stop()
        for p in stack.proxies:
            p.stop()


async def test_admission_control_waits_for_the_trainer(engine, tokenizer):
    """New sessions wait while the trainer could not use them within the staleness bound."""
    stack = make_service_stack(
        engine, tokenizer, n_samples=1, batch_size=1, admission=True, admission_timeout=1.0
    )
    try:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as h:
            r = await h.post("/rl/v1/sessions", headers=bearer(ALICE))
            assert r.status_code == 200
            sid = r.json()["session_id"]
            r = await h.post("/rl/v1/sessions", headers=bearer(BOB))  # limit (0+0+1) x 1 x 1
            assert r.status_code == 429 and "in flight" in r.json()["error"]["message"]
            assert (await h.post("/rl/v1/sessions", headers=bearer(BOB))).status_code == 429
            body = {"model": "m", "messages": MSG, "max_tokens": 3}
            r = await h.post("/v1/chat/completions", json=body, headers=bearer(ALICE, sid))
            assert r.status_code == 200
            r = await h.post(
                "/rl/v1/finalize", json={"final_reward": 1.0}, headers=bearer(ALICE, sid)
            )
            assert r.json()["status"] == "ok"
            await stack.source.rollout_batch(trainer_version=0, timeout=30)  # a step trains it
            waiting = asyncio.create_task(h.post("/rl/v1/sessions", headers=bearer(BOB)))
            await asyncio.sleep(0.2)
            assert not waiting.done()  # the step is not over yet
            stack.source.set_version(1)  # now it is
            assert (await waiting).status_code == 200
    finally:
        stack.gateway.stop()
        for p in stack.proxies:
            p.stop()


async def test_backend_that_comes_back_rejoins_the_rotation(engine, tokenizer):
    from areal_env.api.config import ProxyConfig
    from areal_env.proxy.server import ProxyServer

    stack = make_service_stack(engine, tokenizer)
    revived = None
    try:
        gone = stack.proxies[0]
        port, admin_key = gone.port, gone.admin_key
        gone.stop()
        pool = stack.gateway.gateway.book.pool
        for _ in range(100):
            if len(pool.healthy()) == 1:
                break
            await asyncio.sleep(0.05)
        assert [b.base_url for b in pool.healthy()] == [stack.proxies[1].base_url]
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as h:
            r = await h.post("/rl/v1/sessions", headers=bearer(ALICE))
            assert stack.backend_of(r.json()["session_id"]) == 1
            revived = ProxyServer(
                engine, tokenizer, ProxyConfig(port=port, admin_key=admin_key)
            ).start()
            for _ in range(100):
                if len(pool.healthy()) == 2:
                    break
                await asyncio.sleep(0.05)
            assert len(pool.healthy()) == 2
            r = await h.post("/rl/v1/sessions", headers=bearer(ALICE))  # least loaded: proxy 0
            assert stack.backend_of(r.json()["session_id"]) == 0
    finally:
        stack.gateway.stop()
        for p in [*stack.proxies, revived]:
            if p is not None:
                p.stop()
