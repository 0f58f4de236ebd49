"""``tool_choice: required`` names an offered tool: constrained start of the call.

The engine part (``GenerationConfig.prefix_choices``) is checked on the real model: outputs start
with one of the choices, greedy and sampled, and the reported logprobs are those of the
model's own logprob of a chosen token (what the trainer recomputes; 0 for a forced token). The proxy part is checked through the
OpenAI SDK: with ``required`` every call names an offered tool with its first argument key.
"""

from __future__ import annotations

import json
import random

import openai
import torch

from areal_env.api.config import ProxyConfig
from areal_env.api.io import GenerationConfig, ModelRequest
from areal_env.engine.sampler import RowSampling, sample_rows
from areal_env.proxy.server import ProxyServer
from tests.fixtures.proxy import export_session, open_session


def _tool(name: str, desc: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
            },
        },
    }


TOOLS = [_tool("plus", "Sum of x and y."), _tool("times", "Product of x and y.")]


def test_sample_rows_respects_allowed_and_reports_the_models_logprobs():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    rows = [
        RowSampling(False, 1.0, 0, 1.0, random.Random(1)),
        RowSampling(True, 1.0, 0, 1.0, None),
        RowSampling(False, 0.5, 0, 1.0, random.Random(2)),
    ]
    allowed = [[7, 9], [3], None]
    full = torch.log_softmax(logits, dim=-1)
    for _ in range(20):
        tokens, logps = sample_rows(logits, rows, allowed)
        assert tokens[0] in (7, 9) and tokens[1] == 3
        # a choice reports the model's unrestricted logprob: the trainer's, so the ratio starts
        # at 1 (the restricted one is higher by -log Z, Z = the allowed tokens' mass)
        assert abs(logps[0] - full[0, tokens[0]]) < 1e-5
        assert logps[1] == 0.0  # forced: the only allowed token, no choice of the policy
        scaled = torch.log_softmax(logits[2] / 0.5, dim=-1)
        assert abs(logps[2] - scaled[tokens[2]]) < 1e-5


def test_row_sampling_allowed_walks_the_choices():
    r = RowSampling(True, 1.0, 0, 1.0, None, choices=[[1, 2, 3], [1, 4]])
    assert r.allowed([]) == [1]
    assert r.allowed([1]) == [2, 4]
    assert r.allowed([1, 4]) is None  # complete: free from here on
    assert r.choices is None


async def test_engine_output_starts_with_a_choice(engine, tokenizer):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name a colour."}], add_generation_prompt=True, tokenize=True
    )
    # transformers 5 returns a BatchEncoding (a mapping, not a dict) from apply_chat_template.
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    choices = [tokenizer.encode(w, add_special_tokens=False) for w in ("zebra crossing", "quux")]
    for i, g in enumerate(
        [
            GenerationConfig(max_new_tokens=6, greedy=True, prefix_choices=choices),
            GenerationConfig(max_new_tokens=6, temperature=1.0, seed=3, prefix_choices=choices),
        ]
    ):
        resp = await engine.agenerate(ModelRequest(input_ids=prompt, gconfig=g, rid=f"c{i}"))
        out = list(resp.output_tokens)
        assert any(out[: len(c)] == c for c in choices), tokenizer.decode(out)


def test_required_call_names_an_offered_tool(engine):
    proxy = ProxyServer(engine, engine.tokenizer, ProxyConfig(default_max_tokens=32)).start()
    try:
        names = set()
        ends = 0
        for i, question in enumerate(["What is 3 times 4?", "Add 10 and 5.", "Hello!"]):
            sid, key = open_session(proxy)
            client = openai.OpenAI(base_url=proxy.openai_base_url, api_key=key, max_retries=0)
            r = client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": question}],
                tools=TOOLS,
                tool_choice="required",
                max_tokens=32,
                temperature=1.0,
                seed=i,
            )
            (info,) = export_session(proxy, sid)["interactions"]
            assert info["completion_text"].split('"')[0] in ("plus", "times")
            assert '"arguments": {"x": ' in info["completion_text"]
            if info["completion_text"].endswith("]"):
                # the reply is the call: generation stopped where the call's JSON list closed
                assert info["completion_text"].count("]") == 1, info["completion_text"]
                assert not r.choices[0].message.content
                ends += 1
            for call in r.choices[0].message.tool_calls or []:
                assert call.function.name in ("plus", "times")
                try:
                    arguments = json.loads(call.function.arguments)
                except json.JSONDecodeError:
                    # Cut at max_tokens: still a call, with the model's raw arguments text.
                    assert call.function.arguments.startswith('{"x": ')
                    continue
                names.add(call.function.name)
                assert "x" in arguments
        assert names  # at least one call parsed completely
        assert ends  # and at least one closed its JSON (and stopped there)
    finally:
        proxy.stop()


def test_json_end_tracks_brackets_strings_and_escapes():
    from areal_env.engine.json_end import JsonEnd

    j = JsonEnd('[{"name": "')
    assert not j.feed('add", "arguments": {"a": "x]}", "b": "q\\"}"')
    assert not j.feed("}")
    assert j.feed("}]\n<tool_response>")
    assert JsonEnd("").feed("text before [1, [2]] after")
    assert not JsonEnd("").feed("no json here")


def test_choice_exploration_draws_uniformly_and_reports_the_models_logprob():
    logits = torch.full((4, 20), -5.0)
    logits[:, 7], logits[:, 9] = 8.0, -8.0  # the model all but never picks 9
    model_logp = torch.log_softmax(logits[0], dim=-1)
    explore = RowSampling(False, 1.0, 0, 1.0, random.Random(5), explore=1.0)
    plain = RowSampling(False, 1.0, 0, 1.0, random.Random(6))
    greedy = RowSampling(True, 1.0, 0, 1.0, None, explore=1.0)
    free = RowSampling(False, 1.0, 0, 1.0, random.Random(7), explore=1.0)
    picks: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for _ in range(400):
        tokens, logps = sample_rows(logits, [explore, plain, greedy, free], [[7, 9]] * 3 + [None])
        for row in picks:
            picks[row].append(tokens[row])
        # whatever was drawn, the reported logprob is the model's own
        assert abs(logps[0] - model_logp[tokens[0]]) < 1e-5
        assert tokens[3] == 7  # an unconstrained row is not explored
    assert 150 < picks[0].count(9) < 250  # uniform over the allowed tokens
    # each exploration draw is counted on its row (ModelResponse.explored); others count none
    assert (explore.explored, plain.explored, greedy.explored, free.explored) == (400, 0, 0, 0)
    assert picks[1].count(9) == 0  # without exploration the model's choice
    assert set(picks[2]) == {7}  # greedy (evaluation) rows ignore it
    forced = RowSampling(False, 1.0, 0, 1.0, random.Random(8), explore=1.0)
    tokens, logps = sample_rows(logits[:1], [forced], [[9]])
    assert tokens == [9] and logps == [0.0]


def test_choice_exploration_is_validated_and_trainer_governed():
    import pytest

    from areal_env.proxy.sampling import resolve_sampling

    with pytest.raises(ValueError, match="choice_exploration"):
        GenerationConfig(choice_exploration=1.5)
    g = GenerationConfig(temperature=0.7, choice_exploration=0.4)
    kw = dict(temperature=0.2, top_p=None, top_k=None, max_tokens=8, default_max_tokens=8)
    assert resolve_sampling("trainer", g, None, **kw).choice_exploration == 0.4
    assert resolve_sampling("agent", g, None, **kw).choice_exploration == 0.0
    assert resolve_sampling("trainer", g, {"greedy": True}, **kw).choice_exploration == 0.0


def _required_call(proxy: ProxyServer, seed: int | None = None) -> dict:
    """One ``tool_choice: required`` request through the OpenAI SDK; the session's export."""
    sid, key = open_session(proxy)
    client = openai.OpenAI(base_url=proxy.openai_base_url, api_key=key, max_retries=0)
    client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "What is 3 times 4?"}],
        tools=TOOLS,
        tool_choice="required",
        max_tokens=12,
        seed=seed,
    )
    return export_session(proxy, sid)


def test_required_call_explores_the_offered_tools_through_the_proxy(engine):
    gconfig = GenerationConfig(max_new_tokens=12, temperature=0.01, choice_exploration=1.0)
    proxy = ProxyServer(
        engine, engine.tokenizer, ProxyConfig(sampling="trainer"), train_gconfig=gconfig
    ).start()
    try:
        names = []
        for i in range(10):
            exported = _required_call(proxy, seed=i)
            (info,) = exported["interactions"]
            assert info["sampling"]["choice_exploration"] == 1.0  # recorded with the completion
            # the exported row says its tool was explored (the trainer spares its failure)
            assert [r["explored"] for r in exported["trajectories"].values()] == [True]
            names.append(info["completion_text"].split('"')[0])
        # at T=0.01 the model alone names the same tool every time; explored, both appear
        assert set(names) == {"plus", "times"}, names
        proxy.state.train_gconfig = gconfig.new(choice_exploration=0.0)
        rows = _required_call(proxy)["trajectories"].values()
        assert [r["explored"] for r in rows] == [False]
    finally:
        proxy.stop()


def test_constrained_draw_stays_allowed_when_the_allowed_tokens_are_unlikely():
    # At T=0.01 the allowed tokens' unnormalised probabilities underflow to 0; the draw must
    # still be one of them (it used to fall outside the set).
    logits = torch.zeros(1, 30)
    logits[0, 3] = 20.0
    row = RowSampling(False, 0.01, 0, 1.0, random.Random(0))
    for allowed in ([11, 12], [13]):
        for _ in range(20):
            tokens, logps = sample_rows(logits, [row], [allowed])
            assert tokens[0] in allowed
            assert logps[0] <= 0.0


def test_forced_tokens_of_a_required_call_are_not_trained(engine):
    """The constrained start's forced tokens (after the tool name: `", "arguments": {"x": `)
    report logprob 0 and are out of the exported loss mask; the chosen name and the model's
    own tokens after the start are in it."""
    gconfig = GenerationConfig(max_new_tokens=12, temperature=1.0)
    proxy = ProxyServer(
        engine, engine.tokenizer, ProxyConfig(sampling="trainer"), train_gconfig=gconfig
    ).start()
    try:
        exported = _required_call(proxy, seed=1)
        (row,) = exported["trajectories"].values()
        (info,) = exported["interactions"]
        mask, logps = row["loss_mask"], row["logprobs"]
        start = info["num_prompt_tokens"]  # the output's first token
        assert len(mask) == start + info["num_output_tokens"]
        forced = [i for i in range(start, len(mask)) if logps[i] == 0.0]
        assert forced, "a required call has forced tokens after the tool name"
        assert all(mask[i] == 0 for i in forced)
        assert mask[start] == 1  # the tool name: the policy's choice
        assert sum(mask) == len(mask) - start - len(forced)
        # the plain proxy (no constrained start) trains every output token
        sid, key = open_session(proxy)
        client = openai.OpenAI(base_url=proxy.openai_base_url, api_key=key, max_retries=0)
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, seed=1
        )
        (plain,) = export_session(proxy, sid)["trajectories"].values()
        assert sum(plain["loss_mask"]) == len(plain["input_ids"]) - plain["loss_mask"].index(1)
    finally:
        proxy.stop()


def test_a_decision_token_reports_the_models_logprob_once_and_counts_as_explored():
    """``prefix_decision``: the first token of the constrained start is the proxy's decision
    for the policy (``call_exploration``). Though forced, it reports the model's own logprob (so
    it is trained) and the row counts as explored; the forced tokens after it report 0."""
    logits = torch.full((1, 20), -5.0)
    logits[0, 7] = 8.0  # the model all but never starts with 9
    model_logp = torch.log_softmax(logits[0], dim=-1)
    row = RowSampling(False, 1.0, 0, 1.0, random.Random(3), decision_pending=True)
    tokens, logps = sample_rows(logits, [row], [[9]])
    assert tokens == [9] and abs(logps[0] - model_logp[9]) < 1e-5 and logps[0] < -10
    assert row.explored == 1 and not row.decision_pending
    tokens, logps = sample_rows(logits, [row], [[11]])
    assert tokens == [11] and logps == [0.0] and row.explored == 1


def test_call_exploration_is_validated_and_trainer_governed():
    import pytest

    from areal_env.proxy.sampling import resolve_sampling

    with pytest.raises(ValueError, match="call_exploration"):
        GenerationConfig(call_exploration=-0.1)
    with pytest.raises(ValueError, match="prefix_decision needs prefix_choices"):
        GenerationConfig(prefix_decision=True)
    g = GenerationConfig(temperature=0.7, call_exploration=0.3)
    kw = dict(temperature=0.2, top_p=None, top_k=None, max_tokens=8, default_max_tokens=8)
    assert resolve_sampling("trainer", g, None, **kw).call_exploration == 0.3
    assert resolve_sampling("agent", g, None, **kw).call_exploration == 0.0
    assert resolve_sampling("trainer", g, {"greedy": True}, **kw).call_exploration == 0.0


AFTER_A_RESULT = [
    {"role": "user", "content": "What is 3 times 4, plus 5?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "times", "arguments": '{"x": 3, "y": 4}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "12"},
]


def _after_a_result(proxy: ProxyServer, messages: list, seed: int, **kw) -> tuple[object, dict]:
    sid, key = open_session(proxy)
    client = openai.OpenAI(base_url=proxy.openai_base_url, api_key=key, max_retries=0)
    out = client.chat.completions.create(
        model="m", messages=messages, tools=TOOLS, max_tokens=24, seed=seed, **kw
    )
    return out.choices[0].message, export_session(proxy, sid)


def test_call_exploration_starts_a_further_call_after_a_tool_result(engine):
    """With ``call_exploration`` the proxy starts the reply with a call where the agent left the
    choice to the model (``auto``) after a tool result. The prompt is the agent's own (no
    prefill, no "must call" line); the decision token is trained with the model's logprob, the
    forced rest of the call start is not; the row is marked explored. Greedy requests, first
    turns and ``tool_choice: none`` are never explored."""
    gconfig = GenerationConfig(max_new_tokens=24, temperature=0.01, call_exploration=1.0)
    proxy = ProxyServer(
        engine, engine.tokenizer, ProxyConfig(sampling="trainer"), train_gconfig=gconfig
    ).start()
    try:
        names = set()
        for seed in range(6):
            message, exported = _after_a_result(proxy, AFTER_A_RESULT, seed)
            assert message.tool_calls, message  # the reply is a call
            names.add(message.tool_calls[0].function.name)
            (info,) = exported["interactions"]
            (row,) = exported["trajectories"].values()
            assert row["explored"] is True
            assert info["sampling"]["call_exploration"] == 1.0
            start = info["num_prompt_tokens"]
            mask, logps = row["loss_mask"], row["logprobs"]
            assert mask[start] == 1 and logps[start] < 0  # the decision: trained
            forced = [i for i in range(start + 1, len(mask)) if logps[i] == 0.0]
            assert forced and all(mask[i] == 0 for i in forced)
        assert names <= {"plus", "times"}
        # the same prompt as an unexplored request's: nothing was added to it
        proxy.state.train_gconfig = gconfig.new(call_exploration=0.0)
        _, plain = _after_a_result(proxy, AFTER_A_RESULT, 0)
        assert plain["interactions"][0]["num_prompt_tokens"] == start
        assert [r["explored"] for r in plain["trajectories"].values()] == [False]
        proxy.state.train_gconfig = gconfig
        for messages, kw in (
            (AFTER_A_RESULT[:1], {}),  # a first turn: the agent's own tool_choice decides
            (AFTER_A_RESULT, {"tool_choice": "none"}),
        ):
            _, exported = _after_a_result(proxy, messages, 1, **kw)
            assert [r["explored"] for r in exported["trajectories"].values()] == [False]
        # greedy (evaluation) sessions never explore
        sid, key = open_session(proxy, sampling={"greedy": True})
        client = openai.OpenAI(base_url=proxy.openai_base_url, api_key=key, max_retries=0)
        client.chat.completions.create(
            model="m", messages=AFTER_A_RESULT, tools=TOOLS, max_tokens=24, seed=1
        )
        rows = export_session(proxy, sid)["trajectories"].values()
        assert [r["explored"] for r in rows] == [False]
    finally:
        proxy.stop()
