"""The proxy through the official ``anthropic`` SDK and the OpenAI Responses API.

The engine is scripted (no model): each test says what the "model" answers, so every protocol
path (tool_use blocks, streamed input_json_delta, stop sequences, function calls) is asserted
exactly, not only when a small model happens to produce it."""

from __future__ import annotations

import anthropic
import openai
import pytest

from areal_env.engine.testing import Reply
from tests.fixtures.proxy import export_session, open_session

ADD_CALL = '<tool_call>[{"name": "add", "arguments": {"a": 2, "b": 3}}]</tool_call>'


@pytest.fixture(scope="module")
def proxy_server(scripted_proxy):
    return scripted_proxy


@pytest.fixture
def engine(proxy_server):
    engine = proxy_server.state.engine
    yield engine
    assert engine.pending == 0, "a scripted reply was not used"


ADD = {
    "name": "add",
    "description": "Add two integers.",
    "input_schema": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
}


def _client(proxy_server, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy_server.base_url, api_key=key, max_retries=0)


def test_messages_basic(proxy_server, engine):
    engine.push("Hello!")
    sid, key = open_session(proxy_server)
    client = _client(proxy_server, key)
    r = client.messages.create(
        model="claude-ish",
        max_tokens=10,
        system=[{"type": "text", "text": "Be brief."}],
        messages=[{"role": "user", "content": "Say hello."}],
        extra_body={"temperature": 0},
        metadata={"user_id": "u1"},
    )
    assert r.id.startswith("msg_") and r.model == "claude-ish" and r.role == "assistant"
    assert r.stop_reason == "end_turn"
    assert [(b.type, b.text) for b in r.content] == [("text", "Hello!")]
    assert 0 < r.usage.output_tokens <= 10 and r.usage.input_tokens > 0
    assert engine.requests[-1].gconfig.is_greedy  # temperature 0 reached the engine
    (info,) = export_session(proxy_server, sid)["interactions"]
    assert info["id"] == r.id and "Be brief." in info["prompt_text"]


def test_tool_use_round_trip_is_structured_and_spliced(proxy_server, engine):
    """tool_use / tool_result blocks become real tool turns; turn 2 splices onto turn 1."""
    # forced tool_choice: the prompt already holds the call's start, the model continues it
    engine.push(' {"a": 2, "b": 3}}]</tool_call>', "The sum is 5.")
    sid, key = open_session(proxy_server)
    client = _client(proxy_server, key)
    msgs = [{"role": "user", "content": "What is 2 + 3? Use the add tool."}]
    r1 = client.messages.create(
        model="m",
        max_tokens=40,
        tools=[ADD],
        tool_choice={"type": "tool", "name": "add"},
        messages=msgs,
        extra_body={"temperature": 0},
    )
    (tool_use,) = [b for b in r1.content if b.type == "tool_use"]
    assert r1.stop_reason == "tool_use"
    assert tool_use.name == "add" and tool_use.input == {"a": 2, "b": 3}
    assistant_blocks = [b.model_dump(exclude_none=True) for b in r1.content]
    use_id = tool_use.id
    history = [
        *msgs,
        {"role": "assistant", "content": assistant_blocks},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": use_id,
                    "content": [{"type": "text", "text": "5"}],
                }
            ],
        },
    ]
    r2 = client.messages.create(
        model="m", max_tokens=12, tools=[ADD], messages=history, extra_body={"temperature": 0}
    )
    assert r2.stop_reason == "end_turn" and r2.content[0].text == "The sum is 5."
    data = export_session(proxy_server, sid)
    second = next(i for i in data["interactions"] if i["id"] == r2.id)
    assert "<tool_response>\n5\n</tool_response>" in second["prompt_text"]
    assert second["parent_id"] == r1.id and second["spliced"]


def test_messages_streaming(proxy_server, engine):
    engine.push("Cats are small, curious animals.")
    _, key = open_session(proxy_server)
    client = _client(proxy_server, key)
    with client.messages.stream(
        model="m",
        max_tokens=12,
        messages=[{"role": "user", "content": "Tell me about cats."}],
        extra_body={"temperature": 0},
    ) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_start" in events and "message_delta" in events
    text = "".join(b.text for b in final.content if b.type == "text")
    assert text == "Cats are small, curious animals." and final.stop_reason == "end_turn"
    assert events.count("content_block_delta") > 1  # streamed token by token
    assert final.usage.output_tokens > 0


def test_messages_streaming_tool_use(proxy_server, engine):
    # tool_choice "any": the prompt opens a call; the model names the tool and continues
    tools = [{"type": "function", "function": {"name": "add", "parameters": ADD["input_schema"]}}]
    opened = proxy_server.state.renderer.prefill_text(tools, "required")
    assert opened and ADD_CALL.startswith(opened)
    engine.push(Reply(text=ADD_CALL[len(opened) :]))
    _, key = open_session(proxy_server)
    client = _client(proxy_server, key)
    with client.messages.stream(
        model="m",
        max_tokens=40,
        tools=[ADD],
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "Add 1 and 2."}],
        extra_body={"temperature": 0},
    ) as stream:
        final = stream.get_final_message()
    (use,) = [b for b in final.content if b.type == "tool_use"]
    # the SDK assembled input_json_delta into the input dict
    assert final.stop_reason == "tool_use" and use.name == "add"
    assert use.input == {"a": 2, "b": 3}


def test_stop_sequences(proxy_server, engine):
    engine.push("Dogs are loyal friends.")
    _, key = open_session(proxy_server)
    client = _client(proxy_server, key)
    r = client.messages.create(
        model="m",
        max_tokens=30,
        stop_sequences=[" "],
        messages=[{"role": "user", "content": "Write a long sentence about dogs."}],
        extra_body={"temperature": 0},
    )
    text = "".join(b.text for b in r.content if b.type == "text")
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == " " and text == "Dogs"


def test_responses_api_text_function_call_and_stream(proxy_server, engine):
    engine.push("Hi!", ADD_CALL, "You're welcome.", "One, two, three.")
    sid, key = open_session(proxy_server)
    client = openai.OpenAI(base_url=proxy_server.openai_base_url, api_key=key, max_retries=0)
    r = client.responses.create(
        model="m", instructions="Be brief.", input="Say hi.", max_output_tokens=8, temperature=0
    )
    assert r.id.startswith("resp_") and r.status == "completed"
    assert r.output_text == "Hi!" and r.output[0].type == "message"
    tool = {
        "type": "function",
        "name": "add",
        "description": "Add two integers.",
        "parameters": ADD["input_schema"],
    }
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "What is 2 + 3?"}]},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "add",
            "arguments": '{"a": 2, "b": 3}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "5"},
    ]
    r2 = client.responses.create(
        model="m", input=items, tools=[tool], max_output_tokens=40, temperature=0
    )
    (call,) = r2.output
    assert call.type == "function_call" and call.name == "add"
    assert call.arguments == '{"a": 2, "b": 3}'
    # follow-up via previous_response_id extends r2 in the tree
    r3 = client.responses.create(
        model="m", previous_response_id=r2.id, input="Thanks!", tools=[tool], max_output_tokens=4
    )
    events = list(
        client.responses.create(
            model="m", input="Count to three.", max_output_tokens=8, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert r3.output_text == "You're welcome."
    assert "response.output_text.delta" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    data = export_session(proxy_server, sid)
    by_id = {i["id"]: i for i in data["interactions"]}
    assert "<tool_response>\n5\n</tool_response>" in by_id[r2.id]["prompt_text"]
    assert by_id[r3.id]["parent_id"] == r2.id and by_id[r3.id]["spliced"]
