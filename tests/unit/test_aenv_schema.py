"""MCP → OpenAI tool schema conversion and tool-argument parsing."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_env.envs.schema import (
    VALID_NAME,
    ToolArgumentsError,
    normalize_openai_tools,
    parse_tool_arguments,
)


def _tool(name, schema=None, description="d"):
    t = {"name": name, "description": description}
    if schema is not None:
        t["inputSchema"] = schema
    return t


def test_prefix_stripped_when_unambiguous_and_schema_kept():
    schema = {"type": "object", "properties": {"a": {"type": "number"}}, "required": ["a"]}
    tools, name_map = normalize_openai_tools(
        [_tool("calc@1.0.0/add", schema), _tool("calc@1.0.0/mul")]
    )
    assert [t["function"]["name"] for t in tools] == ["add", "mul"]
    assert name_map == {"add": "calc@1.0.0/add", "mul": "calc@1.0.0/mul"}
    assert tools[0] == {
        "type": "function",
        "function": {"name": "add", "description": "d", "parameters": schema},
    }
    assert tools[0]["function"]["parameters"] is not schema  # a copy, safe to mutate


@pytest.mark.parametrize("schema", [None, {}, "nonsense", {"properties": None}])
def test_missing_or_empty_schema_becomes_empty_object(schema):
    tools, _ = normalize_openai_tools([_tool("e@1/ping", schema)])
    assert tools[0]["function"]["parameters"] == {"type": "object", "properties": {}}


def test_bare_name_collision_falls_back_to_qualified_names():
    tools, name_map = normalize_openai_tools([_tool("a@1/add"), _tool("b@2/add"), _tool("a@1/x")])
    names = [t["function"]["name"] for t in tools]
    assert names == ["a_1_add", "b_2_add", "x"]
    assert name_map["a_1_add"] == "a@1/add" and name_map["b_2_add"] == "b@2/add"


def test_sanitised_collisions_get_stable_hash_suffixes():
    originals = ["e@1/get.item", "e@1/get item", "e@1/get-item"]
    tools, name_map = normalize_openai_tools([_tool(n) for n in originals])
    names = [t["function"]["name"] for t in tools]
    assert len(set(names)) == 3 and "get-item" in names  # the valid one is untouched
    assert all(VALID_NAME.match(n) for n in names)
    assert sorted(name_map.values()) == sorted(originals)
    # order of the input does not change any name
    _, again = normalize_openai_tools([_tool(n) for n in reversed(originals)])
    assert again == name_map


def test_long_names_are_cut_to_64():
    long = "env@1/" + "x" * 100
    tools, name_map = normalize_openai_tools([_tool(long)])
    (name,) = name_map
    assert len(name) == 64 and VALID_NAME.match(name) and name_map[name] == long


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="without a name"):
        normalize_openai_tools([{"description": "x"}])
    with pytest.raises(ValueError, match="duplicate"):
        normalize_openai_tools([_tool("a"), _tool("a")])


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.text(alphabet=st.sampled_from(list("abcAB_-./@ 1é")), min_size=1, max_size=80),
        min_size=1,
        max_size=8,
        unique=True,
    ),
    st.randoms(use_true_random=False),
)
def test_round_trip_and_order_independence(names, rnd: random.Random):
    tools, name_map = normalize_openai_tools([_tool(n) for n in names])
    new_names = [t["function"]["name"] for t in tools]
    assert len(set(new_names)) == len(names)
    assert all(VALID_NAME.match(n) for n in new_names)
    assert [name_map[n] for n in new_names] == names  # reversible, in the input order
    shuffled = list(names)
    rnd.shuffle(shuffled)
    assert normalize_openai_tools([_tool(n) for n in shuffled])[1] == name_map


@pytest.mark.parametrize(
    "raw,expected",
    [
        (None, {}),
        ("", {}),
        ("   ", {}),
        ("null", {}),
        ({"a": 1}, {"a": 1}),
        ('{"a": 1, "b": [2]}', {"a": 1, "b": [2]}),
        (b'{"a": 1}', {"a": 1}),
    ],
)
def test_parse_tool_arguments_accepts(raw, expected):
    assert parse_tool_arguments(raw) == expected


@pytest.mark.parametrize(
    "raw,match",
    [
        ("{a: 1}", "not valid JSON"),
        ('{"a": 1', "not valid JSON"),
        ("[1, 2]", "must be a JSON object, got list"),
        ('"text"', "must be a JSON object, got str"),
        (42, "must be a JSON object, got int"),
    ],
)
def test_parse_tool_arguments_rejects_clearly(raw, match):
    with pytest.raises(ToolArgumentsError, match=match):
        parse_tool_arguments(raw)
