"""Several real aenvironment servers at once (RUN_AENV_INTEGRATION=1)."""

from __future__ import annotations

import asyncio

import pytest

from areal_env.envs.aenv.adapter import AenvEnvironmentAdapter
from areal_env.envs.base import EnvToolCallError
from areal_env.envs.episode import EnvironmentPool

pytestmark = pytest.mark.integration


async def test_several_environments_concurrently(aenv_server_factory, aenv_config):
    launcher = aenv_server_factory(3)
    assert len(set(launcher.hosts)) == 3
    pool = EnvironmentPool(aenv_config, launcher.urls)
    used: list[str] = []

    async def episode(i: int) -> str:
        async with pool.adapter() as env:
            used.append(env.config.aenv_url)
            tools, name_map = await env.openai_tools()
            assert set(name_map) == {"add", "subtract", "multiply", "divide"}
            total = 0
            for k in range(5):
                total = int((await env.call_tool("add", {"a": total, "b": i + k})).text)
            return str(total)

    results = await asyncio.gather(*(episode(i) for i in range(9)))
    assert results == [str(sum(i + k for k in range(5))) for i in range(9)]
    assert sorted(used.count(u) for u in launcher.urls) == [3, 3, 3]  # spread evenly
    assert set(pool._busy.values()) == {0}


async def test_one_server_dies_others_unaffected(aenv_server_factory, aenv_config):
    launcher = aenv_server_factory(2)
    cfgs = [aenv_config.new(aenv_url=u, max_retries=1) for u in launcher.urls]
    async with AenvEnvironmentAdapter(cfgs[0]) as a, AenvEnvironmentAdapter(cfgs[1]) as b:
        assert (await a.call_tool("add", {"a": 1, "b": 1})).text == "2"
        launcher.stop_server(0, kill=True)
        with pytest.raises(EnvToolCallError):
            await a.call_tool("add", {"a": 1, "b": 1})
        assert (await b.call_tool("multiply", {"a": 3, "b": 4})).text == "12"
