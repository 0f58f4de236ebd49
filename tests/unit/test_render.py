"""ChatRenderer with the real SmolLM2 tokenizer: tools, tool_choice, splicing, token-exactness."""

from __future__ import annotations

import copy
import json

import pytest

from areal_env.proxy.cache import Interaction, InteractionCache
from areal_env.proxy.render import ChatRenderer, RenderError

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
TOOLS = [ADD_TOOL]
NAMED = {"type": "function", "function": {"name": "add"}}


@pytest.fixture(scope="module")
def renderer(tokenizer) -> ChatRenderer:
    return ChatRenderer(tokenizer)


def enc(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def interaction(messages, output_message, prompt_ids, output_ids, tools=None, parent=None):
    n = len(output_ids)
    return Interaction(
        id=Interaction.new_id(),
        session_id="s",
        messages=messages,
        tools=tools,
        output_message=output_message,
        prompt_ids=prompt_ids,
        output_ids=output_ids,
        output_logprobs=[-0.1] * n,
        output_versions=[0] * n,
        stop_reason="stop",
        parent_id=parent.id if parent else None,
    )


# ---- template facts and plain rendering --------------------------------------------------------
def test_smollm2_template_is_detected_as_ignoring_tools(renderer, tokenizer):
    assert renderer.tool_parser_name == "hermes"
    assert renderer.native_tools is False
    assert renderer.end_of_turn == "<|im_end|>\n"
    assert renderer.stop_token_ids == [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_render_without_tools_matches_the_template(renderer, tokenizer):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    expected = enc(
        tokenizer, tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    )
    assert renderer.render_prompt(msgs) == expected
    # content as None / parts / developer role render like their plain equivalents
    variants = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi there"}]},
    ]
    assert renderer.render_prompt(variants) == expected
    assert "<tools>" not in renderer.render_text(msgs, TOOLS, "none")


def test_tools_are_injected_into_the_system_prompt(renderer, tokenizer):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    text = renderer.render_text(msgs, TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n")
    assert "<tools>" in text and '"name": "add"' in text and "Add two integers" in text
    # one worked example exchange follows the system prompt, then the real conversation
    assert (
        "<|im_end|>\n<|im_start|>user\nUse the add tool with a = 3 and b = 5.<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>[{"name": "add", "arguments": {"a": 3, "b": 5}}]'
        "</tool_call><|im_end|>\n<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n"
    ) in text
    assert renderer.render_prompt(msgs, TOOLS) != renderer.render_prompt(msgs)
    # without a system message one is added (instead of the template's default one)
    text = renderer.render_text(msgs[1:], TOOLS)
    assert text.startswith("<|im_start|>system\nYou solve tasks by composing function calls.")
    assert "SmolLM" not in text
    plain = ChatRenderer(tokenizer, worked_example=False).render_text(msgs, TOOLS)
    assert "<tools>" in plain and "Use the add tool" not in plain


def test_history_with_calls_and_results_renders_in_the_taught_format(renderer):
    msgs = [
        {"role": "user", "content": "2+3 and 4+5?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "add", "arguments": {"a": 4, "b": 5}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "9"}]},
    ]
    text = renderer.render_text(msgs, TOOLS)
    assert (
        '<|im_start|>assistant\n<tool_call>[{"name": "add", "arguments": {"a": 2, "b": 3}}, '
        '{"name": "add", "arguments": {"a": 4, "b": 5}}]</tool_call><|im_end|>\n'
    ) in text
    assert (
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n"
        "<tool_response>\n9\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in text


def test_bad_messages_raise_render_error(renderer):
    with pytest.raises(RenderError, match="role"):
        renderer.render_prompt([{"role": "wizard", "content": "x"}])
    with pytest.raises(RenderError, match="image_url"):
        renderer.render_prompt(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
        )
    with pytest.raises(RenderError):
        renderer.render_prompt([])
    assert issubclass(RenderError, ValueError)


# ---- tool_choice -------------------------------------------------------------------------------
def test_required_and_named_prefill_a_call(renderer, tokenizer):
    msgs = [{"role": "user", "content": "2+3?"}]
    base = renderer.render_text(msgs, TOOLS, "required")
    assert "at least one tool" in base
    ids = renderer.render_prompt(msgs, TOOLS, "required")
    assert tokenizer.decode(ids).endswith('<|im_start|>assistant\n<tool_call>[{"name": "')
    out = enc(tokenizer, 'add", "arguments": {"a": 2, "b": 3}}]</tool_call>') + [2]
    parsed = renderer.parse_output(out, "stop", TOOLS, "required")
    assert parsed.finish_reason == "tool_calls" and not parsed.tool_parse_error
    assert parsed.tool_calls[0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}

    ids = renderer.render_prompt(msgs, TOOLS, NAMED)
    assert tokenizer.decode(ids).endswith('<tool_call>[{"name": "add", "arguments":')
    out = enc(tokenizer, ' {"a": 1, "b": 1}}]</tool_call>') + [2]
    parsed = renderer.parse_output(out, "stop", TOOLS, NAMED)
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"a": 1, "b": 1}
    # auto / none: no prefill
    assert renderer.prefill_text(TOOLS, "auto") == "" and renderer.prefill_text(TOOLS, "none") == ""
    # a named tool that was not offered is not forced
    other = {"type": "function", "function": {"name": "mul"}}
    assert renderer.prefill_text(TOOLS, other) == ""


# ---- parse_output ------------------------------------------------------------------------------
def test_parse_output_cases(renderer, tokenizer):
    text_out = enc(tokenizer, "The answer is 5.") + [2]
    p = renderer.parse_output(text_out, "stop", TOOLS)
    assert (p.content, p.tool_calls, p.finish_reason, p.tool_parse_error) == (
        "The answer is 5.",
        [],
        "stop",
        False,
    )
    p = renderer.parse_output(enc(tokenizer, "The answer"), "length", TOOLS)
    assert p.finish_reason == "length" and p.content == "The answer"

    two = enc(
        tokenizer,
        '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}, '
        '{"name": "unknown_tool", "arguments": {}}]</tool_call>',
    ) + [2]
    p = renderer.parse_output(two, "stop", TOOLS)
    assert p.finish_reason == "tool_calls" and p.content is None
    assert [c["function"]["name"] for c in p.tool_calls] == ["add", "unknown_tool"]
    ids = [c["id"] for c in p.tool_calls]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    assert all(c["type"] == "function" for c in p.tool_calls)
    assert isinstance(p.tool_calls[0]["function"]["arguments"], str)
    assert p.to_message()["tool_calls"] == p.tool_calls

    bad = enc(tokenizer, '<tool_call>[{"name": "add", "arguments": {"a": 1,]</tool_call>') + [2]
    p = renderer.parse_output(bad, "stop", TOOLS)
    # a call that does not parse is still a call, with the model's raw arguments text
    assert p.tool_parse_error and p.tool_call_recovery == "raw_arguments"
    assert p.finish_reason == "tool_calls" and p.content is None
    assert [c["function"] for c in p.tool_calls] == [{"name": "add", "arguments": '{"a": 1,]'}]
    # markup with no readable call: plain text, markup removed
    bad = enc(tokenizer, "Let me add. <tool_call>[oops</tool_call>") + [2]
    p = renderer.parse_output(bad, "stop", TOOLS)
    assert p.tool_parse_error and p.tool_call_recovery == "markup_removed"
    assert (p.finish_reason, p.tool_calls, p.content) == ("stop", [], "Let me add.")

    # tools not offered: a call-looking text is plain content
    p = renderer.parse_output(two, "stop", None)
    assert p.tool_calls == [] and p.content.startswith("<tool_call>")

    p = renderer.parse_output(enc(tokenizer, "<think>hmm</think> 5"), "stop", None)
    assert p.reasoning == "hmm" and p.content == "5"


# ---- splicing ----------------------------------------------------------------------------------
def first_turn(renderer, tokenizer, output_text, tools=TOOLS, stop=True):
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    prompt = renderer.render_prompt(msgs, tools)
    out = enc(tokenizer, output_text) + ([2] if stop else [])
    parsed = renderer.parse_output(out, "stop" if stop else "length", tools)
    return interaction(msgs, parsed.to_message(), prompt, out, tools), parsed


def test_splice_is_prompt_plus_output_plus_glue_plus_new_tokens(renderer, tokenizer):
    parent, parsed = first_turn(
        renderer,
        tokenizer,
        '<tool_call>[{"name": "add", "arguments": {"a": 2, "b": 3}}]</tool_call>',
    )
    new = [{"role": "tool", "tool_call_id": parsed.tool_calls[0]["id"], "content": "5"}]
    ids = renderer.render_extension(parent, new, TOOLS)
    expected_new = enc(
        tokenizer,
        "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    )
    assert ids == parent.prompt_ids + parent.output_ids + enc(tokenizer, "\n") + expected_new
    # with a canonical output the splice equals a from-scratch render of the same conversation
    full = [*parent.messages, parent.output_message, *new]
    assert ids == renderer.render_prompt(full, TOOLS)


def test_splice_after_length_cut_closes_the_turn(renderer, tokenizer):
    parent, _ = first_turn(renderer, tokenizer, "Let me think about", stop=False)
    new = [{"role": "user", "content": "go on"}]
    ids = renderer.render_extension(parent, new, TOOLS)
    glue = enc(tokenizer, "<|im_end|>\n")
    n = len(parent.prompt_ids) + len(parent.output_ids)
    assert ids[:n] == parent.prompt_ids + parent.output_ids
    assert ids[n : n + len(glue)] == glue
    assert (
        tokenizer.decode(ids[n + len(glue) :])
        == "<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"
    )


def test_splice_is_token_exact_where_retokenization_differs(renderer, tokenizer):
    """The model sampled "Hello world" letter by letter: a re-render would merge the letters."""
    word = "Hello world"
    char_ids = [tid for ch in word for tid in enc(tokenizer, ch)]
    assert char_ids != enc(tokenizer, word)  # a non-canonical tokenization of the same text
    msgs = [{"role": "user", "content": "Say hello"}]
    prompt = renderer.render_prompt(msgs)
    out = char_ids + [2]
    parsed = renderer.parse_output(out, "stop", None)
    assert parsed.content == word
    parent = interaction(msgs, parsed.to_message(), prompt, out)
    cache = InteractionCache()
    cache.add(parent)
    convo = [*msgs, {"role": "assistant", "content": word}, {"role": "user", "content": "Again"}]
    assert cache.find_parent(convo) is parent
    spliced = renderer.render_extension(parent, convo[2:])
    scratch = renderer.render_prompt(convo)
    # same text, different ids: only the splice keeps what the model actually produced
    assert tokenizer.decode(spliced) == tokenizer.decode(scratch)
    assert spliced != scratch
    assert spliced[len(prompt) : len(prompt) + len(out)] == out
    assert scratch[len(prompt) : len(prompt) + len(out)] != out
    child = interaction(
        convo,
        {"role": "assistant", "content": "Hi"},
        spliced,
        enc(tokenizer, "Hi") + [2],
        parent=parent,
    )
    cache.add(child)
    assert child.spliced
    row = cache.export(1.0, "concat")[child.id]
    masked = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
    assert masked == out + child.output_ids  # the letter-by-letter ids are what gets trained


def test_native_tool_template(tokenizer):
    """A template that renders tools itself gets them (and dict arguments) passed through."""
    tok = copy.copy(tokenizer)
    tok.chat_template = (
        "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t.function.name }}"
        "{% endfor %}<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n"
        "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>"
        "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    r = ChatRenderer(tok)
    assert tokenizer.chat_template != tok.chat_template  # the shared tokenizer is untouched
    assert r.tool_parser_name == "qwen" and r.native_tools
    msgs = [
        {"role": "user", "content": "2+3?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]
    text = r.render_text(msgs, TOOLS)
    assert text.startswith("<|im_start|>system\nTOOLS: add<|im_end|>\n")
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>' in text
    assert "<|im_start|>tool\n5<|im_end|>" in text
    assert r.prefill_text(TOOLS, "required") == '<tool_call>\n{"name": "'


def test_long_conversation_splices_equal_scratch_and_suffix_is_local(renderer, tokenizer):
    """Ten spliced turns with canonical outputs give exactly the from-scratch tokens."""
    assert renderer.local_suffix  # ChatML: new turns do not depend on the history
    msgs: list[dict] = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Go"},
    ]
    cache = InteractionCache()
    parent = None
    for turn in range(10):
        if parent is None:
            prompt = renderer.render_prompt(msgs, TOOLS)
        else:
            found = cache.find_parent(msgs)
            assert found is parent
            prompt = renderer.render_extension(parent, msgs[len(parent.messages) + 1 :], TOOLS)
        assert prompt == renderer.render_prompt(msgs, TOOLS)
        text = (
            f'<tool_call>[{{"name": "add", "arguments": {{"a": {turn}, "b": 1}}}}]</tool_call>'
            if turn % 3 != 2
            else f"Step {turn} done."
        )
        out = enc(tokenizer, text) + [2]
        parsed = renderer.parse_output(out, "stop", TOOLS)
        it = interaction(list(msgs), parsed.to_message(), prompt, out, TOOLS, parent)
        cache.add(it)
        assert it.spliced == (parent is not None)
        msgs.append(parsed.to_message())
        if parsed.tool_calls:
            msgs += [
                {"role": "tool", "tool_call_id": c["id"], "content": str(turn + 1)}
                for c in parsed.tool_calls
            ]
        else:
            msgs.append({"role": "user", "content": "continue"})
        parent = it
    rows = cache.export(1.0, "concat")
    assert len(rows) == 1
    (row,) = rows.values()
    assert sum(row["loss_mask"]) == sum(len(i.output_ids) for i in cache.interactions())


def test_non_local_template_falls_back_to_full_history(tokenizer):
    """A template whose rendering of a turn depends on its position is still spliced exactly."""
    tok = copy.copy(tokenizer)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }} #{{ loop.index }}\n{{ m.content }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    r = ChatRenderer(tok)
    assert not r.local_suffix
    msgs = [
        {"role": "user", "content": f"q{i}"}
        if i % 2 == 0
        else {"role": "assistant", "content": f"a{i}"}
        for i in range(7)
    ]
    out = enc(tok, "answer") + [2]
    parent = interaction(
        msgs, {"role": "assistant", "content": "answer"}, r.render_prompt(msgs), out
    )
    new = [{"role": "user", "content": "more"}]
    ids = r.render_extension(parent, new)
    n = len(parent.prompt_ids) + len(out)
    assert ids[:n] == parent.prompt_ids + out
    assert tok.decode(ids[n:]) == "\n<|im_start|>user #9\nmore<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids).endswith("<|im_start|>user #9\nmore<|im_end|>\n<|im_start|>assistant\n")
