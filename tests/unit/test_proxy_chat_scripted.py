"""Chat Completions through the official ``openai`` SDK on a scripted engine: every field of
the answer and of the stream is what the script says (no model)."""

from __future__ import annotations

import json

import openai
import pytest

from areal_env.api.engine import EngineUnavailableError
from areal_env.engine.testing import Reply
from tests.fixtures.proxy import export_session, open_session

CALL = '<tool_call>[{"name": "lookup", "arguments": {"query": "x"}}]</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    }
]


@pytest.fixture
def engine(scripted_proxy):
    engine = scripted_proxy.state.engine
    yield engine
    assert engine.pending == 0, "a scripted reply was not used"


def _client(proxy, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.openai_base_url, api_key=key, max_retries=0)


def test_answer_logprobs_usage_and_record(scripted_proxy, engine):
    engine.push(Reply(text="Fine, thanks.", logprobs=-0.25, version=7))
    sid, key = open_session(scripted_proxy)
    r = _client(scripted_proxy, key).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "How are you?"}], logprobs=True
    )
    choice = r.choices[0]
    assert choice.message.content == "Fine, thanks." and choice.finish_reason == "stop"
    assert r.id.startswith("chatcmpl-") and r.model == "m"
    lps = choice.logprobs.content
    assert "".join(t.token for t in lps) == "Fine, thanks."
    assert all(t.logprob == pytest.approx(-0.25) for t in lps)
    n_out = r.usage.completion_tokens
    assert n_out == len(lps) + 1  # + eos, which is not shown as a token
    row = export_session(scripted_proxy, sid)["trajectories"][r.id]
    assert row["versions"][-n_out:] == [7] * n_out and sum(row["loss_mask"]) == n_out
    assert row["input_ids"][:-n_out] == engine.requests[-1].input_ids


def test_stream_text_tool_calls_and_usage(scripted_proxy, engine):
    engine.push("Streaming works.", CALL)
    _, key = open_session(scripted_proxy)
    client = _client(scripted_proxy, key)
    msgs = [{"role": "user", "content": "Stream, please."}]
    chunks = list(
        client.chat.completions.create(
            model="m", messages=msgs, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Streaming works."
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    chunks = list(
        client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, stream=True)
    )
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("lookup", {"query": "x"})
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the tool-call text itself never leaks into the content deltas
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_n_choices_are_branches_of_the_session_tree(scripted_proxy, engine):
    """``n=3``: three choices in one answer, each recorded as its own interaction on the same
    parent (a branch of the session's tree), completion tokens summed in the usage."""
    engine.push("Red.", "Green, like grass.", "Blue.")
    sid, key = open_session(scripted_proxy)
    r = _client(scripted_proxy, key).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Name a colour."}], n=3, seed=5
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert sorted(c.message.content for c in r.choices) == ["Blue.", "Green, like grass.", "Red."]
    exported = export_session(scripted_proxy, sid)
    its = exported["interactions"]
    assert len(its) == 3 and len(exported["trajectories"]) == 3
    assert len({it["id"] for it in its}) == 3
    assert r.usage.completion_tokens == sum(it["num_output_tokens"] for it in its)


def test_n_choices_stream_interleaved_with_one_trailer(scripted_proxy, engine):
    """``n=3`` with ``stream: true``: each chunk names its choice, the choices' tokens
    interleave as they arrive (the slow one finishes last), each choice has its own finish
    reason (a call for one of them), one usage chunk sums the three and each choice is
    recorded as its own interaction."""
    engine.push(
        Reply(text="Red, as ever.", delay=0.005),
        Reply(text="Green, like grass in spring.", delay=0.2),
        Reply(text=CALL, delay=0.005),
    )
    sid, key = open_session(scripted_proxy)
    chunks = list(
        _client(scripted_proxy, key).chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Name a colour."}],
            tools=TOOLS,
            n=3,
            stream=True,
            logprobs=True,
            stream_options={"include_usage": True},
        )
    )
    by_choice: dict[int, list] = {}
    for c in chunks:
        for ch in c.choices:
            by_choice.setdefault(ch.index, []).append(ch)
    assert sorted(by_choice) == [0, 1, 2]
    texts = {i: "".join(ch.delta.content or "" for ch in v) for i, v in by_choice.items()}
    finishes = {i: [ch.finish_reason for ch in v if ch.finish_reason] for i, v in by_choice.items()}
    calls = {
        i: [tc.function.name for ch in v for tc in ch.delta.tool_calls or []]
        for i, v in by_choice.items()
    }
    (called,) = [i for i in calls if calls[i]]
    assert calls[called] == ["lookup"] and finishes[called] == ["tool_calls"]
    others = sorted(texts[i] for i in texts if i != called)
    assert others == ["Green, like grass in spring.", "Red, as ever."]
    assert all(finishes[i] == ["stop"] for i in texts if i != called)
    order = [ch.index for c in chunks for ch in c.choices]
    slow = next(i for i in texts if texts[i].startswith("Green"))
    assert order[-1] == slow and len(set(order[:4])) > 1, order  # interleaved, not in turn
    for i, v in by_choice.items():
        lps = [e.token for ch in v if ch.logprobs for e in ch.logprobs.content or []]
        assert "".join(lps) == (texts[i] if i != called else CALL)
    assert [c.usage is not None for c in chunks].count(True) == 1 and chunks[-1].usage
    exported = export_session(scripted_proxy, sid)
    its = exported["interactions"]
    assert len(its) == 3
    assert chunks[-1].usage.completion_tokens == sum(it["num_output_tokens"] for it in its)
    assert scripted_proxy.state.registry.get(sid).in_flight == 0


def test_n_choices_stream_refused_whole_when_one_choice_cannot_start(scripted_proxy, engine):
    """A choice whose engine stream fails to start fails the request with a status (nothing
    half-streamed), and the choices that did start are released."""
    engine.push("Red.", EngineUnavailableError("no server left"))
    sid, key = open_session(scripted_proxy)
    with pytest.raises(openai.APIStatusError) as e:
        list(
            _client(scripted_proxy, key).chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Hi"}], n=2, stream=True
            )
        )
    assert e.value.status_code == 503
    assert scripted_proxy.state.registry.get(sid).in_flight == 0


def test_responses_object_echoes_store_reasoning_and_text(scripted_proxy, engine):
    engine.push('{"a": 1}')
    _, key = open_session(scripted_proxy)
    fmt = {
        "type": "json_schema",
        "name": "A",
        "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        "strict": True,
    }
    r = _client(scripted_proxy, key).responses.create(
        model="m",
        input="Give a.",
        store=False,
        reasoning={"effort": "low"},
        text={"format": fmt, "verbosity": "low"},
    )
    assert r.store is False and r.reasoning.effort == "low"
    assert r.text.format.type == "json_schema" and r.text.format.name == "A"
    assert r.text.verbosity == "low"
    assert r.output_text == '{"a": 1}'


def test_responses_logprobs_asked_for_by_include(scripted_proxy, engine):
    """``include: ["message.output_text.logprobs"]`` returns the text's logprobs, in the answer
    and in the stream's delta and done events; a reply that also calls a tool keeps the call's
    tokens out of its text part; without ``include`` the list stays empty."""
    engine.push(
        Reply(text="Fine, thanks.", logprobs=-0.25),
        Reply(text="Let me look." + CALL, logprobs=-0.5),
        Reply(text="Streaming works.", logprobs=-0.75),
        "No logprobs here.",
    )
    _, key = open_session(scripted_proxy)
    client = _client(scripted_proxy, key)
    include = ["message.output_text.logprobs", "reasoning.encrypted_content"]
    r = client.responses.create(model="m", input="How are you?", include=include)
    (part,) = r.output[0].content
    assert "".join(e.token for e in part.logprobs) == "Fine, thanks."
    assert all(e.logprob == pytest.approx(-0.25) and e.bytes for e in part.logprobs)
    r = client.responses.create(
        model="m", input="Look x up.", tools=_RESPONSES_TOOLS, include=include
    )
    (part,) = r.output[0].content
    assert [o.type for o in r.output] == ["message", "function_call"]
    assert "".join(e.token for e in part.logprobs).startswith("Let me look.")
    assert "tool_call" not in "".join(e.token for e in part.logprobs)
    events = list(client.responses.create(model="m", input="Stream.", include=include, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1
    assert "".join(lp.token for e in deltas for lp in e.logprobs) == "Streaming works."
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [lp.token for lp in done.logprobs] == [lp.token for e in deltas for lp in e.logprobs]
    final = events[-1].response.output[0].content[0]
    assert "".join(e.token for e in final.logprobs) == "Streaming works."
    r = client.responses.create(model="m", input="Plain.")
    assert r.output[0].content[0].logprobs == []
    with pytest.raises(openai.BadRequestError, match="include"):
        client.responses.create(model="m", input="x", include="all")  # type: ignore[arg-type]


_RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": "lookup",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
    }
]
