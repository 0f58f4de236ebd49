"""Structured outputs and strict tools by constrained decoding, through the real SDKs and the
real default model (SmolLM2-135M): every reply valid, streamed and not (issue 26's table).

Each row of the table runs ``N`` requests at once (they share the engine's decode steps) at
T=1 and counts the replies the SDK itself accepts: ``parse`` helpers that validate against a
pydantic model, ``Agent(output_type=...)`` that raises ``ModelBehaviorError`` on a bad final
output, JSON that a schema validator accepts. Before constrained decoding these rows gave 0-1
valid replies out of 3-8.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Literal

import anthropic
import jsonschema
import openai
import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel

from areal_env.api.config import ProxyConfig
from areal_env.proxy.server import ProxyServer
from tests.fixtures.proxy import export_session, open_session

N = int(os.environ.get("AREAL_ENV_STRUCTURED_N", "20"))
"""Replies per row and mode (the issue asks for 20 of 20)."""
MAX_TOKENS = 96
PROMPT = "Name one big city in Europe: give its name, its country and its population."


class City(BaseModel):
    name: str
    country: str
    population: int


class Forecast(BaseModel):
    city: str
    days: int
    unit: Literal["celsius", "fahrenheit"]


CITY_SCHEMA = to_strict_json_schema(City)
FORECAST_TOOL = {
    "type": "function",
    "function": {
        "name": "forecast",
        "description": "Weather forecast for a city.",
        "parameters": to_strict_json_schema(Forecast),
        "strict": True,
    },
}


@pytest.fixture(scope="module")
def proxy(engine):
    server = ProxyServer(
        engine, engine.tokenizer, ProxyConfig(default_max_tokens=MAX_TOKENS), model_name="m"
    ).start()
    yield server
    server.stop()


def _openai(proxy, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=proxy.openai_base_url, api_key=key, max_retries=0)


async def _count(one, n: int = N) -> tuple[int, list[str]]:
    """Run ``one(i)`` n times at once; (valid replies, what the failures were)."""
    results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    bad = [repr(r)[:300] for r in results if r is not True]
    return n - len(bad), bad


def _valid_city(text: str | None) -> bool:
    jsonschema.validate(json.loads(text or ""), CITY_SCHEMA)
    return True


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_chat_json_schema_strict(proxy, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "City", "schema": CITY_SCHEMA}}
    fmt["json_schema"]["strict"] = True

    async def one(i: int) -> bool:
        _, key = open_session(proxy)
        client = _openai(proxy, key)
        kw = dict(model="m", messages=[{"role": "user", "content": PROMPT}], seed=i)
        if not stream:
            r = await client.chat.completions.create(response_format=fmt, **kw)
            return _valid_city(r.choices[0].message.content)
        text = ""
        async for chunk in await client.chat.completions.create(
            response_format=fmt, stream=True, **kw
        ):
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
        return _valid_city(text)

    valid, bad = asyncio.run(_count(one))
    assert valid == N, bad


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, pytest.param(True, marks=pytest.mark.extended)])
def test_chat_json_object(proxy, stream):
    async def one(i: int) -> bool:
        _, key = open_session(proxy)
        client = _openai(proxy, key)
        kw = dict(
            model="m",
            messages=[{"role": "user", "content": PROMPT + " Answer in JSON."}],
            response_format={"type": "json_object"},
            seed=i,
        )
        if not stream:
            r = await client.chat.completions.create(**kw)
            text = r.choices[0].message.content
        else:
            text = ""
            async for chunk in await client.chat.completions.create(stream=True, **kw):
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
        return isinstance(json.loads(text or ""), dict)

    valid, bad = asyncio.run(_count(one))
    assert valid == N, bad


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, pytest.param(True, marks=pytest.mark.extended)])
def test_strict_tool_forced_by_name(proxy, stream):
    async def one(i: int) -> bool:
        _, key = open_session(proxy)
        client = _openai(proxy, key)
        kw = dict(
            model="m",
            messages=[{"role": "user", "content": "What will the weather be in Lyon?"}],
            tools=[FORECAST_TOOL],
            tool_choice={"type": "function", "function": {"name": "forecast"}},
            seed=i,
        )
        if not stream:
            r = await client.chat.completions.create(**kw)
            (call,) = r.choices[0].message.tool_calls
            name, arguments = call.function.name, call.function.arguments
        else:
            name, arguments = "", ""
            async for chunk in await client.chat.completions.create(stream=True, **kw):
                for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                    name += d.function.name or ""
                    arguments += d.function.arguments or ""
        assert name == "forecast"
        Forecast.model_validate_json(arguments)
        return True

    valid, bad = asyncio.run(_count(one))
    assert valid == N, bad


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, pytest.param(True, marks=pytest.mark.extended)])
def test_chat_completions_parse(proxy, stream):
    async def one(i: int) -> bool:
        _, key = open_session(proxy)
        client = _openai(proxy, key)
        kw = dict(model="m", messages=[{"role": "user", "content": PROMPT}], seed=i)
        if not stream:
            r = await client.chat.completions.parse(response_format=City, **kw)
            return isinstance(r.choices[0].message.parsed, City)
        async with client.chat.completions.stream(response_format=City, **kw) as s:
            async for _ in s:
                pass
            final = await s.get_final_completion()
        return isinstance(final.choices[0].message.parsed, City)

    valid, bad = asyncio.run(_count(one))
    assert valid == N, bad


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, pytest.param(True, marks=pytest.mark.extended)])
def test_responses_text_format(proxy, stream):
    async def one(i: int) -> bool:
        _, key = open_session(proxy)
        client = _openai(proxy, key)
        kw = dict(model="m", input=PROMPT, text_format=City)
        if not stream:
            r = await client.responses.parse(**kw)
        else:
            async with client.responses.stream(**kw) as s:
                async for _ in s:
                    pass
                r = await s.get_final_response()
        assert r.text.format.type == "json_schema"  # the object echoes the request's format
        return isinstance(r.output_parsed, City)

    valid, bad = asyncio.run(_count(one))
    assert valid == N, bad


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_messages_parse(proxy, stream):
    async def one(i: int) -> bool:
        _, key = open_session(proxy)
        client = anthropic.AsyncAnthropic(base_url=proxy.base_url, api_key=key, max_retries=0)
        kw = dict(
            model="m",
            max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": PROMPT}],
            output_format=City,
        )
        if not stream:
            r = await client.messages.parse(**kw)
            return isinstance(r.parsed_output, City)
        async with client.messages.stream(**kw) as s:
            async for _ in s:
                pass
            final = await s.get_final_message()
        return isinstance(final.parsed_output, City)

    valid, bad = asyncio.run(_count(one))
    assert valid == N, bad


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, pytest.param(True, marks=pytest.mark.extended)])
def test_agents_output_type(proxy, stream):
    from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)

    async def one(i: int) -> bool:
        _, key = open_session(proxy)
        model = OpenAIChatCompletionsModel(model="m", openai_client=_openai(proxy, key))
        agent = Agent(name="geo", instructions="You answer questions.", model=model)
        agent = agent.clone(output_type=City)
        if not stream:
            result = await Runner.run(agent, PROMPT)
        else:
            result = Runner.run_streamed(agent, PROMPT)
            async for _ in result.stream_events():
                pass
        return isinstance(result.final_output, City)

    valid, bad = asyncio.run(_count(one))
    assert valid == N, bad


def test_constrained_tokens_report_the_models_logprobs_and_forced_ones_leave_the_loss(proxy):
    """A structured reply: forced tokens (the schema's keys and punctuation, the only token
    allowed) report 0 and are out of the exported loss mask; chosen tokens report the model's
    own logprob (negative), in the mask."""
    sid, key = open_session(proxy)
    client = openai.OpenAI(base_url=proxy.openai_base_url, api_key=key, max_retries=0)
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": PROMPT}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "City", "schema": CITY_SCHEMA},
        },
        seed=1,
        logprobs=True,
        top_logprobs=3,
    )
    _valid_city(r.choices[0].message.content)
    exported = export_session(proxy, sid)
    (row,) = exported["trajectories"].values()
    (info,) = exported["interactions"]
    mask, logps = row["loss_mask"], row["logprobs"]
    start = info["num_prompt_tokens"]
    forced = [i for i in range(start, len(mask)) if logps[i] == 0.0]
    chosen = [i for i in range(start, len(mask)) if logps[i] < 0.0]
    assert forced and chosen
    assert all(mask[i] == 0 for i in forced) and all(mask[i] == 1 for i in chosen)
    entries = r.choices[0].logprobs.content
    assert entries[0].logprob == 0.0 and entries[0].token.startswith("{")  # forced
    assert all(e.top_logprobs for e in entries)
    assert all(len(e.top_logprobs) == 3 for e in entries if e.logprob < 0)
    # a chosen token's logprob is the model's own: its alternatives are not renormalised
    assert all(e.top_logprobs[0].logprob >= e.logprob for e in entries)


def test_responses_top_logprobs_from_the_model(proxy):
    """The Responses API's ``top_logprobs`` with ``include``: each token of the text has the
    model's most likely alternatives, as many as asked for, and the response echoes the count."""
    _, key = open_session(proxy)
    client = openai.OpenAI(base_url=proxy.openai_base_url, api_key=key, max_retries=0)
    r = client.responses.create(
        model="m",
        input="Name a colour.",
        max_output_tokens=6,
        top_logprobs=3,
        include=["message.output_text.logprobs"],
    )
    assert r.top_logprobs == 3
    (part,) = r.output[0].content
    assert part.logprobs and "".join(e.token for e in part.logprobs) == part.text
    assert all(len(e.top_logprobs) == 3 for e in part.logprobs)
    assert all(e.top_logprobs[0].logprob >= e.logprob for e in part.logprobs)


def _rows_batch(rows: list[dict]) -> dict:
    """Exported rows as the actor's batch (right-padded), with alternating rewards."""
    import torch

    width = max(len(r["input_ids"]) for r in rows)
    b = len(rows)
    batch = {
        "input_ids": torch.zeros((b, width), dtype=torch.int64),
        "attention_mask": torch.zeros(b, width, dtype=torch.bool),
        "loss_mask": torch.zeros(b, width, dtype=torch.int32),
        "logprobs": torch.zeros(b, width),
        "versions": torch.full((b, width), -1, dtype=torch.int32),
        "rewards": torch.tensor([float(i % 2) for i in range(b)]),
        "group_ids": torch.tensor([i // 2 for i in range(b)]),
        "traj_ids": torch.arange(b),
    }
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        batch["input_ids"][i, :n] = torch.tensor(r["input_ids"])
        batch["attention_mask"][i, :n] = True
        batch["loss_mask"][i, :n] = torch.tensor(r["loss_mask"], dtype=torch.int32)
        batch["logprobs"][i, :n] = torch.tensor(r["logprobs"])
        batch["versions"][i, :n] = torch.tensor(r["versions"], dtype=torch.int32)
    return batch


def test_first_update_start_kl_stays_at_the_unconstrained_level(proxy, model_path):
    """The trainer recomputes the logprobs of constrained replies and finds what the engine
    reported: the first update's ``actor/start_kl`` (before any optimiser step) is as small on a
    batch of schema-constrained replies as on a batch of free ones. Reporting the restricted
    distribution's logprobs instead would put it orders of magnitude higher (log Z per token)."""
    from areal_env.api.config import ActorConfig, ModelConfig
    from areal_env.trainer.actor import PPOActor

    fmt = {"type": "json_schema", "json_schema": {"name": "City", "schema": CITY_SCHEMA}}

    def rows(constrained: bool) -> list[dict]:
        out = []
        for i in range(4):
            sid, key = open_session(proxy)
            client = openai.OpenAI(base_url=proxy.openai_base_url, api_key=key, max_retries=0)
            kw = {"response_format": fmt} if constrained else {}
            client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": PROMPT}],
                seed=i,
                max_tokens=40,
                **kw,
            )
            out.extend(export_session(proxy, sid)["trajectories"].values())
        return out

    def first_update_start_kl(batch: dict) -> float:
        actor = PPOActor(
            model_path,
            ActorConfig(ppo_n_minibatches=1, micro_batch_tokens=4096, lr=1e-6),
            ModelConfig(gradient_checkpointing=False),
            temperature=1.0,
        )
        return actor.update(batch, step=0)["actor/start_kl"]

    bound_rows = rows(True)
    forced = [
        lp == 0.0 and m == 0
        for r in bound_rows
        for lp, m in zip(r["logprobs"], r["loss_mask"], strict=True)
    ]
    assert any(forced)  # the schema's forced tokens are out of the loss
    bound = first_update_start_kl(_rows_batch(bound_rows))
    free = first_update_start_kl(_rows_batch(rows(False)))
    print(f"\nfirst update's actor/start_kl: constrained {bound:.3g}, free {free:.3g}")
    # measured: constrained 2e-10 to 6e-10, free 3e-9 (fp32 recompute noise); log Z per
    # chosen token would be orders of magnitude above
    assert bound < max(10 * free, 1e-5), (bound, free)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_training_an_output_type_agent_has_no_parse_failures(tmp_path):
    """A short training run of an ``Agent(output_type=City)`` agent: every episode's final
    output parses (no rejected episode, no tool-parse failure) and the updates run."""
    from areal_env.api.config import ExperimentConfig, load_config
    from areal_env.trainer.ppo import PPOTrainer

    cfg = load_config(
        ExperimentConfig,
        None,
        [
            f"fileroot={tmp_path}",
            "experiment_name=structured",
            "seed=5",
            "rollout.batch_size=2",
            "rollout.n_samples=4",
            "gconfig.max_new_tokens=64",
            "actor.ppo_n_minibatches=1",
            "trainer.total_train_steps=2",
            "trainer.tensorboard=false",
            "trainer.recover='off'",
            "rollout.dump_to_file=false",
        ],
    )
    countries = ["France", "Germany", "Italy", "Spain"]
    data = [
        {"id": f"c{i}", "country": c, "prompt": f"Name a big city in {c} with its population."}
        for i, c in enumerate(countries)
    ]
    with PPOTrainer(cfg, data) as trainer:
        final = trainer.train(workflow="tests.unit.structured_agent:CityAgent")
    rows = [json.loads(x) for x in Path(final["metrics_file"]).read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert r["episodes/rejected"] == 0, r
        assert r["episodes/accepted"] == 8, r
        assert r.get("tool_parse_failures", 0) == 0, r
