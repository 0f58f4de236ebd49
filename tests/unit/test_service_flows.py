"""The service's client flows on the real model: the seed's aiohttp agent inside
``AgentSession``, session-scoped URLs, raw set_reward/finalize seen by the block's exit, token
quotas and key administration, the sampling cap, draining, and a gateway restart on its store."""

from __future__ import annotations

import asyncio
import os

import aiohttp
import httpx
import openai
import pytest
from areal_env_client import SESSION_HEADER, AgentSession

from areal_env.service.sessions import RESTARTED
from areal_env.service.store import open_store
from tests.fixtures.batches import as_tensors, episode_dicts
from tests.fixtures.service import SERVICE_USER_KEYS, make_service_stack

ALICE, BOB = SERVICE_USER_KEYS
QUESTION = [{"role": "user", "content": "Say hi."}]


def stop(stack) -> None:
    stack.gateway.stop()
    for p in stack.proxies:
        p.stop()
    stack.source.close()


async def seed_agent(base_url: str, key: str, *, finalize: bool = True) -> str:
    """The seed document's agent: aiohttp posts a chat completion, rewards it and finalizes,
    against ``base_url`` (the only thing changed)."""
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{base_url}/v1/chat/completions",
            json={"model": "policy", "messages": QUESTION, "max_tokens": 4},
            headers=headers,
        ) as resp:
            assert resp.status == 200, await resp.text()
            reply = await resp.json()
        async with http.post(
            f"{base_url}/rl/v1/set_reward",
            json={"completion_id": reply["id"], "reward": 1.0},
            headers=headers,
        ) as resp:
            assert resp.status == 200, await resp.text()
        if finalize:
            async with http.post(f"{base_url}/rl/v1/finalize", json={}, headers=headers) as resp:
                assert resp.status == 200, await resp.text()
    return reply["id"]


async def test_seed_aiohttp_flow_inside_agent_session(engine, tokenizer):
    """Plain URL (the hook tags aiohttp) or the session URL; raw finalize, or raw set_reward
    only: each block exits cleanly, concurrently, and each episode is grouped and rewarded."""
    stack = make_service_stack(engine, tokenizer, n_samples=4, batch_size=1)
    try:
        url = stack.base_url

        async def episode(via_url: bool, finalize: bool) -> AgentSession:
            async with AgentSession(url, ALICE, group_id="seed", set_env=False) as s:
                await seed_agent(s.session_url if via_url else url, ALICE, finalize=finalize)
            return s

        sessions = await asyncio.gather(
            episode(False, True), episode(False, False), episode(True, True), episode(True, False)
        )
        assert [s.finalized["status"] for s in sessions] == ["ok"] * 4
        _, stats = as_tensors(await stack.source.rollout_batch(trainer_version=0, timeout=30))
        assert stats["groups/accepted"] == 1 and stats["episodes/accepted"] == 4
        episodes = episode_dicts(stack.source.last_batch)
        assert {e["session_id"] for e in episodes} == {s.session_id for s in sessions}
        assert all(e["interactions"][-1]["reward"] == 1.0 for e in episodes)
        assert stack.gateway.gateway.book.counters["sessions_failed"] == 0
    finally:
        stop(stack)


async def test_session_url_in_env_reaches_the_session_from_any_client(engine, tokenizer):
    stack = make_service_stack(engine, tokenizer, n_samples=1)
    before = os.environ.get("OPENAI_BASE_URL")
    try:
        async with AgentSession(stack.base_url, ALICE) as s:
            assert os.environ["OPENAI_BASE_URL"] == f"{stack.base_url}/s/{s.session_id}/v1"
            sdk = openai.AsyncOpenAI(api_key=ALICE, max_retries=0)  # reads OPENAI_BASE_URL
            reply = await sdk.chat.completions.create(model="m", messages=QUESTION, max_tokens=3)
            async with httpx.AsyncClient() as raw:  # no hook involved: the URL names it
                r = await raw.post(
                    os.environ["AREAL_SESSION_URL"] + "/rl/v1/set_reward",
                    json={"reward": 0.5},
                    headers={"Authorization": f"Bearer {ALICE}"},
                )
                assert r.status_code == 200 and r.json()["session_id"] == s.session_id
                r = await raw.get(
                    os.environ["AREAL_SESSION_URL"] + "/rl/v1/session",
                    headers={"Authorization": f"Bearer {ALICE}"},
                )
                assert r.json()["rewarded"] is True and r.json()["state"] == "open"
        assert os.environ.get("OPENAI_BASE_URL") == before  # restored after the block
        assert s.finalized["status"] == "ok"
        await stack.source.rollout_batch(trainer_version=0, timeout=30)
        (episode,) = episode_dicts(stack.source.last_batch)
        assert episode["interactions"][-1]["id"] == reply.id
        assert episode["interactions"][-1]["reward"] == 0.5
        # A session URL of another user's session is refused like any other way of naming it.
        async with httpx.AsyncClient() as raw:
            r = await raw.post(
                f"{stack.base_url}/s/{s.session_id}/v1/chat/completions",
                json={"model": "m", "messages": QUESTION},
                headers={"Authorization": f"Bearer {BOB}"},
            )
            assert r.status_code == 404
    finally:
        stop(stack)


async def test_token_quotas_and_key_administration(engine, tokenizer):
    stack = make_service_stack(engine, tokenizer, n_samples=1)
    admin = {"Authorization": f"Bearer {stack.gateway.admin_key}"}
    try:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=60) as h:
            r = await h.post(
                "/admin/keys", json={"name": "tpm", "tokens_per_minute": 10}, headers=admin
            )
            tpm_key, tpm_id = r.json()["api_key"], r.json()["key_id"]
            r = await h.post("/admin/keys", json={"name": "total", "max_tokens": 10}, headers=admin)
            total_key = r.json()["api_key"]
            assert (
                await h.post("/admin/keys", json={"max_tokens": 0}, headers=admin)
            ).status_code == 400

            for key, message in ((tpm_key, "in the last minute"), (total_key, "used its 10")):
                auth = {"Authorization": f"Bearer {key}"}
                sid = (await h.post("/rl/v1/sessions", headers=auth)).json()["session_id"]
                body = {"model": "m", "messages": QUESTION, "max_tokens": 2}
                ok = await h.post(
                    "/v1/chat/completions", json=body, headers={**auth, SESSION_HEADER: sid}
                )
                assert ok.status_code == 200  # the first call is allowed; it uses > 10 tokens
                refused = await h.post(
                    "/v1/chat/completions", json=body, headers={**auth, SESSION_HEADER: sid}
                )
                assert refused.status_code == 429, refused.text
                assert message in refused.json()["error"]["message"]
                assert refused.json()["error"]["type"] == "rate_limit_error"
                r = await h.post("/rl/v1/sessions", headers=auth)
                assert r.status_code == 429
                if key == tpm_key:
                    assert 1 <= int(refused.headers["retry-after"]) <= 60

            keys = {
                k["key_id"]: k for k in (await h.get("/admin/keys", headers=admin)).json()["keys"]
            }
            usage = keys[tpm_id]
            assert (
                usage["tokens_used"] == ok.json()["usage"]["total_tokens"]
                or usage["tokens_used"] > 10
            )
            assert usage["tokens_last_minute"] >= 10 and usage["open_sessions"] == 1
            assert (
                await h.get("/admin/keys", headers={"Authorization": f"Bearer {ALICE}"})
            ).status_code == 401
            r = await h.delete(f"/admin/keys/{tpm_id}", headers=admin)
            assert r.status_code == 200 and r.json()["revoked"] is True
            r = await h.post("/rl/v1/sessions", headers={"Authorization": f"Bearer {tpm_key}"})
            assert r.status_code == 401
            assert (await h.delete("/admin/keys/nope", headers=admin)).status_code == 404
    finally:
        stop(stack)


async def test_sampling_is_capped_by_the_trainer(engine, tokenizer):
    stack = make_service_stack(engine, tokenizer, n_samples=1, max_new_tokens=3)
    try:
        async with AgentSession(stack.base_url, ALICE) as s:
            sdk = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=ALICE, max_retries=0)
            asked = await sdk.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "Write a long story about a dragon."}],
                max_tokens=300,
            )
            unset = await sdk.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Write a long poem."}]
            )
            assert asked.usage.completion_tokens <= 3 and unset.usage.completion_tokens <= 3
            await s.finalize(1.0)
    finally:
        stop(stack)


async def test_drain_refuses_new_sessions_and_keeps_what_open_ones_finish(
    engine, tokenizer, tmp_path
):
    store = open_store(str(tmp_path / "service.db"))
    stack = make_service_stack(engine, tokenizer, n_samples=2, store=store)
    try:
        url = stack.base_url
        sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key=ALICE, max_retries=0)
        async with AgentSession(url, ALICE, group_id="late") as s:
            await sdk.chat.completions.create(model="m", messages=QUESTION, max_tokens=3)
            stack.gateway.drain()
            stack.source.close()  # the trainer stopped taking batches
            async with httpx.AsyncClient() as h:
                r = await h.post(
                    url + "/rl/v1/sessions", headers={"Authorization": f"Bearer {BOB}"}
                )
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
            assert "shutting down" in r.json()["error"]["message"]
            await s.finalize(1.0)  # still acknowledged: it is in the store for the next start
        assert s.finalized["status"] == "ok"
        (kept,) = store.pending_trajectories()
        assert kept.session_id == s.session_id and kept.group_key == "late"
    finally:
        stop(stack)


async def test_without_a_store_a_finalize_during_shutdown_is_a_retryable_503(engine, tokenizer):
    stack = make_service_stack(engine, tokenizer, n_samples=2)
    try:
        sdk = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=ALICE, max_retries=0)
        async with AgentSession(stack.base_url, ALICE) as s:
            await sdk.chat.completions.create(model="m", messages=QUESTION, max_tokens=3)
            stack.source.close()
            with pytest.raises(Exception) as err:
                await s.finalize(1.0)
            assert err.value.status_code == 503 and err.value.retry_after is not None
    finally:
        stop(stack)


async def test_gateway_restart_keeps_keys_sessions_and_acknowledged_trajectories(
    engine, tokenizer, tmp_path
):
    db = str(tmp_path / "service.db")
    admin_key = "admin-of-the-test"
    stack = make_service_stack(
        engine, tokenizer, n_samples=2, store=open_store(db), admin_key=admin_key
    )
    admin = {"Authorization": f"Bearer {admin_key}"}
    async with httpx.AsyncClient(timeout=60) as h:
        r = await h.post(stack.base_url + "/admin/keys", json={"name": "carol"}, headers=admin)
        carol = r.json()["api_key"]
    sdk = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=carol, max_retries=0)
    done = AgentSession(stack.base_url, carol, group_id="g")
    async with done:
        await sdk.chat.completions.create(model="m", messages=QUESTION, max_tokens=3)
        await done.finalize(1.0)
    left_open = AgentSession(stack.base_url, carol, group_id="g")
    await left_open.__aenter__()
    left_open._deactivate()
    stop(stack)
    stack.source.store.close()

    store = open_store(db)
    stack = make_service_stack(engine, tokenizer, n_samples=2, store=store, admin_key=admin_key)
    try:
        assert stack.source.load(0) == 1  # the acknowledged trajectory is back
        url = stack.base_url
        async with httpx.AsyncClient(base_url=url, timeout=60) as h:
            auth = {"Authorization": f"Bearer {carol}"}
            r = await h.get(f"/rl/v1/sessions/{done.session_id}", headers=auth)
            assert r.status_code == 200 and r.json()["state"] == "done"
            r = await h.get(f"/rl/v1/sessions/{left_open.session_id}", headers=auth)
            assert r.json()["state"] == "failed" and r.json()["error"] == RESTARTED
            r = await h.post(
                "/v1/chat/completions",
                json={"model": "m", "messages": QUESTION},
                headers={**auth, SESSION_HEADER: left_open.session_id},
            )
            assert r.status_code == 410 and "start a new session" in r.json()["error"]["message"]
            r = await h.post(
                "/rl/v1/finalize",
                json={"status": "failed"},
                headers={**auth, SESSION_HEADER: left_open.session_id},
            )
            assert r.status_code == 200 and r.json()["status"] == "failed"
        # The issued key still works: the group fills and is trained on.
        sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key=carol, max_retries=0)
        async with AgentSession(url, carol, group_id="g") as s:
            await sdk.chat.completions.create(model="m", messages=QUESTION, max_tokens=3)
            await s.finalize(0.0)
        _, stats = as_tensors(
            await stack.source.rollout_batch(trainer_version=0, step=1, timeout=30)
        )
        assert stats["episodes/accepted"] == 2
        assert {e["session_id"] for e in episode_dicts(stack.source.last_batch)} == {
            done.session_id,
            s.session_id,
        }
    finally:
        stop(stack)
        store.close()
