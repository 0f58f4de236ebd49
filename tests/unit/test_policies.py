"""Issue 27, the light half: ``policies:`` config checks, and routing by ``model`` through a real
proxy (two scripted engines, the real tokenizer, the official OpenAI and Anthropic SDKs): each
policy answers its name on every protocol, streaming included; an unknown name is a 404
``model_not_found`` in the protocol's own format; ``/v1/models`` lists the policies; one session
hands its conversation from one policy to the other, spliced, and the export trains each policy
on its own tokens only."""

from __future__ import annotations

import copy

import anthropic
import httpx
import openai
import pytest

from areal_env.api.config import ConfigError, ExperimentConfig, ProxyConfig, load_config
from areal_env.engine.launcher import lora_serving_args
from areal_env.engine.testing import ScriptedEngine
from areal_env.proxy.policies import PolicyEndpoint
from areal_env.proxy.server import ProxyServer
from tests.fixtures.proxy import export_session, open_session

# -- config -------------------------------------------------------------------------------------


def test_policies_config_defaults_and_overrides():
    cfg = load_config(
        ExperimentConfig,
        overrides=[
            "actor.lr=1e-5",
            "policies.planner.lr=3e-4",
            "policies.planner.lora.r=8",
            "policies.writer={}",
        ],
    )
    assert list(cfg.policies) == ["planner", "writer"]
    planner, writer = cfg.policy_actor("planner"), cfg.policy_actor("writer")
    assert planner.lr == 3e-4 and writer.lr == 1e-5
    assert planner.lora is not None and planner.lora.r == 8
    assert writer.lora is not None and writer.lora.r == 16  # LoRA's defaults
    assert cfg.policies["writer"].is_adapter
    # SGLang serves both by name: LoRA on, sized for the larger rank
    args = lora_serving_args(cfg)
    assert args[:3] == ["--enable-lora", "--max-lora-rank", "16"]
    assert "q_proj" in args and lora_serving_args(load_config(ExperimentConfig)) == []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["policies.smollm2-135m-instruct={}"], "is the base model's name"),
        (["proxy.model_name=team", "policies.team={}"], "is the base model's name"),
        (["policies.a/b={}"], "policy name 'a/b' is invalid"),
        (["policies.planner.model=/m", "policies.planner.lora.r=4"], "sets both model and lora"),
        (["policies.planner.addresses=[h:1]"], "only a policy with a model of its own"),
        (
            ["engine.backend=remote", "engine.addresses=[h:1]", "policies.p.model=/m"],
            "needs policies.p.addresses",
        ),
        (["policies.p.lr=-1"], r"policies\.p\.lr=-1\.0 must be > 0"),
        (["policies.p.lora.r=0"], r"policies\.p\.lora\.r=0 must be >= 1"),
        (["policies.p.momentum=0.9"], "unknown config key policies.p.momentum"),
    ],
)
def test_bad_policies_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(ExperimentConfig, overrides=overrides)


# -- routing through a real proxy -----------------------------------------------------------------


@pytest.fixture
def two_policies(tokenizer):
    """A proxy with policies ``planner`` and ``writer`` on scripted engines (one tokenizer)."""
    base = ScriptedEngine(tokenizer=tokenizer, default="base")
    planner = ScriptedEngine(tokenizer=tokenizer, default="Add 2 and 3 first.")
    writer = ScriptedEngine(tokenizer=tokenizer, default="The answer is 5.")
    server = ProxyServer(
        base,
        tokenizer,
        ProxyConfig(default_max_tokens=16),
        policies={
            "planner": PolicyEndpoint(planner, tokenizer),
            "writer": PolicyEndpoint(writer, tokenizer),
        },
    ).start()
    yield server, planner, writer, base
    server.stop()


def test_each_policy_answers_its_name_on_every_protocol(two_policies):
    server, planner, writer, base = two_policies
    _, key = open_session(server)
    oai = openai.OpenAI(base_url=server.openai_base_url, api_key=key, max_retries=0)
    claude = anthropic.Anthropic(base_url=server.base_url, api_key=key, max_retries=0)
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]

    chat = oai.chat.completions.create(model="planner", messages=msgs)
    assert chat.model == "planner" and chat.choices[0].message.content == "Add 2 and 3 first."
    stream = oai.chat.completions.create(model="writer", messages=msgs, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == (
        "The answer is 5."
    )
    resp = oai.responses.create(model="writer", input="What is 2 + 3?")
    assert resp.output_text == "The answer is 5."
    msg = claude.messages.create(model="planner", max_tokens=16, messages=msgs)
    assert msg.content[0].text == "Add 2 and 3 first."
    with claude.messages.stream(model="writer", max_tokens=16, messages=msgs) as s:
        assert s.get_final_text() == "The answer is 5."
    assert len(planner.requests) == 2 and len(writer.requests) == 3 and not base.requests

    models = oai.models.list()
    assert [m.id for m in models.data] == ["planner", "writer"]
    assert oai.models.retrieve("writer").id == "writer"


def test_unknown_model_is_a_404_in_the_protocols_own_format(two_policies):
    server, *_ = two_policies
    _, key = open_session(server)
    oai = openai.OpenAI(base_url=server.openai_base_url, api_key=key, max_retries=0)
    claude = anthropic.Anthropic(base_url=server.base_url, api_key=key, max_retries=0)
    msgs = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.NotFoundError) as err:
        oai.chat.completions.create(model="critic", messages=msgs)
    body = err.value.response.json()["error"]
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert "planner, writer" in body["message"]
    with pytest.raises(openai.NotFoundError):  # streaming: refused before the stream starts
        oai.chat.completions.create(model="critic", messages=msgs, stream=True)
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="critic", input="Hi")
    with pytest.raises(anthropic.NotFoundError) as aerr:
        claude.messages.create(model="critic", max_tokens=8, messages=msgs)
    assert aerr.value.response.json()["error"]["type"] == "not_found_error"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("critic")


def test_one_session_hands_its_conversation_between_policies(two_policies):
    """The writer continues the planner's conversation: spliced onto the planner's exact
    tokens; each completion records its policy; the export trains each policy only on its own
    outputs (the other policy's are prompt), in both export styles."""
    server, planner, writer, _ = two_policies
    sid, key = open_session(server)
    oai = openai.OpenAI(base_url=server.openai_base_url, api_key=key, max_retries=0)
    claude = anthropic.Anthropic(base_url=server.base_url, api_key=key, max_retries=0)
    history = [{"role": "user", "content": "What is 2 + 3?"}]
    first = oai.chat.completions.create(model="planner", messages=history)
    history += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Now write the final answer."},
    ]
    second = claude.messages.create(model="writer", max_tokens=16, messages=history)
    history += [
        {"role": "assistant", "content": second.content[0].text},
        {"role": "user", "content": "Check it."},
    ]
    oai.chat.completions.create(model="planner", messages=history)
    # the writer's prompt starts with the planner's prompt + output tokens (spliced)
    p_prompt = planner.requests[0].input_ids
    assert writer.requests[0].input_ids[: len(p_prompt)] == p_prompt

    export = export_session(server, sid, style="individual")
    its = export["interactions"]
    assert [i["policy"] for i in its] == ["planner", "writer", "planner"]
    assert all(i["spliced"] for i in its[1:])
    rows = list(export["trajectories"].values())
    assert [r["policy"] for r in rows] == ["planner", "writer", "planner"]
    for row, it in zip(rows, its, strict=True):  # each row trains its own output only
        assert sum(row["loss_mask"]) == it["num_output_tokens"]

    concat = list(export_session(server, sid, style="concat")["trajectories"].values())
    by_policy = {r["policy"]: r for r in concat}
    assert sorted(by_policy) == ["planner", "writer"] and len(concat) == 2
    n_out = [i["num_output_tokens"] for i in its]
    # the planner's row holds both planner outputs, the writer's only its own
    assert sum(by_policy["planner"]["loss_mask"]) == n_out[0] + n_out[2]
    assert sum(by_policy["writer"]["loss_mask"]) == n_out[1]
    # in the writer's row, the planner's output is prompt: not trained, no version
    start = len(p_prompt)
    span = slice(start, start + n_out[0])
    assert not any(by_policy["writer"]["loss_mask"][span])
    assert set(by_policy["writer"]["versions"][span]) == {-1}
    assert all(by_policy["planner"]["loss_mask"][span])


def test_a_conversation_is_not_spliced_across_tokenizers(tokenizer):
    """A policy with another tokenizer (another chat template here) cannot continue the
    conversation another policy made: 400 ``policy_tokenizer_mismatch``; on its own it works."""
    other_tok = copy.deepcopy(tokenizer)
    other_tok.chat_template = tokenizer.chat_template.replace("<|im_start|>", "<|im_start|> ")
    a = ScriptedEngine(tokenizer=tokenizer, default="First.")
    b = ScriptedEngine(tokenizer=other_tok, default="Second.")
    server = ProxyServer(
        a,
        tokenizer,
        ProxyConfig(default_max_tokens=16),
        policies={"a": PolicyEndpoint(a, tokenizer), "b": PolicyEndpoint(b, other_tok)},
    ).start()
    try:
        _, key = open_session(server)
        oai = openai.OpenAI(base_url=server.openai_base_url, api_key=key, max_retries=0)
        history = [{"role": "user", "content": "Hi"}]
        first = oai.chat.completions.create(model="a", messages=history)
        history += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "Go on."},
        ]
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model="b", messages=history)
        body = err.value.response.json()["error"]
        assert body["code"] == "policy_tokenizer_mismatch" and "'a'" in body["message"]
        # a fresh conversation for b is fine
        assert oai.chat.completions.create(model="b", messages=history[:1]).choices
    finally:
        server.stop()


def test_without_policies_any_model_name_is_served(scripted_proxy):
    """A run without ``policies:`` behaves as before: every model name, one model listed."""
    _, key = open_session(scripted_proxy)
    oai = openai.OpenAI(base_url=scripted_proxy.openai_base_url, api_key=key, max_retries=0)
    r = oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}])
    assert r.model == "gpt-4o"
    models = httpx.get(scripted_proxy.base_url + "/v1/models").json()["data"]
    assert len(models) == 1


# -- a step's rows per policy, and evaluation per policy (pure functions) ----------------------


def _row(policy, reward, n_out=2):
    from areal_env.api.rows import TrainingRow

    return TrainingRow(
        input_ids=[1] * (3 + n_out),
        loss_mask=[0, 0, 0] + [1] * n_out,
        logprobs=[0.0] * (3 + n_out),
        versions=[-1, -1, -1] + [4] * n_out,
        reward=reward,
        policy=policy,
    )


def test_each_policy_gets_its_own_rows_and_figures():
    from areal_env.api.episode import Episode
    from areal_env.trainer.eval import policy_metrics
    from areal_env.trainer.policies import policy_groups, policy_rollout_stats, unrouted_rows
    from areal_env.workflow.batch import collate_groups

    a = Episode(rows=[_row("planner", 1.0), _row("writer", 0.0)], accepted=True)
    b = Episode(
        rows=[_row("planner", 0.0), _row("writer", 1.0), _row("writer", 1.0)], accepted=True
    )
    c = Episode(rows=[_row("planner", 1.0), _row(None, 1.0)], accepted=True)
    groups = [[a, b], [c]]
    planner = policy_groups(groups, "planner")
    writer = policy_groups(groups, "writer")
    assert planner is not None and [len(g) for g in planner] == [2, 1]
    assert writer is not None and [len(g) for g in writer] == [2]  # c has no writer row
    assert policy_groups(groups, "critic") is None
    assert unrouted_rows(groups, ["planner", "writer"]) == 1
    # collated per policy: group ids per task, only that policy's rows
    tensors = collate_groups(writer)
    assert tensors["rewards"].tolist() == [0.0, 1.0, 1.0]
    assert tensors["group_ids"].tolist() == [0, 0, 0]
    stats = policy_rollout_stats(groups, "writer", trainer_version=6)
    assert stats["policy/writer/rows"] == 3.0
    assert abs(stats["policy/writer/reward/mean"] - 2 / 3) < 1e-9
    assert stats["policy/writer/staleness/max"] == 2.0
    # evaluation: a policy's reward in an episode is its rows' mean; team = every policy
    a.interactions = [{"policy": "planner"}, {"policy": "writer"}]
    m = policy_metrics([a, b], success_reward=1.0)
    assert m["policy/planner/success_rate"] == 0.5 and m["policy/writer/success_rate"] == 0.5
    assert m["team/success_rate"] == 0.0
    assert m["policy/planner/turns_mean"] == 0.5
