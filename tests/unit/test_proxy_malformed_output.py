"""Malformed model output keeps each protocol's promises (issue 15, item 5).

The SDKs are real (openai, openai-agents, anthropic) and talk HTTP to a real proxy; only the
model is scripted, so each malformed ``<tool_call>`` the model might write is tried exactly:

- a forced (named or ``required``) tool_choice always yields a tool call, whose ``arguments`` is
  the model's raw text when it is not valid JSON;
- under ``auto``, markup that failed to parse becomes a tool call with raw arguments when the
  call's name can be read, else plain text with the markup removed;
- never ``<tool_call>`` markup in any content (plain, streamed, Responses, Anthropic);
- every case is counted in the session stats (and from there in the training metrics).
"""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
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
SUB_TOOL = {
    "type": "function",
    "function": {"name": "sub", "parameters": {"type": "object", "properties": {}}},
}
FORCED = {"type": "function", "function": {"name": "add"}}
MSGS = [{"role": "user", "content": "Add 1 and 2."}]

# what the model writes after the proxy prefilled `<tool_call>[{"name": "add", "arguments":`
FORCED_BAD = ' {"final: 2"}, "id": 1}]</tool_call>'
# a whole call (auto) whose arguments are not JSON
AUTO_BAD = '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": }}]</tool_call>'
AUTO_NO_NAME = "Let me think. <tool_call>[oops, not a call</tool_call>"


@pytest.fixture(scope="module")
def proxy_server(scripted_proxy):
    return scripted_proxy


@pytest.fixture
def engine(proxy_server):
    engine = proxy_server.state.engine
    yield engine
    assert engine.pending == 0, "a scripted reply was not used"


def _oai(proxy_server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy_server.openai_base_url, api_key=key, max_retries=0)


def _stats(proxy_server, sid: str) -> dict:
    return export_session(proxy_server, sid)["stats"]


def _no_markup(text: str | None) -> None:
    assert "<tool_call" not in (text or "") and "</tool_call>" not in (text or ""), text


def test_forced_named_call_with_invalid_json_is_a_call_with_raw_arguments(proxy_server, engine):
    engine.push(FORCED_BAD)
    sid, key = open_session(proxy_server)
    r = _oai(proxy_server, key).chat.completions.create(
        model="m", messages=MSGS, tools=[ADD_TOOL], tool_choice=FORCED
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add"
    assert call.function.arguments == '{"final: 2"}'
    _no_markup(choice.message.content)
    st = _stats(proxy_server, sid)
    assert (st["tool_parse_failures"], st["tool_calls_raw_arguments"]) == (1, 1)
    assert st["tool_markup_removed"] == 0


def test_forced_call_where_the_model_writes_prose_keeps_it_as_arguments(proxy_server, engine):
    engine.push(" I do not know how to add.")
    sid, key = open_session(proxy_server)
    r = _oai(proxy_server, key).chat.completions.create(
        model="m", messages=MSGS, tools=[ADD_TOOL, SUB_TOOL], tool_choice=FORCED
    )
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("add", "I do not know how to add.")
    assert r.choices[0].message.content is None


@pytest.mark.parametrize(
    "reply, name, arguments",
    [
        ('sub", "arguments": {"x": 1,}}]</tool_call>', "sub", '{"x": 1,}'),
        # no readable name at all: the first offered tool is called with what the model wrote
        ('\n"}]</tool_call>', "add", ""),
    ],
)
def test_required_always_yields_a_call(proxy_server, engine, reply, name, arguments):
    engine.push(reply)
    sid, key = open_session(proxy_server)
    r = _oai(proxy_server, key).chat.completions.create(
        model="m", messages=MSGS, tools=[ADD_TOOL, SUB_TOOL], tool_choice="required"
    )
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == (name, arguments)
    assert r.choices[0].finish_reason == "tool_calls"
    _no_markup(r.choices[0].message.content)
    assert _stats(proxy_server, sid)["tool_calls_raw_arguments"] == 1


def test_auto_invalid_arguments_and_unreadable_markup(proxy_server, engine):
    engine.push(AUTO_BAD, AUTO_NO_NAME)
    sid, key = open_session(proxy_server)
    client = _oai(proxy_server, key)
    r = client.chat.completions.create(model="m", messages=MSGS, tools=[ADD_TOOL])
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("add", '{"a": 1, "b": }')
    r = client.chat.completions.create(model="m", messages=MSGS, tools=[ADD_TOOL])
    msg = r.choices[0].message
    assert msg.tool_calls is None and msg.content == "Let me think."
    assert r.choices[0].finish_reason == "stop"
    st = _stats(proxy_server, sid)
    assert (st["tool_parse_failures"], st["tool_calls_raw_arguments"]) == (2, 1)
    assert st["tool_markup_removed"] == 1


def _stream_chat(client: openai.OpenAI, **kw) -> tuple[str, dict[int, dict], str | None]:
    text, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model="m", messages=MSGS, stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        text += d.content or ""
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            c["name"] += (tc.function.name or "") if tc.function else ""
            c["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return text, calls, finish


def test_streaming_keeps_the_same_promises(proxy_server, engine):
    engine.stream_chunk_tokens = 2  # markup split across chunks
    try:
        engine.push(FORCED_BAD, AUTO_BAD, AUTO_NO_NAME)
        sid, key = open_session(proxy_server)
        client = _oai(proxy_server, key)
        text, calls, finish = _stream_chat(client, tools=[ADD_TOOL], tool_choice=FORCED)
        assert calls == {0: {"name": "add", "arguments": '{"final: 2"}'}}
        assert finish == "tool_calls" and text == ""
        text, calls, finish = _stream_chat(client, tools=[ADD_TOOL])
        assert calls == {0: {"name": "add", "arguments": '{"a": 1, "b": }'}} and text == ""
        text, calls, finish = _stream_chat(client, tools=[ADD_TOOL])
        assert calls == {} and finish == "stop"
        _no_markup(text)
        assert text.strip() == "Let me think."
    finally:
        engine.stream_chunk_tokens = 1
    st = _stats(proxy_server, sid)
    assert (st["tool_calls_raw_arguments"], st["tool_markup_removed"]) == (2, 1)


RESP_TOOL = {
    "type": "function",
    "name": "add",
    "parameters": ADD_TOOL["function"]["parameters"],
}


def test_responses_api(proxy_server, engine):
    engine.push(FORCED_BAD, AUTO_NO_NAME, AUTO_BAD)
    sid, key = open_session(proxy_server)
    client = _oai(proxy_server, key)
    r = client.responses.create(
        model="m",
        input="Add 1 and 2.",
        tools=[RESP_TOOL],
        tool_choice={"type": "function", "name": "add"},
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert [(c.name, c.arguments) for c in calls] == [("add", '{"final: 2"}')]
    r = client.responses.create(model="m", input="Add 1 and 2.", tools=[RESP_TOOL])
    assert [o.type for o in r.output] == ["message"]
    assert r.output_text == "Let me think."
    # streamed: the function call arrives with its raw arguments, no markup as text
    events = list(
        client.responses.create(model="m", input="Add 1 and 2.", tools=[RESP_TOOL], stream=True)
    )
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    _no_markup(deltas)
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == ['{"a": 1, "b": }']
    st = _stats(proxy_server, sid)
    assert (st["tool_calls_raw_arguments"], st["tool_markup_removed"]) == (2, 1)


ANTH_ADD = {
    "name": "add",
    "input_schema": ADD_TOOL["function"]["parameters"],
}


def test_anthropic_tool_use_input_is_an_object_and_round_trips(proxy_server, engine):
    """``input`` must be an object: invalid arguments arrive as ``{"_raw_arguments": text}``,
    and sending that block back restores the model's exact text (the next turn still splices)."""
    engine.push(FORCED_BAD, "Sorry.", AUTO_NO_NAME)
    sid, key = open_session(proxy_server)
    client = anthropic.Anthropic(base_url=proxy_server.base_url, api_key=key, max_retries=0)
    r = client.messages.create(
        model="c",
        max_tokens=64,
        messages=MSGS,
        tools=[ANTH_ADD],
        tool_choice={"type": "tool", "name": "add"},
    )
    assert r.stop_reason == "tool_use"
    (block,) = [b for b in r.content if b.type == "tool_use"]
    assert block.name == "add" and block.input == {"_raw_arguments": '{"final: 2"}'}
    r2 = client.messages.create(
        model="c",
        max_tokens=64,
        tools=[ANTH_ADD],
        messages=[
            *MSGS,
            {"role": "assistant", "content": [b.model_dump() for b in r.content]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": block.id, "content": "bad input"}
                ],
            },
        ],
    )
    assert r2.content[0].text == "Sorry."
    # streamed, unreadable markup: text without markup, no tool_use block
    with client.messages.stream(model="c", max_tokens=64, messages=MSGS, tools=[ANTH_ADD]) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["text"]
    assert final.content[0].text.strip() == "Let me think."
    data = export_session(proxy_server, sid)
    assert data["stats"]["spliced"] >= 1  # turn 2 continued the model's own tokens
    assert (data["stats"]["tool_calls_raw_arguments"], data["stats"]["tool_markup_removed"]) == (
        1,
        1,
    )


def test_health_aggregates_the_counts(proxy_server, engine):
    before = httpx.get(proxy_server.base_url + "/health").json()["stats"]
    engine.push(AUTO_NO_NAME)
    _, key = open_session(proxy_server)
    _oai(proxy_server, key).chat.completions.create(model="m", messages=MSGS, tools=[ADD_TOOL])
    after = httpx.get(proxy_server.base_url + "/health").json()["stats"]
    assert after["tool_markup_removed"] == before["tool_markup_removed"] + 1


def test_agents_sdk_gets_a_call_and_answers_with_its_own_error(proxy_server, engine):
    """The Agents SDK receives the invalid-arguments call as a call, runs its own validation,
    and sends the error back to the model as the tool's output: a training signal."""
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    ran: list[tuple[int, int]] = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        ran.append((a, b))
        return a + b

    engine.push(AUTO_BAD, '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}]</tool_call>')
    engine.push("The answer is 3.")
    sid, key = open_session(proxy_server)
    client = openai.AsyncOpenAI(base_url=proxy_server.openai_base_url, api_key=key, max_retries=0)
    agent = Agent(
        name="adder",
        instructions="Use the add tool.",
        tools=[add],
        model=OpenAIChatCompletionsModel(model="m", openai_client=client),
    )
    result = asyncio.run(Runner.run(agent, "Add 1 and 2.", max_turns=5))
    assert result.final_output == "The answer is 3."
    assert ran == [(1, 2)]  # the invalid call never reached the function
    second_prompt = proxy_server.state.tokenizer.decode(engine.requests[-2].input_ids)
    # the SDK's own validation error went back to the model, after the model's exact call text
    assert AUTO_BAD + "<|im_end|>" in second_prompt
    # openai-agents < 0.5 names the JSON error; 0.24 sends a generic tool-error text
    assert (
        "Invalid JSON input for tool add" in second_prompt
        or "An error occurred while running the tool" in second_prompt
    )
    st = _stats(proxy_server, sid)
    assert (st["tool_calls_raw_arguments"], st["completions"]) == (1, 3)


def test_training_metrics_count_the_cases():
    """rollout_stats (the per-step metrics) sums the sessions' counts."""
    from areal_env.api.episode import Episode
    from areal_env.workflow.batch import rollout_stats

    recs = [
        Episode(
            accepted=True,
            export_stats={
                "tool_parse_failures": raw + removed,
                "tool_calls_raw_arguments": raw,
                "tool_markup_removed": removed,
            },
        )
        for raw, removed in [(2, 0), (1, 3)]
    ]
    stats = rollout_stats([], recs, trainer_version=0, wall_time=1.0)
    assert stats["tool_parse_failures"] == 6.0
    assert stats["tool_calls/raw_arguments"] == 3.0 and stats["tool_calls/markup_removed"] == 3.0
    json.dumps(stats)
