"""AenvAgent: its tool handling against a real environment, and whole episodes through the real
proxy and model."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from areal_env.api.io import GenerationConfig
from areal_env.envs.aenv.adapter import AenvEnvironmentAdapter
from areal_env.envs.agent import AenvAgent, ToolErrorRaised
from areal_env.envs.base import EnvToolCallError
from areal_env.envs.episode import (
    EnvironmentPool,
    initial_messages,
    make_config,
    resolve_reward_fn,
    sampling_kwargs,
)


def exact_reward(final_answer: str, data: dict) -> float:
    """Used through an import string below."""
    return float(final_answer.strip() == str(data["answer"]))


def _call(name: str, arguments: str, cid: str = "call_1") -> SimpleNamespace:
    return SimpleNamespace(id=cid, function=SimpleNamespace(name=name, arguments=arguments))


# -------------------------------------------------------------------------- configuration


def test_agent_options_validate_and_combine(aenv_config):
    agent = AenvAgent(
        aenv_config.to_dict(),
        tool_error_policy="raise",
        gconfig=GenerationConfig(max_new_tokens=48, temperature=0.7, top_p=0.9),
        max_tokens=24,
        reward_fn="tests.unit.test_aenv_agent:exact_reward",
    )
    assert agent.config.tool_error_policy == "raise" and agent.config.host == aenv_config.host
    assert agent.sampling == {"max_tokens": 24, "temperature": 0.7, "top_p": 0.9}
    assert agent.reward_fn is exact_reward
    with pytest.raises(ValueError, match="max_turns"):
        AenvAgent(aenv_config, max_turns=0)
    with pytest.raises(ValueError, match="unknown aenv config key 'url'"):
        AenvAgent({"url": "http://x"})
    with pytest.raises(ValueError, match="tool_error_policy"):
        AenvAgent(aenv_config, tool_error_policy="ignore")
    with pytest.raises(ValueError, match="parallel_tool_calls must be true, false or unset"):
        AenvAgent(aenv_config, parallel_tool_calls="no")
    with pytest.raises(ImportError, match="cannot import reward_fn"):
        resolve_reward_fn("tests.unit.test_aenv_agent:nope")


def test_sampling_and_messages_helpers():
    assert sampling_kwargs({"greedy": True, "max_new_tokens": 8}) == {
        "max_tokens": 8,
        "temperature": 0.0,
    }
    assert sampling_kwargs(None, temperature=1) == {"temperature": 1.0}
    assert initial_messages({"question": "q"}, "sys") == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q"},
    ]
    chat = [{"role": "system", "content": "mine"}, {"role": "user", "content": "hi"}]
    assert initial_messages({"messages": chat}, "sys") == chat
    with pytest.raises(ValueError, match="no 'messages'"):
        initial_messages({"answer": 1}, None)
    assert make_config(None, tool_error_policy=None).tool_error_policy == "append_error"


def test_pool_spreads_episodes_over_servers(aenv_config):
    pool = EnvironmentPool(aenv_config, ["http://127.0.0.1", "http://127.0.0.2"])
    a, b, c = pool.acquire(), pool.acquire(), pool.acquire()
    assert {a, b} == {"http://127.0.0.1", "http://127.0.0.2"} and c in (a, b)
    pool.release(a)
    pool.release(b)
    pool.release(c)
    assert set(pool._busy.values()) == {0}


def test_agent_pickles_for_subprocess_workers(aenv_config):
    import pickle

    agent = AenvAgent(aenv_config, aenv_urls=["http://127.0.0.1", "http://127.0.0.2"])
    agent.pool.acquire()
    copy = pickle.loads(pickle.dumps(agent))
    assert copy.pool.urls == agent.pool.urls and set(copy.pool._busy.values()) == {0}
    assert copy.pool.acquire() in copy.pool.urls and copy.config == agent.config


# -------------------------------------------------------------------------- tool handling


async def test_tool_calls_unknown_invalid_and_error(aenv_config):
    agent = AenvAgent(aenv_config)
    async with AenvEnvironmentAdapter(aenv_config) as env:
        _, name_map = await env.openai_tools()
        log: list[dict] = []
        ok = await agent._run_tool(env, name_map, _call("add", '{"a": 20, "b": 22}'), log)
        assert ok == {"role": "tool", "tool_call_id": "call_1", "content": "42"}
        bad_name = await agent._run_tool(env, name_map, _call("calculator@1.0.0/add", "{}"), log)
        assert bad_name["content"].startswith("Error: unknown tool")
        assert "add" in bad_name["content"]  # lists what is available
        bad_json = await agent._run_tool(env, name_map, _call("add", '{"a": 1,'), log)
        assert bad_json["content"].startswith("Error: tool arguments are not valid JSON")
        err = await agent._run_tool(env, name_map, _call("divide", '{"a": 1, "b": 0}'), log)
        assert err["content"].startswith("Error:") and "division by zero" in err["content"]
        assert [e["is_error"] for e in log] == [False, True, True, True]
        assert log[0] == {
            "name": "add",
            "arguments": {"a": 20, "b": 22},
            "is_error": False,
            "result": "42",
        }

    strict = AenvAgent(aenv_config, tool_error_policy="raise")
    async with AenvEnvironmentAdapter(aenv_config) as env:
        _, name_map = await env.openai_tools()
        with pytest.raises(ToolErrorRaised, match="division by zero"):
            await strict._run_tool(env, name_map, _call("divide", '{"a": 1, "b": 0}'), [])
        with pytest.raises(ToolErrorRaised, match="unknown tool"):
            await strict._run_tool(env, name_map, _call("sqrt", "{}"), [])


async def test_transport_failure_propagates(aenv_server_factory, aenv_config):
    launcher = aenv_server_factory(1)
    cfg = aenv_config.new(aenv_url=launcher.urls[0], max_retries=1)
    agent = AenvAgent(cfg)
    async with AenvEnvironmentAdapter(cfg) as env:
        _, name_map = await env.openai_tools()
        launcher.stop_server(0, kill=True)
        with pytest.raises(EnvToolCallError, match="'calculator@1.0.0/add'.*2 attempt"):
            await agent._run_tool(env, name_map, _call("add", '{"a": 1, "b": 2}'), [])


def _recording_env_reward(seen: list[dict]):
    """A reward_fn that records what it is given and asks the environment's reward endpoint."""

    async def reward_fn(final_answer, tool_calls, messages, data, env):
        seen.append({"final": final_answer, "tools": tool_calls, "messages": messages})
        out = await env.call_reward(
            {"final_answer": final_answer, "task": data, "tool_calls": tool_calls}
        )
        return out["reward"]

    return reward_fn


# -------------------------------------------------------------------------- whole episodes


@pytest.mark.slow
async def test_episodes_through_the_real_proxy(proxy_server, aenv_config):
    """Two turns with the real model: a forced tool call, its real result, a final answer."""
    from tests.fixtures.proxy import export_session, open_session

    seen: list[dict] = []
    reward_fn = _recording_env_reward(seen)

    agent = AenvAgent(
        aenv_config,
        max_turns=2,
        max_tokens=32,
        temperature=0.0,
        first_turn_tool_choice="required",
        reward_fn=reward_fn,
        system_prompt=None,
    )
    item = {"question": "What is 17 + 25? Use the add tool.", "answer": 42}
    sid, key = open_session(proxy_server)
    reward = await agent.run(item, base_url=proxy_server.base_url + "/v1", api_key=key)
    assert isinstance(reward, float) and reward in (0.0, 1.0)
    (ep,) = seen
    exported = await asyncio.to_thread(export_session, proxy_server, sid)
    n_model_calls = sum(1 for m in ep["messages"] if m["role"] == "assistant")
    assert len(exported["interactions"]) == n_model_calls >= 1
    for entry in ep["tools"]:
        if entry["name"] == "add" and not entry["is_error"]:
            args = entry["arguments"]
            assert entry["result"] == str(int(args["a"] + args["b"]))  # the env really ran it
    tool_msgs = [m for m in ep["messages"] if m["role"] == "tool"]
    assert len(tool_msgs) == len(ep["tools"])
    if ep["tools"]:
        assert json.dumps(ep["messages"])  # the conversation stays plain JSON


@pytest.mark.slow
async def test_env_reward_through_the_real_proxy(proxy_server, aenv_config):
    """Default reward path: the environment's @register_reward grades the final answer."""
    from tests.fixtures.proxy import open_session

    agent = AenvAgent(aenv_config, max_turns=1, max_tokens=16, temperature=0.0)
    _, key = open_session(proxy_server)
    reward = await agent.run(
        {"question": "Reply with the number 7 and nothing else.", "answer": 7},
        base_url=proxy_server.base_url + "/v1",
        api_key=key,
    )
    assert reward in (0.0, 1.0)


@pytest.mark.slow
async def test_call_credit_reaches_the_turn_that_made_the_call(engine, proxy_server, aenv_config):
    """A reward function's ``call_rewards`` are paid to the completions that made the calls:
    through the real proxy, the real environment and a real model, the episode's one training
    row (``concat``) carries a higher return on the call's tokens than on the answer's, the row's
    reward is its first turn's, and the trainer's batch holds each token's return. A held-out
    evaluation gets the episode's reward alone."""
    from areal_env.api.config import RolloutConfig
    from areal_env.workflow.batch import collate_groups
    from tests.fixtures.proxy import open_session, proxy_executor

    def credit_every_call(tool_calls):
        return {"reward": 1.0, "call_rewards": [0.25] * len(tool_calls)}

    agent = AenvAgent(
        aenv_config,
        max_turns=2,
        max_tokens=24,
        temperature=0.0,
        first_turn_tool_choice="required",
        reward_fn=credit_every_call,
    )
    rollout = RolloutConfig(n_samples=1, batch_size=1, export_style="concat")
    ex = proxy_executor(engine, agent, rollout, proxy_server)
    item = {"question": "What is 17 + 25?", "answer": 42}
    try:
        batch = await ex.rollout_batch([item], trainer_version=0)
    finally:
        await ex.aclose()
    (group,) = batch.groups
    (ep,) = group
    assert isinstance(ep.reward, dict) and len(ep.reward) == 2, ep.reward  # the call, the answer
    first, last = ep.reward.values()  # insertion order: the calls' completions, then the last
    assert (first, last) in ((0.25, 1.0), (0.25, 1.25)), ep.reward  # the last may call too
    (row,) = ep.rows
    assert row.returns is not None
    trained = [g for g, m in zip(row.returns, row.loss_mask, strict=True) if m]
    assert trained[0] == pytest.approx(first + last)  # the call's turn: its credit + the rest
    assert trained[-1] == pytest.approx(last)  # the answer's turn
    assert row.reward == pytest.approx(first + last)
    tensors = collate_groups(batch.groups)
    mask = tensors["loss_mask"][0].bool()
    assert tensors["token_rewards"][0][mask].tolist() == pytest.approx(trained)

    # evaluation: the episode's reward, a float
    _, key = open_session(proxy_server)
    value = await agent.run(item, base_url=proxy_server.base_url + "/v1", api_key=key, is_eval=True)
    assert value == 1.0


@pytest.mark.slow
async def test_an_answer_out_of_reach_is_left_out_of_the_loss(engine, proxy_server, aenv_config):
    """``answer_in_reach: false`` (a wrong call broke the chain): through the real proxy,
    environment and model, the answering completion's tokens leave the training row's loss
    mask, the call's tokens stay in it, and the trainer's batch trains only those."""
    from areal_env.api.config import RolloutConfig
    from areal_env.workflow.batch import collate_groups
    from tests.fixtures.proxy import proxy_executor

    def wrong_call(tool_calls):
        return {"reward": 0.0, "call_rewards": [0.0] * len(tool_calls), "answer_in_reach": False}

    agent = AenvAgent(
        aenv_config,
        max_turns=2,
        max_tokens=24,
        temperature=0.0,
        first_turn_tool_choice="required",
        tool_choice="none",  # the second turn answers
        reward_fn=wrong_call,
    )
    rollout = RolloutConfig(n_samples=1, batch_size=1, export_style="concat")
    ex = proxy_executor(engine, agent, rollout, proxy_server)
    try:
        batch = await ex.rollout_batch([{"question": "What is 17 + 25?"}], trainer_version=0)
    finally:
        await ex.aclose()
    (group,) = batch.groups
    (ep,) = group
    answer_id = ep.interactions[-1]["id"]
    assert ep.reward == {answer_id: None}, ep.reward
    by_id = {it["id"]: it for it in ep.interactions}
    assert by_id[answer_id]["trained"] is False
    assert [it["trained"] for it in ep.interactions[:-1]] == [True]
    (row,) = ep.rows
    n_call = by_id[ep.interactions[0]["id"]]["num_output_tokens"]
    n_answer = by_id[answer_id]["num_output_tokens"]
    assert n_answer > 0 and row.loss_mask[-n_answer:] == [0] * n_answer
    assert 0 < sum(row.loss_mask) <= n_call  # the call's sampled tokens only
    tensors = collate_groups(batch.groups)
    assert int(tensors["loss_mask"][0].sum()) == sum(row.loss_mask)


def test_episode_reward_reads_call_rewards_and_says_what_is_wrong():
    from areal_env.envs.episode import EpisodeOutcome, EpisodeReward, episode_reward

    assert episode_reward(0.5, 2) == EpisodeReward(0.5)
    assert episode_reward({"reward": 1, "call_rewards": [0.25, 0]}, 2) == EpisodeReward(
        1.0, (0.25, 0.0)
    )
    with pytest.raises(ValueError, match="one number per tool call of the episode \\(2\\)"):
        episode_reward({"reward": 1, "call_rewards": [0.25]}, 2)
    with pytest.raises(ValueError, match="finite numbers"):
        episode_reward({"reward": 1, "call_rewards": [float("nan")]}, 1)
    # paid per completion: two calls of one completion add up; the answer gets the reward
    outcome = EpisodeOutcome(
        {},
        "7",
        [],
        [{"completion_id": "c1"}, {"completion_id": "c1"}, {"completion_id": "c2"}],
        ["c1", "c2", "c3"],
    )
    paid = EpisodeReward(1.0, (0.25, 0.25, 0.0)).per_completion(outcome)
    assert paid == {"c1": 0.5, "c3": 1.0}
    assert EpisodeReward(1.0).per_completion(outcome) == 1.0  # no credit: a float as before
    # an answer out of reach (a wrong call broke the chain) is left out of the loss: None
    assert episode_reward({"reward": 0, "answer_in_reach": False}, 0) == EpisodeReward(
        0.0, answer_in_reach=False
    )
    with pytest.raises(ValueError, match="answer_in_reach must be true or false"):
        episode_reward({"reward": 0, "answer_in_reach": "no"}, 0)
    out_of_reach = EpisodeReward(0.0, (0.25, 0.0, 0.0), answer_in_reach=False)
    assert out_of_reach.per_completion(outcome) == {"c1": 0.25, "c3": None}
    assert EpisodeReward(0.0, answer_in_reach=False).per_completion(outcome) == {"c3": None}
    # ... unless it was right anyway (the model worked it out itself): then it is paid
    right_anyway = EpisodeReward(1.0, (0.0, 0.0, 0.0), answer_in_reach=False)
    assert right_anyway.per_completion(outcome) == 1.0


# -------------------------------------------------------------------------- the answer tool


def test_answer_tool_text_and_validation(aenv_config):
    from areal_env.envs.agent import answer_text, answer_tool_schema

    assert answer_text('{"answer": "862"}') == "862"
    assert answer_text('{"answer": 862}') == "862"  # written unquoted: its JSON text
    assert answer_text('{"answer": 2.5}') == "2.5"
    assert answer_text('{"value": 1}') == '{"value": 1}'  # not the schema: what the model said
    assert answer_text('{"answer": 1') == '{"answer": 1'
    assert answer_text(None) == ""
    fn = answer_tool_schema("submit")["function"]
    assert fn["name"] == "submit" and fn["parameters"]["required"] == ["answer"]
    with pytest.raises(ValueError, match="answer_tool must be a tool name"):
        AenvAgent(aenv_config, answer_tool="  ")


async def test_answer_tool_named_like_an_environment_tool_is_refused(aenv_config):
    agent = AenvAgent(aenv_config, answer_tool="add")
    async with AenvEnvironmentAdapter(aenv_config) as env:
        with pytest.raises(ValueError, match="'add' is also a tool of .*another name"):
            await agent._episode(None, "m", env, {"question": "q"})


@pytest.mark.slow
async def test_answer_tool_ends_the_episode_through_the_real_proxy(proxy_server, aenv_config):
    """A real model makes a real call, then answers through the answer tool (both calls are
    forced by name): the answer call is not run in the environment, its argument is the final
    answer the environment's reward grades, and both completions are recorded."""
    from tests.fixtures.proxy import export_session, open_session

    seen: list[dict] = []
    reward_fn = _recording_env_reward(seen)

    agent = AenvAgent(
        aenv_config,
        max_turns=4,
        max_tokens=32,
        temperature=0.0,
        first_turn_tool_choice={"type": "function", "function": {"name": "add"}},
        tool_choice={"type": "function", "function": {"name": "submit"}},
        answer_tool="submit",
        reward_fn=reward_fn,
    )
    item = {"question": "What is 17 + 25?", "answer": 42}
    sid, key = open_session(proxy_server)
    reward = await agent.run(item, base_url=proxy_server.base_url + "/v1", api_key=key)
    (ep,) = seen
    assert [t["name"] for t in ep["tools"]] == ["add"]  # the answer is not an environment call
    last = ep["messages"][-1]
    assert last["role"] == "assistant" and last["tool_calls"][0]["function"]["name"] == "submit"
    assert ep["final"] == answer_text_of(last)
    assert reward == float(ep["final"].strip() == "42")
    offered = ep["messages"]  # the conversation ends at the answer: no tool result after it
    assert sum(1 for m in offered if m["role"] == "tool") == 1
    exported = await asyncio.to_thread(export_session, proxy_server, sid)
    assert len(exported["interactions"]) == 2


def answer_text_of(message: dict) -> str:
    from areal_env.envs.agent import answer_text

    return answer_text(message["tool_calls"][0]["function"]["arguments"])
