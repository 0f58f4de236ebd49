"""AenvEnvironmentAdapter against real aenvironment servers (started and killed by the tests)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path

import httpx
import pytest

from areal_env.envs.aenv.adapter import AenvEnvironmentAdapter, is_retry_safe
from areal_env.envs.aenv.config import AenvConfig
from areal_env.envs.base import (
    EnvCallError,
    EnvError,
    EnvToolCallError,
    EnvUnavailableError,
    reward_value,
)

COUNTER_ENV = Path(__file__).with_name("aenv_counter_env.py")


@pytest.fixture
def counter_server(aenv_server_factory):
    launcher = aenv_server_factory(1, tools_path=COUNTER_ENV)
    return launcher


def _cfg(launcher, **kw) -> AenvConfig:
    base = dict(env_name="counter@1.0", aenv_url=launcher.urls[0], retry_delay=0.05, timeout=10.0)
    base.update(kw)
    return AenvConfig(**base)


async def _calls(env: AenvEnvironmentAdapter) -> dict:
    return await env.call_function("calls", {})


async def test_tools_listed_once_and_converted(aenv_config):
    async with AenvEnvironmentAdapter(aenv_config) as env:
        tools = await env.list_tools()
        assert {t["name"] for t in tools} == {
            "calculator@1.0.0/add",
            "calculator@1.0.0/subtract",
            "calculator@1.0.0/multiply",
            "calculator@1.0.0/divide",
        }
        assert await env.list_tools() is tools  # cached per instance
        openai_tools, name_map = await env.openai_tools()
        assert name_map["add"] == "calculator@1.0.0/add"
        assert openai_tools[0]["function"]["parameters"]["required"] == ["a", "b"]
        result = await env.call_tool(name_map["add"], {"a": 2, "b": 40})
        assert (result.text, result.is_error) == ("42", False)
        assert (await env.call_tool("add", {"a": 1.5, "b": 1})).text == "2.5"


async def test_tool_error_is_a_result_and_not_retried(counter_server):
    async with AenvEnvironmentAdapter(_cfg(counter_server, max_retries=3)) as env:
        result = await env.call_tool("fail", {"message": "no such file"})
        assert result.is_error and "no such file" in result.text
        unknown = await env.call_tool("does_not_exist", {})
        assert unknown.is_error and "does_not_exist" in unknown.text
        assert (await _calls(env)) == {"fail": 1}


async def test_dead_server_retried_then_clear_error(counter_server, caplog):
    cfg = _cfg(
        counter_server,
        max_retries=2,
        aenv_url=counter_server.urls[0].replace("http://", "http://user:topsecret@")
        + "?token=tok123",
    )
    caplog.set_level(logging.DEBUG)
    async with AenvEnvironmentAdapter(cfg) as env:
        assert (await env.call_tool("bump", {})).text == "1"
        counter_server.stop_server(0, kill=True)
        t0 = time.monotonic()
        with pytest.raises(EnvToolCallError) as err:
            await env.call_tool("bump", {})
        assert time.monotonic() - t0 < 5  # noticed fast, not after the MCP request timeout
        e = err.value
        assert e.tool_name == "bump" and e.attempts == 3
        assert isinstance(e.cause, httpx.ConnectError)
        assert "'bump'" in str(e) and "3 attempt" in str(e) and "ConnectError" in str(e)
    text = caplog.text + str(err.value)
    assert "topsecret" not in text and "tok123" not in text


async def test_restarted_server_stale_session_is_retried_once(counter_server):
    async with AenvEnvironmentAdapter(_cfg(counter_server)) as env:
        assert (await env.call_tool("bump", {})).text == "1"
        counter_server.restart_server(0)  # new process: our MCP session id is unknown there
        assert (await env.call_tool("bump", {})).text == "1"  # ran exactly once on the new one
        assert (await _calls(env)) == {"bump": 1}


async def test_server_coming_back_during_retries(counter_server):
    cfg = _cfg(counter_server, max_retries=30, retry_delay=0.2)
    async with AenvEnvironmentAdapter(cfg) as env:
        await env.list_tools()
        counter_server.stop_server(0, kill=True)
        restarter = threading.Timer(1.0, counter_server.restart_server, args=(0,))
        restarter.start()
        try:
            result = await env.call_tool("bump", {"step": 5})
        finally:
            restarter.join()
        assert result.text == "5"
        assert (await _calls(env)) == {"bump": 5}


async def test_timeout_is_not_retried(counter_server):
    async with AenvEnvironmentAdapter(_cfg(counter_server, max_retries=3)) as env:
        with pytest.raises(EnvToolCallError) as err:
            await env.call_tool("slow", {"seconds": 2.0}, timeout=0.5)
        assert err.value.attempts == 1
        await asyncio.sleep(2.0)
        assert (await _calls(env)).get("slow") == 1


async def test_reward_plumbing(aenv_config, counter_server):
    async with AenvEnvironmentAdapter(aenv_config) as env:
        out = await env.call_reward(
            {"final_answer": "The answer is 12.", "task": {"answer": "12"}, "tool_calls": []}
        )
        assert out["correct"] is True and reward_value(out) == 1.0
        # Only right plain answers pay: a right tool result the agent did not answer with, a
        # valid call alone, or a copied tool response (markup) earn nothing.
        right_call = {"name": "add", "is_error": False, "result": "12"}
        out = await env.call_reward(
            {"final_answer": "13", "task": {"answer": 12}, "tool_calls": [right_call]}
        )
        assert reward_value(out) == 0.0 and out["tool_calls"] == 1
        out = await env.call_reward(
            {
                "final_answer": "<tool_response>\n12\n</tool_response>",
                "task": {"answer": 12},
                "tool_calls": [right_call],
            }
        )
        assert reward_value(out) == 0.0 and out["plain"] is False
        out = await env.call_reward(
            {"final_answer": "12", "task": {"answer": 12}, "tool_calls": [right_call]}
        )
        assert reward_value(out) == 1.0
        failed_call = {"name": "add", "is_error": True, "result": "Error: x"}
        out = await env.call_reward(
            {"final_answer": "", "task": {"answer": 12}, "tool_calls": [failed_call]}
        )
        assert reward_value(out) == 0.0
        # call credit: each call that makes the next step of the solution earns 0.25, in order;
        # add/multiply take their operands either way round; a wrong call in between earns 0
        steps = [["multiply", 20, 31, 620], ["add", 620, 339, 959]]
        calls = [
            {"name": "add", "arguments": {"a": 31, "b": 339}, "is_error": False},  # wrong op
            {"name": "multiply", "arguments": {"a": 31, "b": 20}, "is_error": False},
            {"name": "multiply", "arguments": {"a": 20, "b": 31}, "is_error": False},  # again
            {"name": "add", "arguments": {"a": "620", "b": 339}, "is_error": False},
            {"name": "add", "arguments": {"a": 959, "b": 0}, "is_error": False},  # past the end
        ]
        out = await env.call_reward(
            {"final_answer": "959", "task": {"answer": 959, "steps": steps}, "tool_calls": calls}
        )
        assert out["call_rewards"] == [0.0, 0.25, 0.0, 0.25, 0.0]
        assert reward_value(out) == 0.0 and out["wasted_calls"] == 1  # the call past the end
        # subtract and divide keep their order; a failed call earns nothing
        steps = [["subtract", 50, 8, 42]]
        for call, credit in (
            ({"name": "subtract", "arguments": {"a": 8, "b": 50}, "is_error": False}, 0.0),
            ({"name": "subtract", "arguments": {"a": 50, "b": 8}, "is_error": True}, 0.0),
            ({"name": "subtract", "arguments": {"a": 50, "b": 8}, "is_error": False}, 0.25),
        ):
            out = await env.call_reward(
                {"final_answer": "", "task": {"answer": 42, "steps": steps}, "tool_calls": [call]}
            )
            assert out["call_rewards"] == [credit]
        # a call once every step is done is wasted: the right answer after it does not pay
        steps = [["add", 40, 2, 42]]
        done = {"name": "add", "arguments": {"a": 40, "b": 2}, "is_error": False, "result": "42"}
        again = {"name": "add", "arguments": {"a": 42, "b": 0}, "is_error": False, "result": "42"}
        task = {"answer": 42, "steps": steps}
        out = await env.call_reward(
            {"final_answer": "42", "task": task, "tool_calls": [done, again]}
        )
        assert reward_value(out) == 0.0 and out["wasted_calls"] == 1
        assert out["call_rewards"] == [0.25, 0.0]
        assert out["answer_in_reach"] is False  # after the wasted call: out of the loss
        # a wrong call before the right one is not wasted
        out = await env.call_reward(
            {"final_answer": "42", "task": task, "tool_calls": [again, done]}
        )
        assert reward_value(out) == 1.0 and out["call_rewards"] == [0.0, 0.25]
        assert out["answer_in_reach"] is True  # the latest call was a right step
        # after a wrong call no answer could be right: the answer's turn is not blamed
        for calls, in_reach in (([again], False), ([], True), ([done], True)):
            out = await env.call_reward({"final_answer": "7", "task": task, "tool_calls": calls})
            assert reward_value(out) == 0.0 and out["answer_in_reach"] is in_reach, calls
        # a task without steps: no credit, one entry per call all the same
        out = await env.call_reward(
            {"final_answer": "12", "task": {"answer": 12}, "tool_calls": [right_call]}
        )
        assert out["call_rewards"] == [0.0]
    async with AenvEnvironmentAdapter(_cfg(counter_server)) as env:
        assert reward_value(await env.call_reward({"value": 0.75})) == 0.75
        with pytest.raises(EnvCallError, match=r"(?s)reward.*1 attempt.*negative reward"):
            await env.call_reward({"value": -1})  # a reward bug is not retried


def test_reward_value_shapes():
    assert reward_value(1) == 1.0 and reward_value(True) == 1.0 and reward_value("0.5") == 0.5
    assert reward_value({"score": 0.25}) == 0.25
    with pytest.raises(ValueError):
        reward_value({"nothing": 1})


async def test_not_ready_fails_within_startup_timeout():
    cfg = AenvConfig(env_name="x@1", aenv_url="http://127.0.0.249", startup_timeout=1.0)
    env = AenvEnvironmentAdapter(cfg)
    t0 = time.monotonic()
    with pytest.raises(EnvUnavailableError, match="not ready after 1.0s"):
        await env.initialize()
    assert time.monotonic() - t0 < 5
    assert not env.initialized and env._session is None  # released
    with pytest.raises(EnvError, match="not initialized"):
        await env.call_tool("add", {})


@pytest.mark.parametrize("delay", [0.0, 0.6])  # during MCP session set-up / inside the tool
async def test_release_on_cancellation(counter_server, delay):
    """Cancelled during MCP session set-up or inside the tool: stop and release."""
    adapter = AenvEnvironmentAdapter(_cfg(counter_server))
    entered = asyncio.Event()

    async def episode():
        async with adapter as env:
            entered.set()
            await env.call_tool("slow", {"seconds": 1.0})

    task = asyncio.create_task(episode())
    await entered.wait()
    await asyncio.sleep(delay)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert adapter._session is None and not adapter.initialized


async def test_auto_release_off_keeps_instance(aenv_config):
    adapter = AenvEnvironmentAdapter(aenv_config.new(auto_release=False))
    async with adapter:
        pass
    assert adapter.initialized
    assert (await adapter.call_tool("multiply", {"a": 6, "b": 7})).text == "42"
    await adapter.release()
    assert not adapter.initialized


def test_retry_classification():
    req = httpx.Request("POST", "http://h:8081/mcp")
    assert is_retry_safe(httpx.ConnectError("refused", request=req))
    for code in (502, 503, 504):
        resp = httpx.Response(code, request=req)
        assert is_retry_safe(httpx.HTTPStatusError("x", request=req, response=resp))
    resp500 = httpx.Response(500, request=req)
    assert not is_retry_safe(httpx.HTTPStatusError("x", request=req, response=resp500))
    assert not is_retry_safe(httpx.ReadTimeout("slow", request=req))
    assert not is_retry_safe(httpx.RemoteProtocolError("disconnected", request=req))
    try:  # wrapped the way the SDK does it
        try:
            raise httpx.ConnectError("refused", request=req)
        except httpx.ConnectError as inner:
            raise RuntimeError("Failed to talk") from inner
    except RuntimeError as outer:
        assert is_retry_safe(outer)


async def test_episodes_share_one_ssl_context(aenv_config, monkeypatch):
    """Opening an episode's clients (the adapter's and its MCP session's) loads no CA bundle:
    httpx would load one per client (about 50 ms of CPU on the event loop each), the package
    passes its one context; and that context still verifies certificates and host names."""
    import ssl

    from areal_env.http.client import default_ssl_context

    shared = default_ssl_context()
    assert shared is default_ssl_context()
    assert shared.verify_mode == ssl.CERT_REQUIRED and shared.check_hostname

    loads = []
    real_load = ssl.SSLContext.load_verify_locations

    def counting_load(self, *args, **kwargs):
        loads.append(args or kwargs)
        return real_load(self, *args, **kwargs)

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", counting_load)
    for _ in range(3):
        async with AenvEnvironmentAdapter(aenv_config) as env:
            assert (await env.call_tool("add", {"a": 2, "b": 3})).text == "5"
    assert loads == []
    async with httpx.AsyncClient():  # the control: a default httpx client does load one
        pass
    assert len(loads) == 1
