"""The proxy through the official ``openai`` SDK (sync, async, streaming, tools, logprobs) and
the ``openai-agents`` Runner, against a real server and the real model."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from tests.fixtures.proxy import export_session, open_session

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def _client(proxy_server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy_server.openai_base_url, api_key=key, max_retries=0)


def test_sync_chat_completion_is_recorded(proxy_server):
    sid, key = open_session(proxy_server, task_id="t1")
    client = _client(proxy_server, key)
    r = client.chat.completions.create(
        model="my-model",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Say hi."},
        ],
        max_tokens=12,
        temperature=0,
        user="ignored-field",
    )
    assert r.id.startswith("chatcmpl-")
    assert r.model == "my-model"
    choice = r.choices[0]
    assert isinstance(choice.message.content, str) and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    data = export_session(proxy_server, sid)
    (info,) = data["interactions"]
    assert info["id"] == r.id and info["parent_id"] is None
    assert info["num_prompt_tokens"] == r.usage.prompt_tokens
    assert info["num_output_tokens"] == r.usage.completion_tokens
    row = data["trajectories"][r.id]
    assert len(row["input_ids"]) == r.usage.total_tokens
    assert sum(row["loss_mask"]) == r.usage.completion_tokens
    assert data["stats"]["completions"] == 1


def test_content_parts_and_models_endpoint(proxy_server):
    _, key = open_session(proxy_server)
    client = _client(proxy_server, key)
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2-test"]
    r = client.chat.completions.create(
        model="smollm2-test",
        messages=[
            {"role": "developer", "content": [{"type": "text", "text": "Answer in one word."}]},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Capital of "},
                    {"type": "text", "text": "France?"},
                ],
            },
        ],
        max_completion_tokens=6,
        temperature=0.7,
        top_p=0.9,
        seed=3,
    )
    assert r.usage.completion_tokens <= 6


async def test_async_concurrent_requests_one_session(proxy_server):
    sid, key = open_session(proxy_server)
    client = openai.AsyncOpenAI(base_url=proxy_server.openai_base_url, api_key=key, max_retries=0)
    questions = ["What is 2+2?", "Name a color.", "Name an animal."]
    results = await asyncio.gather(
        *(
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": q}], max_tokens=8, temperature=1.0
            )
            for q in questions
        )
    )
    await client.close()
    ids = {r.id for r in results}
    assert len(ids) == 3
    data = export_session(proxy_server, sid)
    assert {i["id"] for i in data["interactions"]} == ids


def test_streaming_with_usage(proxy_server):
    sid, key = open_session(proxy_server)
    client = _client(proxy_server, key)
    stream = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Write a sentence about the sea."}],
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes in (["stop"], ["length"])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1
    n_out = usage_chunk.usage.completion_tokens
    if n_out > 3:
        assert len(texts) >= 2, "content must arrive in several deltas as tokens are produced"
    data = export_session(proxy_server, sid)
    (info,) = data["interactions"]
    assert info["id"] == chunks[0].id
    assert info["num_output_tokens"] == n_out
    streamed = "".join(texts)
    assert streamed.strip() and streamed.strip() in info["completion_text"]


def test_streaming_then_extending_splices(proxy_server, engine):
    """A streamed reply echoed back as history is found as the parent."""
    sid, key = open_session(proxy_server)
    client = _client(proxy_server, key)
    msgs = [{"role": "user", "content": "Say one word."}]
    stream = client.chat.completions.create(
        model="m", messages=msgs, max_tokens=8, temperature=0, stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    r2 = client.chat.completions.create(
        model="m",
        messages=[
            *msgs,
            {"role": "assistant", "content": text},
            {"role": "user", "content": "Again."},
        ],
        max_tokens=4,
        temperature=0,
    )
    data = export_session(proxy_server, sid)
    second = next(i for i in data["interactions"] if i["id"] == r2.id)
    assert second["parent_id"] == chunks[0].id and second["spliced"]
    # prompt 2 = prompt 1 + output 1 (exact ids) + end-of-turn glue + the new user turn only
    row1, row2 = data["trajectories"][chunks[0].id], data["trajectories"][r2.id]
    n1 = len(row1["input_ids"])
    out1 = row1["input_ids"][-sum(row1["loss_mask"]) :]
    renderer = proxy_server.state.renderer
    new_turn = engine.tokenizer.encode(
        "<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    prompt2 = row2["input_ids"][: second["num_prompt_tokens"]]
    assert prompt2 == row1["input_ids"] + renderer.glue_ids(out1) + new_turn
    assert len(prompt2) > n1


def test_logprobs(proxy_server):
    sid, key = open_session(proxy_server)
    client = _client(proxy_server, key)
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=0,
    )
    entries = r.choices[0].logprobs.content
    assert entries, "logprobs were requested"
    assert all(
        e.logprob <= 0.0 and isinstance(e.token, str) and e.bytes == list(e.token.encode())
        for e in entries
    )
    row = export_session(proxy_server, sid)["trajectories"][r.id]
    out_lps = row["logprobs"][-r.usage.completion_tokens :]
    assert [round(e.logprob, 4) for e in entries] == [round(x, 4) for x in out_lps[: len(entries)]]
    assert "".join(e.token for e in entries) in r.choices[0].message.content + "".join(
        e.token for e in entries
    )
    # without the flag: no logprobs object
    r2 = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert r2.choices[0].logprobs is None


def test_tool_history_round_trip_and_splicing(proxy_server, engine):
    """Turn 1 (sampled, tools offered) → its reply + a tool/user turn → turn 2 is spliced."""
    sid, key = open_session(proxy_server)
    client = _client(proxy_server, key)
    msgs = [{"role": "user", "content": "What is 2 + 3? Use the add tool."}]
    r1 = client.chat.completions.create(
        model="m", messages=msgs, tools=[ADD_TOOL], max_tokens=40, temperature=0
    )
    m1 = r1.choices[0].message
    if m1.tool_calls:  # a real sampled call: well-formed OpenAI shape
        assert r1.choices[0].finish_reason == "tool_calls"
        call = m1.tool_calls[0]
        assert call.type == "function" and call.id and call.function.name
        assert isinstance(json.loads(call.function.arguments), dict)
        follow = [{"role": "tool", "tool_call_id": call.id, "content": "5"}]
    else:
        assert r1.choices[0].finish_reason in ("stop", "length")
        follow = [{"role": "user", "content": "Please use the tool."}]
    history = [*msgs, m1.model_dump(exclude_none=True), *follow]
    r2 = client.chat.completions.create(
        model="m", messages=history, tools=[ADD_TOOL], max_tokens=8, temperature=0
    )

    data = export_session(proxy_server, sid)
    by_id = {i["id"]: i for i in data["interactions"]}
    assert by_id[r2.id]["parent_id"] == r1.id and by_id[r2.id]["spliced"]
    rows = data["trajectories"]
    row1, row2 = rows[r1.id], rows[r2.id]
    n1 = len(row1["input_ids"])  # parent prompt + parent output
    p2 = row2["input_ids"][: by_id[r2.id]["num_prompt_tokens"]]
    assert p2[:n1] == row1["input_ids"], "child prompt starts with parent prompt + exact output ids"
    tail = engine.tokenizer.decode(p2[n1:])
    assert tail.rstrip().endswith("assistant")
    if m1.tool_calls:
        assert "<tool_response>" in tail and "5" in tail


def test_given_tool_call_history_is_rendered_as_tool_turns(proxy_server):
    sid, key = open_session(proxy_server)
    client = _client(proxy_server, key)
    history = [
        {"role": "user", "content": "What is 2 + 3?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": "5"},
    ]
    r = client.chat.completions.create(
        model="m",
        messages=history,
        tools=[ADD_TOOL],
        tool_choice="auto",
        max_tokens=12,
        temperature=0,
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    data = export_session(proxy_server, sid)
    (info,) = data["interactions"]
    prompt = info["prompt_text"]
    assert '"name": "add"' in prompt and "<tool_response>\n5\n</tool_response>" in prompt
    assert data["stats"]["re_renders"] == 1  # history it did not produce: rendered from scratch


def test_forced_tool_choice_returns_a_call(proxy_server):
    _, key = open_session(proxy_server)
    client = _client(proxy_server, key)
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Add 4 and 5."}],
        tools=[ADD_TOOL],
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=32,
        temperature=0,
    )
    msg = r.choices[0].message
    # a forced function is always called (its arguments may be the model's invalid JSON)
    assert msg.tool_calls and msg.tool_calls[0].function.name == "add"
    assert r.choices[0].finish_reason == "tool_calls"
    assert "<tool_call>" not in (msg.content or "")


def test_streaming_tool_call_deltas(proxy_server):
    """A forced call streams as tool_calls deltas (index/id/type/function), no tag text leaks."""
    _, key = open_session(proxy_server)
    client = _client(proxy_server, key)
    stream = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Add 1 and 2."}],
        tools=[ADD_TOOL],
        tool_choice="required",
        max_tokens=32,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    if calls:
        assert finish == ["tool_calls"]
        assert calls[0].index == 0 and calls[0].id and calls[0].type == "function"
        assert calls[0].function.name == "add"
        json.loads(calls[0].function.arguments)
        assert "<tool_call>" not in text
    else:
        assert finish in (["stop"], ["length"])


@pytest.mark.slow
async def test_agents_sdk_runner_multi_turn(proxy_server):
    from agents.exceptions import MaxTurnsExceeded

    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    sid, key = open_session(proxy_server)
    calls: list[tuple[int, int]] = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    client = openai.AsyncOpenAI(base_url=proxy_server.openai_base_url, api_key=key, max_retries=0)
    agent = Agent(
        name="calc",
        instructions="You are a calculator. Use the add tool, then state the result.",
        model=OpenAIChatCompletionsModel(model="smollm2", openai_client=client),
        tools=[add],
        model_settings=ModelSettings(tool_choice="required", temperature=0.0, max_tokens=40),
    )
    try:
        result = await Runner.run(agent, "What is 3 + 4?", max_turns=3)
        assert isinstance(result.final_output, str)
    except MaxTurnsExceeded:
        pass
    await client.close()
    data = export_session(proxy_server, sid)
    its = data["interactions"]
    assert len(its) >= 1
    if calls:  # the forced call parsed: the Runner went on with the tool result
        assert len(its) >= 2
        assert its[1]["parent_id"] == its[0]["id"] and its[1]["spliced"]
        assert "<tool_response>" in its[1]["prompt_text"]
