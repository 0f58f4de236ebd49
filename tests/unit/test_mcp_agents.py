"""The same agents on any MCP server: AenvAgent, the Agents SDK RunnerAgent and the plain SDK
ResponsesAgent, each with ``mcp_config`` + ``reward_fn``, through the real proxy on a scripted
engine (no model) and real MCP server processes; a server that dies rejects the episode with
its reason counted by the training workflow."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from areal_env.api.config import RolloutConfig
from areal_env.api.imports import import_string, load_file_module
from areal_env.envs.agent import AenvAgent
from tests.fixtures.proxy import export_session, open_session

ROOT = Path(__file__).resolve().parents[2]
SERVER = {"command": sys.executable, "args": [str(ROOT / "tests/fixtures/mcp_server.py")]}


def bump_reward(final_answer: str, tool_calls: list, data: dict) -> float:
    """Right total in the final answer, after a successful call."""
    ok = any(c["name"] == "bump" and not c["is_error"] for c in tool_calls)
    return float(ok and str(data["answer"]) in final_answer)


@pytest.fixture
def proxy_server(scripted_proxy):
    return scripted_proxy


@pytest.fixture
def engine(proxy_server):
    engine = proxy_server.state.engine
    yield engine
    assert engine.pending == 0, "a scripted reply was not used"


def _call(name: str, args: str) -> str:
    return f'<tool_call>[{{"name": "{name}", "arguments": {args}}}]</tool_call>'


ITEM = {"question": "Bump the counter by 3 and tell me the total.", "answer": 3}


def _agent(which: str, **kw):
    if which == "aenv_agent":
        return AenvAgent(**kw)
    path = {
        "runner": "agents/openai_agents_runner.py:RunnerAgent",
        "responses": "agents/openai_sdk_agent.py:ResponsesAgent",
    }[which]
    cls = import_string(str(ROOT / path))
    return cls(**kw)


@pytest.mark.parametrize("which", ["aenv_agent", "runner", "responses"])
async def test_agents_train_on_an_mcp_server(which, proxy_server, engine):
    agent = _agent(
        which,
        mcp_config=SERVER,
        reward_fn="tests.unit.test_mcp_agents:bump_reward",
        max_turns=3,
    )
    engine.push(_call("bump", '{"step": 3}'), "The total is 3.")
    sid, key = open_session(proxy_server)
    reward = await agent.run(ITEM, base_url=proxy_server.openai_base_url, api_key=key)
    assert reward == 1.0
    second_prompt = proxy_server.state.tokenizer.decode(engine.requests[-1].input_ids)
    assert "3" in second_prompt.split("<tool_call>")[-1]  # the real tool result went back
    exported = export_session(proxy_server, sid)
    assert len(exported["interactions"]) == 2  # both model calls were recorded for training


async def test_long_results_reach_the_model_truncated(proxy_server, engine):
    cfg = {**SERVER, "max_tool_output_tokens": 25}
    agent = AenvAgent(mcp_config=cfg, reward_fn=lambda tool_calls: float(len(tool_calls)))
    engine.push(_call("long_text", '{"chars": 5000}'), "It is long.")
    _, key = open_session(proxy_server)
    assert await agent.run(ITEM, base_url=proxy_server.openai_base_url, api_key=key) == 1.0
    prompt = proxy_server.state.tokenizer.decode(engine.requests[-1].input_ids)
    assert "[... tool output truncated: 4900 of 5000 characters omitted ...]" in prompt
    assert "x" * 101 not in prompt


async def test_server_death_rejects_the_episode_with_its_reason(proxy_server, engine):
    from areal_env.workflow.resolve import resolve_workflow

    agent = AenvAgent(mcp_config=SERVER, reward_fn=lambda: 1.0)
    wf = resolve_workflow(
        agent,
        rollout=RolloutConfig(n_samples=1, episode_timeout=120),
        proxy_base_url=proxy_server.base_url,
        admin_key=proxy_server.admin_key,
    )
    engine.push(_call("die", "{}"))
    assert await wf.arun_episode(engine, dict(ITEM)) is None
    assert wf.stats["rejected/env_server_died"] == 1
    engine.push(_call("bump", "{}"), "Done: 1.")  # the next episode gets a new server
    assert await wf.arun_episode(engine, dict(ITEM)) is not None
    await wf.aclose()


def test_mcp_needs_a_reward_fn_and_one_environment():
    with pytest.raises(ValueError, match="no reward endpoint: give reward_fn"):
        AenvAgent(mcp_config=SERVER)
    with pytest.raises(ValueError, match="not both"):
        AenvAgent({"env_name": "x@1"}, mcp_config=SERVER, reward_fn=lambda: 0.0)
    runner = load_file_module(str(ROOT / "agents/openai_agents_runner.py"))
    with pytest.raises(ValueError, match="mcp.command"):
        runner.RunnerAgent(mcp_config={"args": []}, reward_fn=lambda: 0.0)


async def test_runner_agent_keeps_episodes_with_invented_tools(proxy_server, engine):
    """An invented tool name: the Agents SDK (0.24 as 0.4) aborts the run with
    ModelBehaviorError; the episode is still scored, not lost."""
    agent = _agent("runner", mcp_config=SERVER, reward_fn=lambda final_answer: 0.5, max_turns=2)
    engine.push(_call("sqrt", '{"x": 9}'))
    _, key = open_session(proxy_server)
    before = len(engine.requests)
    assert await agent.run(ITEM, base_url=proxy_server.openai_base_url, api_key=key) == 0.5
    assert len(engine.requests) - before == 1
