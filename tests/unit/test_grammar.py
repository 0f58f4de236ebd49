"""Grammars without a model: the constraint compiler (llguidance with the real tokenizer), the
closing of an unfinished reply, schema refusals, and the tool-call grammars of every family."""

from __future__ import annotations

import json

import pytest

from areal_env.api.io import Constraint
from areal_env.engine.grammar import ConstraintError, GrammarCompiler, schema_error
from areal_env.proxy.tool_parsers import get_tool_parser

PLUS = {
    "type": "function",
    "function": {
        "name": "plus",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
            "required": ["x", "y"],
            "additionalProperties": False,
        },
    },
}
ECHO = {"type": "function", "function": {"name": "echo", "parameters": {"type": "object"}}}
ANSWER = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "required": ["a"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def _accepts(compiler, tokenizer, constraint: Constraint, text: str) -> bool:
    g = compiler.matcher(constraint)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(g.consume(t) for t in ids) and g.matcher.is_accepting()


def test_schemas_that_cannot_be_honoured_are_named():
    assert schema_error({"type": "object"}) is None
    assert "uniqueItems" in (schema_error({"type": "array", "uniqueItems": True}) or "")
    assert schema_error({"type": "strin"})
    assert schema_error({"$ref": "#/$defs/Missing"})
    assert schema_error([1, 2])


def test_compiled_constraints_are_cached_and_bad_ones_refused(compiler, tokenizer):
    c = Constraint("json_schema", json.dumps(ANSWER))
    before = compiler.compiled
    assert _accepts(compiler, tokenizer, c, '{"a": 12}')
    assert not _accepts(compiler, tokenizer, c, '{"a": "x"}')
    assert compiler.compiled == before + 1 and compiler.cached(c)
    with pytest.raises(ConstraintError):
        compiler.matcher(Constraint("json_schema", '{"type": "array", "uniqueItems": true}'))
    with pytest.raises(ConstraintError):
        compiler.matcher(Constraint("grammar", "start: undefined_rule"))


def test_an_unfinished_reply_closes_where_the_grammar_allows(compiler, tokenizer):
    """Near the end of the budget only closing tokens are offered: inside a string the ones
    that start with a quote (``}`` would just be more string), then brackets, then eos."""
    filler = compiler.mask_filler()
    for schema, start in (
        ({"type": "object"}, '{"abc'),
        (ANSWER | {"properties": {"a": {"type": "string"}}}, '{"a": "some long te'),
        ({"type": "array", "items": {"type": "array", "items": {"type": "string"}}}, '[["x", "y'),
    ):
        g = compiler.matcher(Constraint("json_schema", json.dumps(schema)))
        for t in tokenizer.encode(start, add_special_tokens=False):
            assert g.consume(t)
        out = start
        for _ in range(12):
            (mask,) = filler.start([g]).result()
            narrowed = g.close(mask)
            allowed = narrowed.nonzero().squeeze(1).tolist()
            if g.matcher.is_accepting():
                assert tokenizer.eos_token_id in allowed
                break
            token = allowed[0]
            out += tokenizer.decode([token])
            assert g.consume(token)
        else:
            raise AssertionError(f"not closed within 12 tokens: {out!r}")
        json.loads(out)
    filler.close()


@pytest.mark.parametrize("family", ["hermes", "qwen", "llama3", "mistral"])
def test_tool_call_grammars_of_every_family(compiler, tokenizer, family):
    """Strict arguments are enforced inside each family's call format; a tool that is not
    strict takes any object; free text (auto) or a JSON answer (with a format) besides calls;
    after a named or required prefill, the rest of the call."""
    parser = get_tool_parser(family)
    good = parser.format_calls([{"name": "plus", "arguments": {"x": 1, "y": 2}}])
    bad = parser.format_calls([{"name": "plus", "arguments": {"x": 1}}])
    loose = parser.format_calls([{"name": "echo", "arguments": {"anything": [1]}}])
    tools = [PLUS, ECHO]

    def grammar(choice=None, answer=None) -> Constraint:
        text = parser.call_grammar(tools, choice, answer)
        assert text
        return Constraint("grammar", text)

    auto = grammar()
    assert _accepts(compiler, tokenizer, auto, good)
    assert _accepts(compiler, tokenizer, auto, loose)
    assert not _accepts(compiler, tokenizer, auto, bad)
    assert _accepts(compiler, tokenizer, auto, "Just some text.")
    with_answer = grammar(answer=ANSWER)
    assert _accepts(compiler, tokenizer, with_answer, good)
    assert _accepts(compiler, tokenizer, with_answer, '{"a": 3}')
    assert not _accepts(compiler, tokenizer, with_answer, "Just some text.")
    required = grammar("required")
    pre = parser.prefill(None)
    assert _accepts(compiler, tokenizer, required, good[len(pre) :])
    assert not _accepts(compiler, tokenizer, required, bad[len(pre) :])
    named = grammar({"type": "function", "function": {"name": "plus"}})
    pre = parser.prefill("plus")
    assert _accepts(compiler, tokenizer, named, good[len(pre) :])
    assert not _accepts(compiler, tokenizer, named, bad[len(pre) :])
    assert get_tool_parser("none").call_grammar(tools) is None


def test_proxy_cli_sets_the_engines_threads(monkeypatch):
    """``areal-env proxy --threads N`` reaches the engine's ``num_threads`` (the CLI had no
    way to set it; on a loaded 2-core machine the default ran at 0.2-1.6 tok/s, 9 with one)."""
    from areal_env.engine import local
    from areal_env.proxy import server

    seen: dict = {}

    class Stop(Exception):
        pass

    class Engine:
        def __init__(self, path, **kwargs):
            seen.update(kwargs)

        def initialize(self):
            raise Stop

    monkeypatch.setattr(local, "LocalEngine", Engine)
    with pytest.raises(Stop):
        server.main(["--threads", "1", "--port", "0"])
    assert seen["num_threads"] == 1
    assert server.main(["--threads", "0"]) == 2
