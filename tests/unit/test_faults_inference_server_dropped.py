"""Issue 11: one of two inference servers SIGKILLed while a rollout is running.

Two real ``areal-env serve`` processes (SGLang's protocol; a scripted engine, so each generation
takes a known 0.3 s and the kill lands mid-rollout), the real ``SGLangEngine`` routing between
them, the real proxy, ``RolloutExecutor`` and an openai-SDK agent of 3 turns per episode. What
happens, and what this test holds:

- the kill lands after every session's first turn (each session is bound to its server) while
  the victim generates later turns: those sessions get a 503 from the proxy and their episodes
  are rejected and counted (``episodes/rejected``), NOT retried; the live server's episodes
  finish; the batch returns with every episode accounted (a fresh session's first request would
  fail over to the live server instead);
- the weight update after the rollout drops the dead server by address (it missed the update,
  so it must never serve again) and succeeds on the other one: the step completes;
- the next rollout runs only on the surviving server, at the new version, with no rejection.
"""

from __future__ import annotations

import asyncio

import pytest
from openai import AsyncOpenAI

from areal_env.api.config import ProxyConfig, RolloutConfig
from areal_env.engine.sglang import SGLangEngine
from areal_env.http.net import bind_socket
from areal_env.proxy.server import ProxyServer
from tests.fixtures.batches import episode_dicts
from tests.fixtures.proxy import proxy_executor
from tests.unit.test_faults_inference_server import _kill, _start

TURNS = 3
FIRST_TURNS_DONE: list[str] = []


class ThreeTurnAgent:
    async def run(self, data, *, base_url, api_key, http_client=None, **_):
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client)
        messages = [{"role": "user", "content": data["prompt"]}]
        for _ in range(TURNS):
            r = await client.chat.completions.create(
                model="m", messages=messages, max_tokens=8, temperature=1.0
            )
            messages += [{"role": "assistant", "content": r.choices[0].message.content}]
            messages += [{"role": "user", "content": "And then?"}]
            if len(messages) == 3:
                FIRST_TURNS_DONE.append(data["id"])
        return 1.0


def _free_port() -> int:
    s = bind_socket("127.0.0.1", 0)
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_killed_server_is_dropped_and_training_goes_on(tokenizer, tmp_path):
    ports = [_free_port(), _free_port()]
    procs = [_start(p, delay=0.3) for p in ports]
    addrs = [f"127.0.0.1:{p}" for p in ports]
    victim = addrs[1]
    eng = SGLangEngine(addrs, max_retries=2, retry_backoff=0.1, down_cooldown=600)
    weights = tmp_path / "weights-v1"
    weights.mkdir()  # `areal-env serve` on a scripted engine checks only that it is a folder
    try:
        eng.initialize()
        proxy = ProxyServer(eng, tokenizer, ProxyConfig(default_max_tokens=8), model_name="m")
        with proxy:
            rollout = RolloutConfig(n_samples=2, batch_size=4, max_concurrent_rollouts=8)
            ex = proxy_executor(eng, ThreeTurnAgent(), rollout, proxy)
            items = [{"id": f"t{i}", "prompt": f"Tell me about {i}."} for i in range(8)]

            async def first_batch():
                task = asyncio.create_task(ex.rollout_batch(items[:4], trainer_version=0))
                # every session is bound to its server (its first turn done) and the victim is
                # generating later turns: kill it now
                while len(FIRST_TURNS_DONE) < 8 or eng.servers.router.inflight.get(victim, 0) == 0:
                    assert not task.done()
                    await asyncio.sleep(0.02)
                await asyncio.to_thread(_kill, procs[1])
                return await task

            stats = asyncio.run(first_batch()).stats
            episodes = episode_dicts(ex.last_batch)
            assert len(episodes) == 8  # every episode accounted: accepted or rejected
            assert stats["episodes/accepted"] + stats["episodes/rejected"] == 8
            assert stats["episodes/accepted"] >= 1, stats  # the live server's episodes finished
            rejected = [e for e in episodes if not e["accepted"]]
            assert rejected, stats  # the victim's sessions could not go on: rejected, counted
            for e in rejected:  # each names why: the engine was unavailable (proxy 503)
                assert e["reason"] and "503" in str(e.get("error")), e
            assert eng.servers.router.up() == 1  # the victim is marked down for new sessions

            # the step's weight update: the dead server is dropped by address, the step completes
            eng.update_weights(str(weights))
            assert eng.dropped == [victim] and eng.addresses == [addrs[0]]
            assert eng.get_version() == 1
            assert eng.stats()["servers_dropped"] == 1.0

            # the next rollout runs on the survivor only, at the new version, nothing rejected
            stats2 = asyncio.run(ex.rollout_batch(items[4:], trainer_version=1)).stats
            assert stats2["episodes/accepted"] == 8 and stats2["episodes/rejected"] == 0, stats2
            versions = {(e["min_version"], e["max_version"]) for e in episode_dicts(ex.last_batch)}
            assert versions == {(1, 1)}, versions
            asyncio.run(ex.aclose())
    finally:
        eng.destroy()
        for p in procs:
            if p.poll() is None:
                _kill(p)
