"""``parallel_tool_calls: false`` (OpenAI) and ``tool_choice.disable_parallel_tool_use`` (Anthropic):
one tool call at most per reply.

The engine part (``GenerationConfig.json_end_depth``) runs on the real model: a forced call list
stops after its first element. The proxy part runs the real SDKs against a real proxy over a
scripted model, so the reply the engine would give after that stop (``...}},`` with no ``]``)
is exact: one call is answered, the parse drops the ``,``, and the next turn's history closes
the list. A free (``auto``) reply with two calls answers the first.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from areal_env.api.io import GenerationConfig, ModelRequest
from areal_env.engine.json_end import JsonEnd
from areal_env.engine.testing import Reply
from tests.fixtures.proxy import export_session, open_session
from tests.unit.test_proxy_malformed_output import ADD_TOOL as ADD

MSGS = [{"role": "user", "content": "Add 1 and 2, then 3 and 4."}]
TWO_CALLS = (
    '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}, '
    '{"name": "add", "arguments": {"a": 3, "b": 4}}]</tool_call>'
)


@pytest.fixture
def scripted(scripted_proxy):
    engine = scripted_proxy.state.engine
    yield scripted_proxy, engine
    assert engine.pending == 0, "a scripted reply was not used"


def _oai(proxy, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.openai_base_url, api_key=key, max_retries=0)


def test_json_end_stops_at_the_first_element_with_depth_one():
    j = JsonEnd('[{"name": "', 1)
    assert not j.feed('add", "arguments": {"a": "}],", "b": 2')
    assert not j.feed("}")
    assert j.feed('}, {"name"') and j.rest == ', {"name"'
    whole = JsonEnd('[{"name": "')
    assert not whole.feed('add", "arguments": {}}, {"name": "b", "arguments": {}}')
    assert whole.feed("]")
    assert JsonEnd("", 1).feed('<tool_call>[{"a": [1]}, ') is True
    with pytest.raises(ValueError, match="depth"):
        JsonEnd("", -1)


def test_required_call_stops_after_one_call_and_the_history_closes_the_list(scripted):
    proxy, engine = scripted
    # what the real engine returns once the first call closed: a "}," token, no "]", no eos
    engine.push(Reply(text='add", "arguments": {"a": 1, "b": 2}},', eos=False), "3")
    sid, key = open_session(proxy)
    client = _oai(proxy, key)
    r = client.chat.completions.create(
        model="m", messages=MSGS, tools=[ADD], tool_choice="required", parallel_tool_calls=False
    )
    g = engine.requests[-1].gconfig
    assert (g.stop_at_json_end, g.json_end_depth) == ('[{"name": "', 1)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}
    assert r.choices[0].finish_reason == "tool_calls"
    # the next turn continues the model's exact tokens, and the history closes its call list
    history = [
        *MSGS,
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "3"},
    ]
    client.chat.completions.create(model="m", messages=history, tools=[ADD])
    prompt = proxy.state.tokenizer.decode(engine.requests[-1].input_ids)
    assert '"b": 2}},]<|im_end|>' in prompt, prompt[-200:]
    first, second = export_session(proxy, sid)["interactions"]
    assert second["parent_id"] == first["id"] and second["spliced"]
    # without parallel_tool_calls: false the whole list is awaited, as before
    engine.push(Reply(text='add", "arguments": {"a": 1, "b": 2}}]', eos=False))
    client.chat.completions.create(model="m", messages=MSGS, tools=[ADD], tool_choice="required")
    g = engine.requests[-1].gconfig
    assert (g.stop_at_json_end, g.json_end_depth) == ('[{"name": "', 0)


def test_a_free_reply_with_two_calls_answers_the_first(scripted):
    proxy, engine = scripted
    engine.push(TWO_CALLS, TWO_CALLS)
    sid, key = open_session(proxy)
    client = _oai(proxy, key)
    one = client.chat.completions.create(
        model="m", messages=MSGS, tools=[ADD], parallel_tool_calls=False, max_tokens=64
    )
    assert [json.loads(c.function.arguments) for c in one.choices[0].message.tool_calls] == [
        {"a": 1, "b": 2}
    ]
    assert export_session(proxy, sid)["stats"]["parallel_calls_dropped"] == 1
    both = client.chat.completions.create(model="m", messages=MSGS, tools=[ADD], max_tokens=64)
    assert len(both.choices[0].message.tool_calls) == 2


def test_strict_tools_grammar_holds_one_call(scripted):
    proxy, engine = scripted
    strict = {"type": "function", "function": {**ADD["function"], "strict": True}}
    engine.push('<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}]</tool_call>')
    engine.push('<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}]</tool_call>')
    _, key = open_session(proxy)
    client = _oai(proxy, key)
    client.chat.completions.create(
        model="m", messages=MSGS, tools=[strict], parallel_tool_calls=False
    )
    one = engine.requests[-1].gconfig.constraint
    client.chat.completions.create(model="m", messages=MSGS, tools=[strict])
    many = engine.requests[-1].gconfig.constraint
    assert one is not None and many is not None
    assert '(", " call)*' in many.value and '(", " call)*' not in one.value


def test_the_protocols_read_and_check_the_setting(scripted):
    proxy, engine = scripted
    engine.push(TWO_CALLS, TWO_CALLS)
    _, key = open_session(proxy)
    client = _oai(proxy, key)
    with pytest.raises(openai.BadRequestError, match="parallel_tool_calls"):
        client.chat.completions.create(
            model="m", messages=MSGS, tools=[ADD], parallel_tool_calls="no"
        )
    # Responses: one function_call item, and the response says what was asked
    resp = client.responses.create(
        model="m",
        input="Add 1 and 2, then 3 and 4.",
        tools=[_responses_tool()],
        parallel_tool_calls=False,
        max_output_tokens=64,
    )
    assert resp.parallel_tool_calls is False
    assert [item.type for item in resp.output] == ["function_call"]
    assert json.loads(resp.output[0].arguments) == {"a": 1, "b": 2}
    # Anthropic: tool_choice.disable_parallel_tool_use
    claude = anthropic.Anthropic(base_url=proxy.base_url, api_key=key, max_retries=0)
    msg = claude.messages.create(
        model="m",
        max_tokens=64,
        messages=MSGS,
        tools=[_anthropic_tool()],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
    )
    assert [b.type for b in msg.content] == ["tool_use"]
    assert msg.content[0].input == {"a": 1, "b": 2}
    with pytest.raises(anthropic.BadRequestError, match="disable_parallel_tool_use"):
        claude.messages.create(
            model="m",
            max_tokens=32,
            messages=MSGS,
            tools=[_anthropic_tool()],
            tool_choice={"type": "auto", "disable_parallel_tool_use": "yes"},
        )


def _responses_tool() -> dict:
    fn = ADD["function"]
    return {"type": "function", "name": fn["name"], "parameters": fn["parameters"]}


def _anthropic_tool() -> dict:
    fn = ADD["function"]
    return {"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}


async def test_the_engine_stops_a_call_list_after_its_first_call(engine, tokenizer):
    """The real engine, forced to write two calls, ends its output with the first one."""
    prompt = tokenizer.encode("Calls: ", add_special_tokens=False)
    forced = tokenizer.encode(
        'add", "arguments": {"a": 1}}, {"name": "add", "arguments": {"a": 2}}]',
        add_special_tokens=False,
    )
    for depth, ends_with in ((1, '{"a": 1}}'), (0, '{"a": 2}}]')):
        g = GenerationConfig(
            max_new_tokens=len(forced) + 4,
            greedy=True,
            prefix_choices=[forced],
            stop_at_json_end='[{"name": "',
            json_end_depth=depth,
        )
        resp = await engine.agenerate(ModelRequest(input_ids=prompt, gconfig=g, rid=f"d{depth}"))
        text = tokenizer.decode(resp.output_tokens)
        assert resp.stop_reason == "stop"
        assert text.rstrip(",").endswith(ends_with), (depth, text)
