"""Where users stop, restart and wait: the real gateway over two real proxies (scripted engine,
no model) with the staleness-bounded admission of ``serve-training``.

- a session request waiting for admission when the service stops is answered 503 with
  ``Retry-After`` (never 500), and a plain ``AgentSession`` waits it out and opens its session
  on the restarted service, counted as waits, not attempts;
- ``AgentSession`` waits out 429 while the trainer's staleness bound is full;
- once training is finished, new sessions and late finalizes get 410 ``training_finished``;
- a member of a group that already trained is refused 409 ``group_closed``;
- ``rewarded`` is true after ``finalize(final_reward)``.
"""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
from areal_env_client import AgentRunner, AgentServiceError, AgentSession, RetryBudget

from areal_env.engine.testing import ScriptedEngine
from tests.fixtures.service import SERVICE_USER_KEYS, ServiceStack, make_service_stack

ALICE = SERVICE_USER_KEYS[0]
QUESTION = {"model": "m", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stack(tokenizer, **kw) -> ServiceStack:
    kw = {"n_samples": 2, "batch_size": 1, "admission": True, "admission_timeout": 30.0, **kw}
    return make_service_stack(ScriptedEngine(tokenizer, default="Hi."), tokenizer, **kw)


def _stop(stack: ServiceStack) -> None:
    stack.gateway.stop()
    for p in stack.proxies:
        p.stop()
    stack.source.close()


async def _episode(url: str, group: str, reward: float = 1.0) -> AgentSession:
    async with AgentSession(url, ALICE, group_id=group) as session:
        async with httpx.AsyncClient(timeout=30) as h:  # tagged with the session by the hook
            r = await h.post(url + "/v1/chat/completions", json=QUESTION, headers=_key())
            r.raise_for_status()
        await session.finalize(reward)
    return session


def _key() -> dict[str, str]:
    return {"Authorization": f"Bearer {ALICE}"}


async def test_a_stop_answers_waiting_session_requests_503_and_agents_wait_for_the_restart(
    tokenizer,
):
    port = _free_port()
    stack = _stack(tokenizer, port=port, drain_retry_after=1.0)
    url = stack.base_url
    try:
        await _episode(url, "a")  # group a holds the only admission slot (2 x 1 x 1)
        async with httpx.AsyncClient(timeout=60) as h:
            waiting = asyncio.create_task(
                h.post(url + "/rl/v1/sessions", json={"group_id": "b"}, headers=_key())
            )
            budget = RetryBudget(retry_for=60.0, backoff=0.2, max_backoff=1.0)
            agent = AgentSession(url, ALICE, group_id="c", retry=budget)
            entering = asyncio.create_task(agent.__aenter__())
            await asyncio.sleep(0.5)
            assert not waiting.done() and not entering.done()  # both wait for admission
            stack.gateway.drain()  # Ctrl-C: no new sessions ...
            stack.source.close()  # ... and the trainer stops taking batches
            r = await asyncio.wait_for(waiting, 10)
            assert r.status_code == 503, r.text
            assert float(r.headers["retry-after"]) == 1.0
            assert "shutting down" in r.json()["error"]["message"]
            r = await h.post(url + "/rl/v1/sessions", json={"group_id": "d"}, headers=_key())
            assert r.status_code == 503 and "retry-after" in r.headers
            await asyncio.sleep(1.5)
            assert not entering.done()  # the plain AgentSession waits for the restart
            _stop(stack)
            await asyncio.sleep(1.0)  # down: connections are refused
            stack = _stack(tokenizer, port=port)  # the restart (a fresh store: nothing to reload)
            await asyncio.wait_for(entering, 30)
            assert agent.session_id is not None and budget.waits >= 2
            assert budget.failures == 0  # waits are not failed attempts
            await agent.__aexit__(None, None, None)  # no reward: finalized as failed
    finally:
        _stop(stack)


async def test_agent_session_waits_out_a_full_staleness_bound(tokenizer):
    stack = _stack(tokenizer, admission_timeout=0.3)
    url = stack.base_url
    try:
        first = await _episode(url, "a", reward=1.0)
        busy = RetryBudget(patience=30.0, backoff=0.1, max_backoff=0.3)
        opening = asyncio.create_task(
            AgentSession(url, ALICE, group_id="b", retry=busy).__aenter__()
        )
        await asyncio.sleep(1.0)
        assert not opening.done() and busy.waits >= 1  # 429s, waited out
        await _episode(url, "a", reward=0.0)  # a's second member: admitted at once
        await stack.source.rollout_batch(trainer_version=0, step=1, timeout=10)
        await stack.source.rollout_batch(trainer_version=0, step=2, timeout=0.01)  # step 1 over
        session = await asyncio.wait_for(opening, 30)
        assert session.session_id is not None
        no_wait = RetryBudget(patience=0.0)  # a and b fill the bound again
        with pytest.raises(AgentServiceError) as e:
            async with AgentSession(url, ALICE, group_id="e", retry=no_wait):
                pass
        assert e.value.status_code == 429 and e.value.retry_after is not None
        await session.__aexit__(None, None, None)
        async with httpx.AsyncClient(timeout=30) as h:
            sid = first.session_id
            r = await h.get(f"{url}/rl/v1/sessions/{sid}", headers=_key())
            assert r.json()["rewarded"] is True  # finalize(final_reward) rewarded it
    finally:
        _stop(stack)


async def test_a_group_that_trained_takes_no_more_members(tokenizer):
    stack = _stack(tokenizer, admission=False)
    url = stack.base_url
    try:
        late = AgentSession(url, ALICE, group_id="g")
        await late.__aenter__()  # a member that will finalize after its group trained
        await _episode(url, "g")
        stack.source.group_timeout = 0.0  # g waited long enough: used with 1 of 2
        stats = (await stack.source.rollout_batch(trainer_version=0, step=1, timeout=10)).stats
        assert stats["groups/incomplete"] == 1
        async with httpx.AsyncClient(timeout=30) as h:
            r = await h.post(url + "/rl/v1/sessions", json={"group_id": "g"}, headers=_key())
            assert r.status_code == 409 and r.json()["error"]["code"] == "group_closed"
            assert "trained at step 1" in r.json()["error"]["message"]
            headers = {**_key(), "X-Areal-Session": late.session_id}
            r = await h.post(url + "/v1/chat/completions", json=QUESTION, headers=headers)
            assert r.status_code == 200
        with pytest.raises(AgentServiceError) as e:
            await late.finalize(1.0)
        assert e.value.status_code == 409 and "new group_id" in e.value.message
        await late.__aexit__(None, None, None)  # the service failed it: adopted, not sent
        assert stack.source.num_pending_trajectories == 0  # no group of one
    finally:
        _stop(stack)


async def test_after_the_last_step_sessions_are_told_training_is_finished(tokenizer):
    stack = _stack(tokenizer, admission=False)
    url = stack.base_url
    try:
        open_one = AgentSession(url, ALICE, group_id="x")
        await open_one.__aenter__()
        async with httpx.AsyncClient(timeout=30) as h:
            headers = {**_key(), "X-Areal-Session": open_one.session_id}
            assert (
                await h.post(url + "/v1/chat/completions", json=QUESTION, headers=headers)
            ).is_success
            stack.gateway.drain(finished="3 of trainer.total_train_steps=3 steps")
            stack.source.close()
            r = await h.post(url + "/rl/v1/sessions", json={"group_id": "y"}, headers=_key())
            assert r.status_code == 410 and r.json()["error"]["code"] == "training_finished"
        with pytest.raises(AgentServiceError) as e:
            await open_one.finalize(1.0)  # would never be trained: not acknowledged
        assert e.value.status_code == 410
        await open_one.__aexit__(None, None, None)
        with pytest.raises(AgentServiceError) as e:  # not retried: it will not come back
            async with AgentSession(url, ALICE, group_id="z"):
                pass
        assert e.value.status_code == 410

        async def agent(item: dict) -> float:
            raise AssertionError("no session should open")

        runner = AgentRunner(url, ALICE).run(agent, [{"q": 1}], group_size=2, progress=False)
        (result,) = await asyncio.wait_for(runner, 30)  # gives up at once, not after retry_for
        assert result.attempts == [0, 0] and result.waits == [0, 0]
        assert all("training is finished" in (err or "") for err in result.errors)
    finally:
        _stop(stack)


async def test_runner_counts_busy_waits_apart_from_attempts(tokenizer):
    stack = _stack(tokenizer, admission_timeout=0.2)
    url = stack.base_url
    try:
        await _episode(url, "a")  # group a holds the bound (one group) until step 1 is over

        async def agent(item: dict) -> float:
            async with httpx.AsyncClient(timeout=30) as h:
                r = await h.post(url + "/v1/chat/completions", json=QUESTION, headers=_key())
                r.raise_for_status()
            return 1.0

        runner = asyncio.create_task(
            AgentRunner(url, ALICE).run(
                agent, [{"q": 1}], group_size=2, progress=False, backoff=0.1, max_backoff=0.3
            )
        )
        await asyncio.sleep(1.0)
        assert not runner.done()  # 429s: the bound is full
        await _episode(url, "a")
        await stack.source.rollout_batch(trainer_version=0, step=1, timeout=10)
        await stack.source.rollout_batch(trainer_version=0, step=2, timeout=0.01)  # step 1 over
        (result,) = await asyncio.wait_for(runner, 30)
        assert result.ok, result.errors
        assert result.attempts == [1, 1]  # one episode each: the 429s are no attempts
        assert sum(result.waits) >= 2
    finally:
        _stop(stack)
