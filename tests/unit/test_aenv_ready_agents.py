"""The ready agents in agents/ (loaded by file path, as training loads them) through the real
proxy and model, on the real example environment."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from areal_env.api.imports import import_string

AGENTS = Path(__file__).resolve().parents[2] / "agents"


def test_agents_folder_does_not_shadow_the_agents_sdk():
    import agents

    assert not (AGENTS / "__init__.py").exists()
    assert hasattr(agents, "Runner"), agents.__file__  # the OpenAI Agents SDK, not our folder


def _load(name: str):
    spec = {
        "runner": "openai_agents_runner.py:RunnerAgent",
        "sdk": "openai_sdk_agent.py:ResponsesAgent",
    }
    return import_string(str(AGENTS / spec[name].split(":")[0]) + ":" + spec[name].split(":")[1])


@pytest.mark.slow
@pytest.mark.parametrize("which", ["runner", "sdk"])
async def test_ready_agent_episode_through_proxy(which, proxy_server, aenv_config):
    from tests.fixtures.proxy import export_session, open_session

    seen: list[dict] = []

    def reward_fn(final_answer, tool_calls, messages):
        seen.append({"final": final_answer, "tools": tool_calls, "messages": messages})
        return 0.25

    cls = _load(which)
    kwargs = dict(max_turns=2, max_tokens=32, temperature=0.0, reward_fn=reward_fn)
    if which == "runner":
        kwargs["first_turn_tool_choice"] = "required"
    agent = cls(aenv_config, **kwargs)
    item = {"question": "What is 17 + 25? Use the add tool.", "answer": 42}
    sid, key = open_session(proxy_server)
    reward = await agent.run(item, base_url=proxy_server.base_url + "/v1", api_key=key)
    assert reward == 0.25
    (ep,) = seen
    exported = await asyncio.to_thread(export_session, proxy_server, sid)
    assert 1 <= len(exported["interactions"]) <= 2  # every model call went through the proxy
    for entry in ep["tools"]:
        if entry["name"] == "add" and not entry["is_error"]:
            args = entry["arguments"]
            assert entry["result"] == str(int(args["a"] + args["b"]))
    if which == "runner":  # a forced first call: the SDK called the environment's tool
        assert ep["tools"] and ep["tools"][0]["name"] == "add", ep["tools"]
        assert len(exported["interactions"]) == 2  # the call, then the answer after its result


async def test_ready_agents_refuse_bad_options(aenv_config):
    for which in ("runner", "sdk"):
        cls = _load(which)
        with pytest.raises(ValueError, match="max_turns"):
            cls(aenv_config, max_turns=0)
        with pytest.raises(ValueError, match="unknown aenv config key"):
            cls({"bogus": 1})


def test_runner_maps_named_tool_choice_for_the_sdk():
    from areal_env.api.imports import load_file_module

    mod = load_file_module(AGENTS / "openai_agents_runner.py")
    assert mod._sdk_tool_choice({"type": "function", "function": {"name": "add"}}) == "add"
    assert mod._sdk_tool_choice("required") == "required" and mod._sdk_tool_choice(None) is None
    with pytest.raises(ValueError):
        mod._sdk_tool_choice({"type": "function"})
