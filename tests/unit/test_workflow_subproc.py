"""Subprocess mode: sync agents using the plain ``openai`` SDK configured only by environment
variables, against the real proxy; a hanging agent is killed and rejected and the pool recovers."""

from __future__ import annotations

import textwrap
import time

import pytest

from areal_env.api.config import RolloutConfig
from areal_env.workflow.batch import collate
from areal_env.workflow.proxy_workflow import episode_sink
from areal_env.workflow.resolve import resolve_workflow

AGENTS = textwrap.dedent(
    """
    import asyncio
    import os
    import time

    import openai


    class EnvAgent:
        '''Sync agent: no base_url/api_key given, the SDK reads OPENAI_BASE_URL/OPENAI_API_KEY.'''

        def __init__(self, reward=1.0):
            self.reward = reward

        def run(self, data):
            assert os.environ["OPENAI_BASE_URL"] == os.environ["ANTHROPIC_BASE_URL"] + "/v1"
            assert os.environ["ANTHROPIC_API_KEY"] == os.environ["OPENAI_API_KEY"]
            if data.get("hang"):
                time.sleep(3600)
            if data.get("exit"):
                os._exit(3)
            if data.get("fail"):
                raise KeyError("missing-field-in-child")
            client = openai.OpenAI(max_retries=0)
            r = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": data["q"]}], max_tokens=4
            )
            return {r.id: self.reward} if data.get("by_id") else self.reward


    class AsyncEnvAgent:
        async def run(self, data):
            client = openai.AsyncOpenAI(max_retries=0)
            r = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": data["q"]}], max_tokens=4
            )
            await asyncio.sleep(0)
            return 0.5


    class Unpicklable:
        def run(self, data):
            client = openai.OpenAI(max_retries=0)
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            return lambda: 1.0
    """
)


@pytest.fixture
def agents_file(tmp_path):
    path = tmp_path / "agents" / "env_agents.py"
    path.parent.mkdir()
    path.write_text(AGENTS)
    return path


def _resolve(proxy_server, spec, kwargs=None, **rollout_kw):
    rollout = RolloutConfig(n_samples=1, mode="subproc", **rollout_kw)
    return resolve_workflow(
        spec,
        kwargs,
        rollout=rollout,
        proxy_base_url=proxy_server.base_url,
        admin_key=proxy_server.admin_key,
    )


async def test_sync_agent_hanging_agent_and_recovery(proxy_server, engine, agents_file):
    wf = _resolve(
        proxy_server,
        f"{agents_file}:EnvAgent",
        {"reward": 0.75},
        max_concurrent_rollouts=1,
        episode_timeout=60.0,
    )
    try:
        with episode_sink() as sink:
            td = _batch(await wf.arun_episode(engine, {"q": "Say yes.", "task_id": "s1"}))
        assert td is not None and sink[0].accepted, sink[0].error
        assert td["rewards"].tolist() == [0.75] and int(td["loss_mask"].sum()) > 0

        td = _batch(await wf.arun_episode(engine, {"q": "Say no.", "by_id": True}))
        assert td is not None and td["rewards"].tolist() == [0.75]

        with episode_sink() as sink:
            assert await wf.arun_episode(engine, {"q": "x", "fail": True}) is None
        assert sink[0].reason == "agent_error" and "missing-field-in-child" in sink[0].error
        assert wf._pool.killed == 0  # an exception does not cost the worker

        with episode_sink() as sink:
            assert await wf.arun_episode(engine, {"q": "x", "exit": True}) is None
        assert sink[0].reason == "agent_error" and "died" in sink[0].error
        assert wf._pool.killed == 1

        wf.rollout.episode_timeout = 2.0
        t0 = time.monotonic()
        with episode_sink() as sink:
            assert await wf.arun_episode(engine, {"q": "x", "hang": True}) is None
        assert sink[0].reason == "timeout" and time.monotonic() - t0 < 30
        assert wf._pool.killed == 2

        wf.rollout.episode_timeout = 60.0
        with episode_sink() as sink:
            td = _batch(await wf.arun_episode(engine, {"q": "Say ok."}))
        assert td is not None and sink[0].accepted, sink[0].error
        assert wf.stats["accepted"] == 3 and wf.stats["rejected"] == 3
    finally:
        await wf.aclose()


async def test_async_agent_and_pickled_instance(proxy_server, engine, agents_file):
    from areal_env.api.imports import import_string

    wf = _resolve(proxy_server, f"{agents_file}:AsyncEnvAgent", episode_timeout=60.0)
    # an instance (not an import string) travels to the worker by pickle
    cls = import_string(f"{agents_file}:EnvAgent")
    wf2 = _resolve(proxy_server, cls(reward=0.25), episode_timeout=60.0)
    wf3 = _resolve(proxy_server, f"{agents_file}:Unpicklable", episode_timeout=60.0)
    try:
        td = _batch(await wf.arun_episode(engine, {"q": "Hello"}))
        assert td is not None and td["rewards"].tolist() == [0.5]
        assert wf2.agent_import is None
        td = _batch(await wf2.arun_episode(engine, {"q": "Hello"}))
        assert td is not None and td["rewards"].tolist() == [0.25]
        with episode_sink() as sink:
            assert await wf3.arun_episode(engine, {"q": "x"}) is None
        assert sink[0].reason == "bad_reward"
    finally:
        for w in (wf, wf2, wf3):
            await w.aclose()


def _batch(rows):
    """An episode's rows as the trainer gets them (collated), or None when rejected."""
    return None if rows is None else collate(rows)
