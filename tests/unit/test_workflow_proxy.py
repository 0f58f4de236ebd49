"""OpenAIProxyWorkflow (inline mode) against the real proxy and model: reward application, every
rejection path (counted, never raising), grouping, and the executor over the proxy."""

from __future__ import annotations

import asyncio
import logging
import math
import time

import openai
import pytest

from areal_env.api.config import RolloutConfig
from areal_env.workflow.batch import collate
from areal_env.workflow.executor import RolloutExecutor
from areal_env.workflow.proxy_workflow import OpenAIProxyWorkflow, episode_sink
from areal_env.workflow.resolve import resolve_workflow
from tests.fixtures.batches import as_tensors, episode_dicts


def _client(base_url, api_key, http_client):
    return openai.AsyncOpenAI(
        base_url=base_url, api_key=api_key, http_client=http_client, max_retries=0
    )


async def _ask(client, text: str) -> openai.types.chat.ChatCompletion:
    return await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": text}], max_tokens=6
    )


class ReturnAgent:
    """Makes ``calls`` completions, then returns ``value`` (callable(ids) -> value allowed)."""

    def __init__(self, value, calls: int = 1) -> None:
        self.value = value
        self.calls = calls
        self.seen_kwargs: list[set[str]] = []

    async def run(self, data, base_url, api_key, http_client):
        self.seen_kwargs.append({"base_url", "api_key", "http_client"})
        client = _client(base_url, api_key, http_client)
        ids = [(await _ask(client, f"{data['q']} #{i}")).id for i in range(self.calls)]
        return self.value(ids) if callable(self.value) else self.value


class RaisingAgent:
    async def run(self, data, **kw):
        client = _client(kw["base_url"], kw["api_key"], kw["http_client"])
        await _ask(client, "hello")
        raise ValueError("the tool exploded")


class ClosingAgent:
    """Closes the shared http client the way ``async with AsyncOpenAI(...)`` does."""

    async def run(self, data, base_url, api_key, http_client):
        async with _client(base_url, api_key, http_client) as client:
            await _ask(client, "hi")
        return 1.0


class SlowAgent:
    async def run(self, data, base_url, api_key, http_client):
        await _ask(_client(base_url, api_key, http_client), "hi")
        await asyncio.sleep(3600)
        return 1.0


class OnlyDataAgent:
    """Its run() takes no injected keywords: the workflow must not pass any."""

    async def run(self, data):
        return 1.0  # and it makes no model calls -> rejected as no_completions


def _wf(proxy_server, agent, **rollout_kw) -> OpenAIProxyWorkflow:
    return OpenAIProxyWorkflow(
        agent,
        proxy_base_url=proxy_server.base_url,
        admin_key=proxy_server.admin_key,
        rollout=RolloutConfig(n_samples=1, **rollout_kw),
    )


async def test_float_reward_goes_to_last_completion(proxy_server, engine):
    wf = _wf(proxy_server, ReturnAgent(2.0, calls=2))
    with episode_sink() as sink:
        td = _batch(await wf.arun_episode(engine, {"q": "Count", "task_id": "t-7"}))
    (rec,) = sink
    assert rec.accepted and rec.task_id == "t-7" and rec.session_id and rec.reward == 2.0
    assert td["input_ids"].shape[0] == 2 and sorted(td["rewards"].tolist()) == [0.0, 2.0]
    by_id = {i["id"]: i["reward"] for i in rec.interactions}
    last = rec.interactions[-1]["id"]
    assert by_id[last] == 2.0 and [r for k, r in by_id.items() if k != last] in ([None], [0.0])
    assert rec.output_tokens == int(td["loss_mask"].sum()) > 0
    assert rec.min_version == engine.get_version() and len(rec.rows) == 2
    assert td["versions"][td["loss_mask"].bool()].min() >= 0
    assert wf.stats["accepted"] == 1
    await wf.aclose()


async def test_dict_reward_by_completion_id_and_discount(proxy_server, engine):
    agent = ReturnAgent(lambda ids: {ids[0]: 1.0, ids[1]: 0.25}, calls=2)
    wf = _wf(proxy_server, agent, discount=0.5)
    with episode_sink() as sink:
        td = _batch(await wf.arun_episode(engine, {"q": "Hi"}))
    assert sink[0].accepted and isinstance(sink[0].reward, dict)
    by_id = {i["id"]: i["reward"] for i in sink[0].interactions}
    assert sorted(by_id.values()) == [0.25, 1.0]
    assert sorted(td["rewards"].tolist()) == [0.25, 1.0]  # independent calls: no discount flow
    await wf.aclose()


@pytest.mark.parametrize(
    "agent,reason",
    [
        (ReturnAgent("1.0", calls=0), "bad_reward"),
        (ReturnAgent(True, calls=0), "bad_reward"),
        (ReturnAgent(None, calls=0), "bad_reward"),
        (ReturnAgent(math.nan, calls=0), "bad_reward"),
        (ReturnAgent(math.inf, calls=0), "bad_reward"),
        (ReturnAgent({}, calls=0), "bad_reward"),
        (ReturnAgent([1.0], calls=0), "bad_reward"),
        (ReturnAgent({"chatcmpl-unknown": 1.0}), "bad_reward"),
        (ReturnAgent(lambda ids: {ids[0]: "high"}), "bad_reward"),
        (RaisingAgent(), "agent_error"),
        (OnlyDataAgent(), "no_completions"),
    ],
)
async def test_rejections_are_counted_never_raised(proxy_server, engine, agent, reason):
    wf = _wf(proxy_server, agent)
    with episode_sink() as sink:
        assert await wf.arun_episode(engine, {"q": "Hi"}) is None
    (rec,) = sink
    assert not rec.accepted and rec.reason == reason and rec.error
    assert wf.stats["rejected"] == 1 and wf.stats[f"rejected/{reason}"] == 1
    await wf.aclose()


class EarlyRaisingAgent:
    async def run(self, data):
        raise ValueError("failed before any model call")


async def test_traceback_logged_once_per_distinct_error(proxy_server, engine, caplog):
    wf = _wf(proxy_server, EarlyRaisingAgent())
    with caplog.at_level(logging.WARNING, logger="areal_env.workflow.proxy_workflow"):
        for _ in range(3):
            assert await wf.arun_episode(engine, {"q": "x"}) is None
    logged = [r for r in caplog.records if "failed before any model call" in r.getMessage()]
    assert len(logged) == 1
    assert wf.stats["rejected/agent_error"] == 3
    assert "Traceback" in logged[0].getMessage()
    await wf.aclose()


async def test_inline_timeout_rejects(proxy_server, engine):
    wf = _wf(proxy_server, SlowAgent(), episode_timeout=1.0)
    t0 = time.monotonic()
    with episode_sink() as sink:
        assert await wf.arun_episode(engine, {"q": "x"}) is None
    assert time.monotonic() - t0 < 15
    assert sink[0].reason == "timeout" and wf.stats["rejected/timeout"] == 1
    await wf.aclose()


async def test_agent_closing_the_shared_client_does_not_break_others(proxy_server, engine):
    wf = _wf(proxy_server, ClosingAgent())
    for _ in range(2):
        assert await wf.arun_episode(engine, {"q": "x"}) is not None
    await wf.aclose()


async def test_only_accepted_kwargs_are_injected():
    agent = OnlyDataAgent()
    from areal_env.workflow.proxy_workflow import accepted_kwargs

    cand = {"base_url": 1, "api_key": 2, "http_client": 3}
    assert accepted_kwargs(agent.run, cand) == {}
    assert accepted_kwargs(ReturnAgent(1.0).run, cand) == cand
    assert accepted_kwargs(RaisingAgent().run, cand) == cand

    async def partial(data, *, api_key):
        return 0

    assert accepted_kwargs(partial, cand) == {"api_key": 2}


class FlakyAgent:
    """Members 1 and 3 of each group fail; the others reward by the length of the answer."""

    def __init__(self) -> None:
        self.n = 0

    async def run(self, data, base_url, api_key, http_client):
        i = self.n
        self.n += 1
        r = await _ask(_client(base_url, api_key, http_client), data["q"])
        if i % 4 in (1, 3):
            raise RuntimeError("flaky member")
        return float(len(r.choices[0].message.content or "") > 0)


async def test_executor_over_proxy_grouped_with_partial_rejection(proxy_server, engine):
    rollout = RolloutConfig(n_samples=4, batch_size=2, max_concurrent_rollouts=4)
    wf = resolve_workflow(
        FlakyAgent,
        rollout=rollout,
        proxy_base_url=proxy_server.base_url,
        admin_key=proxy_server.admin_key,
    )
    ex = RolloutExecutor(
        engine,
        wf,
        rollout,
        proxy_base_url=proxy_server.base_url,
        admin_key=proxy_server.admin_key,
        show_progress=False,
    )
    assert ex.uses_proxy and ex.sessions_per_group == 4 and ex.max_running_groups == 1
    version = engine.get_version()
    batch, stats = as_tensors(
        await ex.rollout_batch(
            [{"q": "Name a color.", "task_id": "a"}, {"q": "Name a fruit.", "task_id": "b"}],
            trainer_version=version,
        )
    )
    await ex.aclose()
    assert stats["episodes/accepted"] == 4 and stats["episodes/rejected"] == 4
    assert stats["rejected/agent_error"] == 4 and stats["groups/accepted"] == 2
    assert batch["group_ids"].unique().tolist() == [0, 1]
    assert batch["traj_ids"].unique().numel() == 4
    assert stats["staleness/max"] == 0 and stats["tokens/output"] > 0
    assert stats["tool_parse_failures"] == 0
    assert {e["task_id"] for e in episode_dicts(ex.last_batch)} == {"a", "b"}
    assert all(e["session_id"] for e in episode_dicts(ex.last_batch))
    accepted = [e for e in episode_dicts(ex.last_batch) if e["accepted"]]
    assert all(
        e["interactions"] and e["interactions"][0].get("completion_text") is not None
        for e in accepted
    )


async def test_executor_grants_capacity_to_a_managed_proxy(engine):
    """With ``initial_capacity=0`` sessions start only after the executor grants capacity."""
    from areal_env.api.config import ProxyConfig
    from areal_env.proxy.server import ProxyServer

    server = ProxyServer(
        engine, engine.tokenizer, ProxyConfig(initial_capacity=0, default_max_tokens=8)
    ).start()
    try:
        rollout = RolloutConfig(n_samples=2, batch_size=2, max_concurrent_rollouts=4)
        # without a grant the proxy refuses the session: rejected (proxy_error), not raised
        direct = _wf(server, ReturnAgent(1.0))
        with episode_sink() as sink:
            assert await direct.arun_episode(engine, {"q": "hi"}) is None
        assert sink[0].reason == "proxy_error" and "429" in sink[0].error
        await direct.aclose()

        wf = resolve_workflow(
            ReturnAgent(1.0),
            rollout=rollout,
            proxy_base_url=server.base_url,
            admin_key=server.admin_key,
        )
        ex = RolloutExecutor(
            engine,
            wf,
            rollout,
            proxy_base_url=server.base_url,
            admin_key=server.admin_key,
            show_progress=False,
        )
        batch, stats = as_tensors(
            await ex.rollout_batch(
                [{"q": "One"}, {"q": "Two"}], trainer_version=engine.get_version()
            )
        )
        await ex.aclose()
        assert stats["episodes/accepted"] == 4 and stats["episodes/rejected"] == 0
        assert batch["input_ids"].shape[0] == 4
    finally:
        server.stop()


@pytest.mark.slow
async def test_prefetch_over_proxy_respects_staleness(proxy_server, engine):
    """Background prefetch with k=1 on the real engine: output versions come from the engine,
    and no consumed trajectory is more than one version old."""
    rollout = RolloutConfig(
        n_samples=1, batch_size=1, max_head_offpolicyness=1, max_concurrent_rollouts=2
    )
    wf = resolve_workflow(
        ReturnAgent(1.0),
        rollout=rollout,
        proxy_base_url=proxy_server.base_url,
        admin_key=proxy_server.admin_key,
    )
    ex = RolloutExecutor(
        engine,
        wf,
        rollout,
        proxy_base_url=proxy_server.base_url,
        admin_key=proxy_server.admin_key,
        show_progress=False,
    )
    v0 = engine.get_version()
    try:
        ex.feed({"q": f"Say {i}."} for i in range(10))
        seen = []
        for step in range(3):
            batch, stats = as_tensors(await ex.next_batch(trainer_version=v0 + step))
            assert batch is not None and stats["staleness/max"] <= 1
            seen.append(stats["staleness/max"])
            for e in episode_dicts(ex.last_batch):
                assert e["start_version"] >= v0 + step - 1
                assert e["min_version"] >= v0 + step - 1
            engine.set_version(v0 + step + 1)
            ex.set_version(v0 + step + 1)
        assert ex.peak_running_groups <= 2
    finally:
        await ex.aclose()
        engine.set_version(v0)


def _batch(rows):
    """An episode's rows as the trainer gets them (collated), or None when rejected."""
    return None if rows is None else collate(rows)
