"""Tool-call parsers: every family, object/list forms, malformed input, round trips, fuzzing."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_env.proxy.tool_json import normalize_arguments
from areal_env.proxy.tool_parsers import (
    available_tool_parsers,
    detect_tool_parser,
    example_arguments,
    get_tool_parser,
)

FAMILIES = ["hermes", "qwen", "llama3", "mistral", "none"]
ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def args(call):
    return json.loads(call["arguments"])


# ---- hermes / qwen -----------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["hermes", "qwen"])
def test_hermes_object_and_list_forms(family):
    p = get_tool_parser(family)
    content, calls, err = p.parse(
        '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    )
    assert (content, err) == (None, False)
    assert calls == [{"name": "add", "arguments": '{"a": 1}'}]
    # SmolLM2 emits a JSON list inside one tag: parallel calls
    content, calls, err = p.parse(
        'Let me compute.<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}, '
        '{"name": "mul", "parameters": {"x": 3}}]</tool_call>'
    )
    assert not err and content == "Let me compute."
    assert [c["name"] for c in calls] == ["add", "mul"]
    assert args(calls[0]) == {"a": 1, "b": 2} and args(calls[1]) == {"x": 3}


def test_hermes_tolerates_fences_whitespace_trailing_text_and_missing_close():
    p = get_tool_parser("hermes")
    text = (
        '  <tool_call>\n```json\n{"name": "a", "arguments": "{\\"q\\": \\"x\\"}"}\n```\n</tool_call>'
        '\n<tool_call>{"name": "b"} trailing junk</tool_call> after\n'
        '<tool_call>  {"name": "c", "arguments": {"k": [1, 2]}}'
    )
    content, calls, err = p.parse(text)
    assert not err
    assert [c["name"] for c in calls] == ["a", "b", "c"]
    assert args(calls[0]) == {"q": "x"}
    assert calls[1]["arguments"] == "{}"
    assert args(calls[2]) == {"k": [1, 2]}
    assert content == "after"


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>',  # truncated JSON
        "<tool_call>add(1, 2)</tool_call>",  # not JSON
        '<tool_call>{"arguments": {"a": 1}}</tool_call>',  # no name
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',  # args not an object
        '<tool_call>{"name": "add", "arguments": "not json"}</tool_call>',
        "<tool_call></tool_call>",
        "<tool_call>[]</tool_call>",
        '<tool_call>[{"name": "ok"}, 5]</tool_call>',
    ],
)
def test_hermes_malformed_is_text_with_error(text):
    content, calls, err = get_tool_parser("hermes").parse(text)
    assert err is True and calls == [] and content == text


def test_plain_text_is_not_an_error():
    for family in FAMILIES:
        p = get_tool_parser(family)
        assert p.parse("The answer is 5.") == ("The answer is 5.", [], False)
        assert p.parse("") == (None, [], False)


# ---- llama3 ------------------------------------------------------------------------------------
def test_llama3_bare_json_python_tag_and_semicolons():
    p = get_tool_parser("llama3")
    content, calls, err = p.parse('{"name": "add", "parameters": {"a": 1, "b": 2}}')
    assert (content, err) == (None, False) and calls[0]["name"] == "add"
    assert args(calls[0]) == {"a": 1, "b": 2}
    content, calls, err = p.parse(
        '<|python_tag|>{"name": "a", "arguments": {"x": 1}}; {"name": "b", "parameters": {}}'
    )
    assert not err and [c["name"] for c in calls] == ["a", "b"] and content is None
    content, calls, err = p.parse('```json\n{"name": "a", "parameters": {}}\n```')
    assert not err and calls[0]["name"] == "a"
    content, calls, err = p.parse('{"name": "a", "parameters": {}} and then some words')
    assert not err and content == "and then some words"


def test_llama3_json_answer_is_content_and_malformed_call_is_error():
    p = get_tool_parser("llama3")
    assert p.parse('{"answer": 42}') == ('{"answer": 42}', [], False)
    assert p.parse("{not json at all") == ("{not json at all", [], False)
    bad = '{"name": "add", "parameters": {"a": 1'
    assert p.parse(bad) == (bad, [], True)
    tagged = "<|python_tag|>print(1)"
    assert p.parse(tagged) == (tagged, [], True)


# ---- mistral -----------------------------------------------------------------------------------
def test_mistral_list_and_v11_forms():
    p = get_tool_parser("mistral")
    content, calls, err = p.parse(
        'Sure.[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, {"name": "b", "arguments": {}}]'
    )
    assert not err and content == "Sure." and [c["name"] for c in calls] == ["add", "b"]
    content, calls, err = p.parse('[TOOL_CALLS]add[ARGS]{"a": 2}[TOOL_CALLS]mul[ARGS]{"x": 1}')
    assert not err and content is None
    assert [(c["name"], args(c)) for c in calls] == [("add", {"a": 2}), ("mul", {"x": 1})]


@pytest.mark.parametrize(
    "text",
    ["[TOOL_CALLS] [{'name': 'add'}]", "[TOOL_CALLS]", '[TOOL_CALLS]add[ARGS]{"a": '],
)
def test_mistral_malformed(text):
    assert get_tool_parser("mistral").parse(text) == (text, [], True)


def test_none_never_parses():
    text = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    assert get_tool_parser("none").parse(text) == (text, [], False)


# ---- formats, registry, detection --------------------------------------------------------------
@pytest.mark.parametrize("family", ["hermes", "qwen", "llama3", "mistral"])
def test_format_then_parse_round_trip(family):
    p = get_tool_parser(family)
    calls = [
        {"name": "add", "arguments": '{"a": 1, "b": 2}'},
        {"name": "lookup", "arguments": {"q": 'ünïcode "quoted"'}},
    ]
    content, parsed, err = p.parse(p.format_calls(calls))
    assert not err and content is None
    assert [(c["name"], args(c)) for c in parsed] == [
        ("add", {"a": 1, "b": 2}),
        ("lookup", {"q": 'ünïcode "quoted"'}),
    ]


@pytest.mark.parametrize("family", ["hermes", "qwen", "llama3", "mistral"])
def test_prefill_plus_continuation_parses(family):
    p = get_tool_parser(family)
    arg_key = "parameters" if family == "llama3" else "arguments"
    tail = {"hermes": "}]</tool_call>", "qwen": "}\n</tool_call>", "llama3": "}", "mistral": "}]"}
    _, calls, err = p.parse(p.prefill("add") + ' {"a": 1}' + tail[family])
    assert not err and calls == [{"name": "add", "arguments": '{"a": 1}'}]
    _, calls, err = p.parse(p.prefill(None) + f'add", "{arg_key}": {{"a": 1}}' + tail[family])
    assert not err and calls == [{"name": "add", "arguments": '{"a": 1}'}]


def test_instructions_offer_tools_and_a_worked_example():
    text = get_tool_parser("hermes").instructions([ADD_TOOL])
    assert "<tools>" in text and '"name": "add"' in text and "Add two integers" in text
    assert "<tool_call>[{" in text and "must call" not in text
    assert "at least one tool" in get_tool_parser("hermes").instructions([ADD_TOOL], "required")
    named = {"type": "function", "function": {"name": "add"}}
    assert "must call the tool `add`" in get_tool_parser("qwen").instructions([ADD_TOOL], named)
    assert get_tool_parser("none").instructions([ADD_TOOL]) == ""
    assert get_tool_parser("hermes").instructions([]) == ""
    example = get_tool_parser("hermes").worked_example([ADD_TOOL])
    assert example == [
        {"role": "user", "content": "Use the add tool with a = 3 and b = 5."},
        {
            "role": "assistant",
            "content": '<tool_call>[{"name": "add", "arguments": {"a": 3, "b": 5}}]</tool_call>',
        },
    ]
    # the example's call parses back with the family's own parser
    for family in ("hermes", "qwen", "llama3", "mistral"):
        p = get_tool_parser(family)
        _, calls, err = p.parse(p.worked_example([ADD_TOOL])[1]["content"])
        assert not err and calls == [{"name": "add", "arguments": '{"a": 3, "b": 5}'}]
    assert get_tool_parser("none").worked_example([ADD_TOOL]) == []


def test_example_arguments_follow_schema():
    fn = {
        "name": "f",
        "parameters": {
            "type": "object",
            "properties": {
                "s": {"type": "string"},
                "e": {"type": "string", "enum": ["x", "y"]},
                "b": {"type": ["boolean", "null"]},
            },
            "required": ["e", "b"],
        },
    }
    assert example_arguments(fn) == {"e": "x", "b": True}
    assert example_arguments({"name": "g"}) == {}


def test_registry_and_detection():
    assert set(FAMILIES) <= set(available_tool_parsers())
    with pytest.raises(ValueError, match="unknown tool parser"):
        get_tool_parser("nope")
    assert detect_tool_parser("{{ '<tool_call>' }}") == "qwen"
    assert detect_tool_parser("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert detect_tool_parser("{{ '<|python_tag|>' }} ipython") == "llama3"
    assert detect_tool_parser("{{'<|im_start|>' + message['role']}}") == "hermes"
    assert detect_tool_parser(None) == "hermes"


def test_normalize_arguments():
    assert normalize_arguments(None) == "{}"
    assert normalize_arguments('{"a":1}') == '{"a": 1}'
    assert normalize_arguments({"a": 1}) == '{"a": 1}'
    assert normalize_arguments("[1]") is None
    assert normalize_arguments("nope") is None


# ---- fuzzing: parsing never raises -------------------------------------------------------------
_fragments = st.sampled_from(
    [
        "<tool_call>",
        "</tool_call>",
        "[TOOL_CALLS]",
        "[ARGS]",
        "<|python_tag|>",
        '{"name": "add", "arguments": {"a": 1}}',
        '{"name": ',
        "[",
        "]",
        "{",
        "}",
        ";",
        "```json\n",
        "```",
        '"',
        "\\",
        "\n",
        "text",
    ]
)


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.one_of(_fragments, st.text(max_size=8)), max_size=12))
def test_parsers_never_raise(parts):
    text = "".join(parts)
    for family in FAMILIES:
        content, calls, err = get_tool_parser(family).parse(text)
        assert content is None or isinstance(content, str)
        assert isinstance(err, bool)
        for call in calls:
            assert isinstance(call["name"], str) and call["name"]
            assert isinstance(json.loads(call["arguments"]), dict)
        if err:
            assert calls == [] and content == text


@pytest.mark.parametrize(
    "family, text, content, calls",
    [
        (
            "hermes",
            'Sure. <tool_call>[{"name": "add", "arguments": {"a": 1</tool_call> done',
            "Sure.  done",
            [("add", '{"a": 1')],
        ),
        ("hermes", "<tool_call>garbage</tool_call>", None, []),
        (
            "hermes",
            '<tool_call>[{"name": "add", "arguments": {"a": 1}}, '
            '{"name": "sub", "arguments": {x}}]</tool_call>',
            None,
            [("add", '{"a": 1}'), ("sub", "{x}")],
        ),
        (
            "qwen",
            '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>',
            None,
            [("add", '{"a": 1,}')],
        ),
        ("llama3", '{"name": "add", "parameters": {a: 1}}', None, [("add", "{a: 1}")]),
        ("llama3", 'Hi <|python_tag|>{"name": "add", "parameters": [', "Hi", [("add", "[")]),
        ("mistral", "hi [TOOL_CALLS]add[ARGS]{a: 1}", "hi", [("add", "{a: 1}")]),
        ("mistral", 'x [TOOL_CALLS][{"name": "f", "arguments": oops}]', "x", [("f", "oops")]),
    ],
)
def test_salvage_recovers_names_and_raw_arguments(family, text, content, calls):
    parser = get_tool_parser(family)
    assert parser.parse(text)[2] is True  # these really fail to parse
    found = parser.salvage(text)
    assert found.content == content
    assert [(c["name"], c["arguments"]) for c in found.calls] == calls
