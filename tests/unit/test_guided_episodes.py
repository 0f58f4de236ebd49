"""Guided episodes (``/rl/start_session`` ``guide``, ``rollout.guided_samples``): a session that
carries a reference solution's tool calls has its sampled replies start with them.

The proxy part runs the real model behind a real proxy through the OpenAI SDK: a guided reply
*is* the reference call, its tokens are trained with the model's own logprobs, the row is
explored, and after the guide (or once the conversation leaves it) the model replies alone.
Greedy (evaluation) sessions are never guided. The workflow part checks that exactly
``guided_samples`` members of a group are guided, and that the step's metrics keep the policy's
own reward apart.
"""

from __future__ import annotations

import json
import random

import httpx
import openai
import pytest
import torch

from areal_env.api.config import ConfigError, ProxyConfig, RolloutConfig
from areal_env.api.episode import Episode
from areal_env.api.io import GenerationConfig
from areal_env.api.rows import TrainingRow
from areal_env.engine.sampler import RowSampling, sample_rows
from areal_env.proxy.guide import next_guided_step, validate_guide
from areal_env.proxy.server import ProxyServer
from areal_env.workflow.batch import rollout_stats
from areal_env.workflow.grouped import GroupedRolloutWorkflow
from areal_env.workflow.proxy_workflow import OpenAIProxyWorkflow, episode_sink
from tests.fixtures.proxy import export_session, open_session
from tests.unit.test_constrained_required import TOOLS

GUIDE = [
    {"name": "times", "arguments": {"x": 3, "y": 4}},
    {"name": "plus", "arguments": {"x": 12, "y": 5}},
]
ANSWER = {"content": "17"}
QUESTION = [{"role": "user", "content": "Take 3 times 4, then add 5 to it."}]


def _call_message(call_id: str, name: str, arguments: dict) -> dict:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
        ],
    }


def test_validate_guide_says_what_is_wrong():
    assert validate_guide(None) is None and validate_guide([]) is None
    assert validate_guide(GUIDE) == GUIDE
    assert validate_guide([*GUIDE, ANSWER]) == [*GUIDE, ANSWER]
    for bad, words in (
        ({"name": "x"}, "must be a list"),
        ([{"name": "x"}], "exactly 'name' and 'arguments'"),
        ([ANSWER, GUIDE[0]], "must be the last step"),
        ([{"content": ""}], "guide[0].content"),
        ([{"name": "", "arguments": {}}], "guide[0].name"),
        ([GUIDE[0], {"name": "x", "arguments": "{}"}], "guide[1].arguments"),
        ([GUIDE[0]] * 65, "at most 64"),
    ):
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            validate_guide(bad)


def test_next_guided_step_follows_the_calls_made_so_far():
    first = _call_message("c1", "times", {"x": 3, "y": 4})
    result = {"role": "tool", "tool_call_id": "c1", "content": "12"}
    assert next_guided_step(GUIDE, QUESTION) == GUIDE[0]
    assert next_guided_step(GUIDE, [*QUESTION, first, result]) == GUIDE[1]
    # arguments compare as values: key order and 4 == 4.0 do not matter
    reordered = _call_message("c1", "times", {"y": 4.0, "x": 3})
    assert next_guided_step(GUIDE, [*QUESTION, reordered, result]) == GUIDE[1]
    # a conversation that left the guide, or finished it, is not guided
    wrong = _call_message("c1", "times", {"x": 3, "y": 5})
    assert next_guided_step(GUIDE, [*QUESTION, wrong, result]) is None
    second = _call_message("c2", "plus", {"x": 12, "y": 5})
    done = [*QUESTION, first, result, second, {"role": "tool", "tool_call_id": "c2"}]
    assert next_guided_step(GUIDE, done) is None
    assert next_guided_step([*GUIDE, ANSWER], done) == ANSWER
    answered = [*done, {"role": "assistant", "content": "17"}]
    assert next_guided_step([*GUIDE, ANSWER], answered) is None
    assert next_guided_step(None, QUESTION) is None


def test_a_guided_row_reports_the_models_logprob_for_every_prefix_token():
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(3))
    rows = [
        RowSampling(False, 0.5, 0, 1.0, random.Random(1), choices=[[5, 6]], guided=True),
        RowSampling(False, 0.5, 0, 1.0, random.Random(1), choices=[[5, 6]]),
    ]
    full = torch.log_softmax(logits / 0.5, dim=-1)
    tokens, logps = sample_rows(logits, rows, [[5], [5]])
    assert tokens == [5, 5]
    assert abs(logps[0] - float(full[0, 5])) < 1e-5 and logps[0] < 0  # trained, the model's
    assert logps[1] == 0.0  # unguided, a forced token is no choice of the policy
    assert (rows[0].explored, rows[1].explored) == (1, 0)
    with pytest.raises(ValueError, match="prefix_guided needs prefix_choices"):
        GenerationConfig(prefix_guided=True)


@pytest.fixture
def trainer_proxy(engine):
    gconfig = GenerationConfig(max_new_tokens=32, temperature=0.5)
    proxy = ProxyServer(
        engine, engine.tokenizer, ProxyConfig(sampling="trainer"), train_gconfig=gconfig
    ).start()
    yield proxy
    proxy.stop()


def _ask(client: openai.OpenAI, messages: list, **kw):
    out = client.chat.completions.create(
        model="m", messages=messages, tools=TOOLS, max_tokens=32, seed=7, **kw
    )
    return out.choices[0].message


@pytest.mark.parametrize("with_answer", [False, True], ids=["calls", "calls-and-answer"])
def test_a_guided_session_takes_the_reference_steps_then_replies_alone(trainer_proxy, with_answer):
    proxy = trainer_proxy
    sid, key = open_session(proxy, guide=[*GUIDE, ANSWER] if with_answer else GUIDE)
    client = openai.OpenAI(base_url=proxy.openai_base_url, api_key=key, max_retries=0)
    history = list(QUESTION)
    for i, (call, result) in enumerate(zip(GUIDE, ("12", "17"), strict=True)):
        # the first reply is required to call (the prefill), the second is free (auto)
        message = _ask(client, history, **({"tool_choice": "required"} if i == 0 else {}))
        (made,) = message.tool_calls
        assert made.function.name == call["name"]
        assert json.loads(made.function.arguments) == call["arguments"]
        history += [
            message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": made.id, "content": result},
        ]
    # the reply after the calls: the guide's answer, or (no answer in it) the model's own
    reply = _ask(client, history)
    if with_answer:
        assert not reply.tool_calls and reply.content.startswith("17")
    _ask(client, [*history, reply.model_dump(exclude_none=True), {"role": "user", "content": "Ok"}])
    exported = export_session(proxy, sid, style="individual")
    infos = exported["interactions"]
    marks = [True, True, with_answer, False]  # past the guide the model replies alone
    assert [i["guided"] for i in infos] == marks
    assert all(i["spliced"] for i in infos[1:])  # guided turns splice as any other
    rows = exported["trajectories"]  # individual: one row per completion, by its id
    for info, explored in zip(infos, marks, strict=True):
        row = rows[info["id"]]
        assert row["explored"] is explored
        out = slice(info["num_prompt_tokens"], None)
        # the tokens a guide wrote are flagged (actor.guided_nll_coef imitates them)
        n_out = len(row["input_ids"]) - info["num_prompt_tokens"]
        expect = [0] * info["num_prompt_tokens"] + [1] * n_out if explored else None
        assert row["guided"] == expect
        if explored:  # every written token is in the loss with the model's own logprob,
            # but for those the model was certain of (logprob 0.0 in float32: no gradient)
            pairs = list(zip(row["logprobs"][out], row["loss_mask"][out], strict=True))
            assert sum(m for _, m in pairs) >= 1
            assert all((m == 1 and lp < 0) or (m == 0 and lp == 0.0) for lp, m in pairs)
    # one concat row for the whole conversation: its guided turns' tokens flagged, its own not
    (row,) = export_session(proxy, sid, style="concat")["trajectories"].values()
    n_guided = sum(sum(rows[i["id"]]["guided"] or []) for i in infos)
    assert sum(row["guided"]) == n_guided and row["guided"][-1] == 0


def test_guides_are_checked_and_never_steer_greedy_or_a_conversation_that_left_them(
    trainer_proxy,
):
    proxy = trainer_proxy
    r = httpx.post(
        proxy.base_url + "/rl/start_session",
        json={"guide": [{"name": "times"}]},
        headers={"Authorization": f"Bearer {proxy.admin_key}"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "guide"
    # evaluation (a greedy session) is never guided
    sid, key = open_session(proxy, guide=GUIDE, sampling={"greedy": True})
    client = openai.OpenAI(base_url=proxy.openai_base_url, api_key=key, max_retries=0)
    _ask(client, QUESTION, tool_choice="required")
    assert [i["guided"] for i in export_session(proxy, sid)["interactions"]] == [False]
    # a history whose first call is not the guide's: the rest runs free
    sid, key = open_session(proxy, guide=GUIDE)
    client = openai.OpenAI(base_url=proxy.openai_base_url, api_key=key, max_retries=0)
    other = _call_message("c1", "plus", {"x": 3, "y": 4})
    _ask(client, [*QUESTION, other, {"role": "tool", "tool_call_id": "c1", "content": "7"}])
    assert [i["guided"] for i in export_session(proxy, sid)["interactions"]] == [False]


class _OneCallAgent:
    async def run(self, data, base_url, api_key, http_client):
        client = openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key, http_client=http_client, max_retries=0
        )
        await client.chat.completions.create(
            model="m", messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=32
        )
        return 1.0


async def test_guided_samples_guide_that_many_members_of_each_group(trainer_proxy, engine):
    rollout = RolloutConfig(n_samples=3, guide_key="reference", guided_samples=1)
    inner = OpenAIProxyWorkflow(
        _OneCallAgent(),
        proxy_base_url=trainer_proxy.base_url,
        admin_key=trainer_proxy.admin_key,
        rollout=rollout,
    )
    group = GroupedRolloutWorkflow(inner, n_samples=3)
    with episode_sink() as sink:
        await group.arun_episode(engine, {"question": "q", "reference": GUIDE[:1]})
        await group.arun_episode(engine, {"question": "q"})  # no reference: nobody guided
    assert [(e.traj_index, e.guided) for e in sink[:3]] == [(0, True), (1, False), (2, False)]
    assert [e.guided for e in sink[3:]] == [False] * 3
    guided_call = sink[0].interactions[0]
    assert guided_call["guided"] and guided_call["tool_calls"] == ["times"]
    inner.eval_mode = True  # evaluation never is
    with episode_sink() as sink:
        await group.arun_episode(engine, {"question": "q", "reference": GUIDE[:1]})
    assert [e.guided for e in sink] == [False] * 3
    await inner.aclose()
    with pytest.raises(ConfigError, match="guide_key"):
        RolloutConfig(n_samples=3, guided_samples=1).validate()
    with pytest.raises(ConfigError, match=r"\[0, 3\)"):
        RolloutConfig(n_samples=3, guide_key="reference", guided_samples=3).validate()


def test_step_metrics_keep_the_policys_own_reward_apart():
    def ep(reward: float, guided: bool) -> Episode:
        row = TrainingRow(
            input_ids=[1, 2],
            loss_mask=[0, 1],
            logprobs=[0.0, -1.0],
            versions=[-1, 0],
            reward=reward,
        )
        return Episode(rows=[row], accepted=True, guided=guided, group_id="g")

    def stats_of(*episodes: Episode) -> dict[str, float]:
        return rollout_stats([list(episodes)], [], trainer_version=0, wall_time=1.0)

    stats = stats_of(ep(1.0, True), ep(0.0, False), ep(1.0, False), ep(0.0, False))
    assert stats["episodes/guided"] == 1.0
    assert stats["reward/guided_mean"] == 1.0
    assert stats["reward/unguided_mean"] == pytest.approx(1 / 3)
    assert "episodes/guided" not in stats_of(ep(1.0, False), ep(0.0, False))
