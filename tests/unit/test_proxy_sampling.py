"""proxy.sampling: trainer-governed vs agent-governed sampling, against the real engine and proxy.

The point of both modes: the logprobs the trainer recomputes for a trained token are taken at the
temperature the token was sampled at. Each test checks that end to end — the proxy records the
engine's logprobs, the export carries the temperature, and ``PPOActor.compute_logprobs`` on the
exported batch reproduces the recorded logprobs (and a recompute at the wrong temperature
does not, so the check can fail).
"""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from areal_env.api.config import ActorConfig, ModelConfig, ProxyConfig
from areal_env.api.io import GenerationConfig
from areal_env.proxy.sampling import resolve_sampling, validate_session_sampling
from areal_env.proxy.server import ProxyServer
from tests.fixtures.proxy import export_session, open_session

MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
def actor(model_path):
    from areal_env.trainer.actor import PPOActor

    return PPOActor(
        model_path,
        ActorConfig(),
        ModelConfig(gradient_checkpointing=False),
        temperature=0.7,
    )


def _proxy(engine, mode: str, gconfig: GenerationConfig | None) -> ProxyServer:
    return ProxyServer(
        engine, engine.tokenizer, ProxyConfig(sampling=mode), train_gconfig=gconfig
    ).start()


def _complete(proxy: ProxyServer, key: str, **kw) -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=proxy.openai_base_url, api_key=key, max_retries=0)
    return client.chat.completions.create(model="m", messages=MESSAGES, **kw)


def _batch(proxy: ProxyServer, session_ids: list[str]) -> dict[str, torch.Tensor]:
    from areal_env.api.rows import rows_from_export
    from areal_env.workflow.batch import collate

    rows = []
    for sid in session_ids:
        rows += rows_from_export(export_session(proxy, sid)["trajectories"])
    return collate(rows)


def _max_logprob_gap(actor, batch) -> float:
    recomputed = actor.compute_logprobs(batch)
    mask = batch["loss_mask"].bool()
    return float((recomputed - batch["logprobs"])[mask].abs().max())


def test_trainer_mode_overrides_agent_params_and_recomputes_exactly(engine, actor):
    g = GenerationConfig(max_new_tokens=10, temperature=0.7, top_k=0)
    proxy = _proxy(engine, "trainer", g)
    try:
        sid, key = open_session(proxy)
        r = _complete(proxy, key, temperature=0.3, top_p=0.5, max_tokens=50)
        assert r.usage.completion_tokens <= 10  # max_tokens capped by gconfig.max_new_tokens
        data = export_session(proxy, sid)
        (info,) = data["interactions"]
        used = info["sampling"]
        assert used["mode"] == "trainer"
        assert used["temperature"] == 0.7 and used["top_p"] == 1.0 and not used["greedy"]
        assert used["requested"]["temperature"] == 0.3  # what the agent asked for stays visible
        assert used["requested"]["max_tokens"] == 50
        (row,) = data["trajectories"].values()
        assert row["temperature"] == 0.7
        batch = _batch(proxy, [sid])
        assert _max_logprob_gap(actor, batch) < 2e-3
    finally:
        proxy.stop()


def test_a_required_tool_choice_reports_the_logprob_the_trainer_recomputes(engine, actor):
    """``tool_choice: required`` constrains the call's first tokens to an offered tool name.
    The chosen token's recorded logprob is the model's own, so the PPO ratio starts at 1; the
    restricted distribution it was drawn from would be off by log Z (Z: the tool names' share
    of the model's mass, 0.23 on average in the demo)."""
    tool = {
        "type": "function",
        "function": {
            "name": "times",
            "description": "Product of x and y.",
            "parameters": {"type": "object", "properties": {"x": {"type": "number"}}},
        },
    }
    other = {"type": "function", "function": {**tool["function"], "name": "plus"}}
    g = GenerationConfig(max_new_tokens=10, temperature=0.7, top_k=0)
    proxy = _proxy(engine, "trainer", g)
    try:
        sids = []
        for seed in range(3):
            sid, key = open_session(proxy)
            _complete(proxy, key, tools=[tool, other], tool_choice="required", seed=seed)
            sids.append(sid)
        batch = _batch(proxy, sids)
        recomputed = actor.compute_logprobs(batch)
        mask = batch["loss_mask"].bool()
        first = mask & (mask.cumsum(dim=1) == 1)  # each row's first completion token: the choice
        assert int(first.sum()) == 3
        gap = (recomputed - batch["logprobs"])[first].abs().max()
        assert float(gap) < 2e-3, float(gap)
        # a forced token (the only allowed one) reports 0 and is no choice of the policy
        chosen = batch["logprobs"][mask]
        assert bool((chosen <= 0).all())
    finally:
        proxy.stop()


def test_agent_mode_records_each_completions_temperature(engine, actor):
    proxy = _proxy(engine, "agent", GenerationConfig(max_new_tokens=10, temperature=0.7))
    try:
        sids = []
        for t in (0.4, 1.3):
            sid, key = open_session(proxy)
            _complete(proxy, key, temperature=t, max_tokens=10)
            sids.append(sid)
            (info,) = export_session(proxy, sid)["interactions"]
            assert info["sampling"]["temperature"] == t and info["sampling"]["mode"] == "agent"
        batch = _batch(proxy, sids)
        temps = batch["temperatures"][batch["loss_mask"].bool()]
        assert sorted(temps.unique().tolist()) == pytest.approx([0.4, 1.3])
        # Recomputed per row at its own temperature: the ratio starts at exactly 1.
        assert _max_logprob_gap(actor, batch) < 2e-3
        # The check can fail: at one shared temperature the same tokens disagree.
        shared = {k: v for k, v in batch.items() if k != "temperatures"}
        assert _max_logprob_gap(actor, shared) > 0.05
    finally:
        proxy.stop()


def test_eval_session_is_greedy_in_both_modes(engine):
    for mode in ("trainer", "agent"):
        proxy = _proxy(engine, mode, GenerationConfig(max_new_tokens=8, temperature=1.0))
        try:
            sid, key = open_session(proxy, sampling={"greedy": True, "temperature": 0.0})
            a = _complete(proxy, key, temperature=1.2, max_tokens=8)
            (info,) = export_session(proxy, sid)["interactions"]
            assert info["sampling"]["greedy"] is True
            sid2, key2 = open_session(proxy, sampling={"greedy": True})
            b = _complete(proxy, key2, temperature=1.2, max_tokens=8)
            assert a.choices[0].message.content == b.choices[0].message.content
        finally:
            proxy.stop()


def test_bad_session_sampling_is_refused(proxy_server):
    r = httpx.post(
        proxy_server.base_url + "/rl/start_session",
        json={"sampling": {"temperature": -1}},
        headers={"Authorization": f"Bearer {proxy_server.admin_key}"},
        timeout=30,
    )
    assert r.status_code == 400
    assert "temperature" in r.text


def test_resolve_sampling_rules():
    g = GenerationConfig(max_new_tokens=16, temperature=0.8, top_p=0.9, top_k=5)
    kw = dict(temperature=0.2, top_p=None, top_k=None, max_tokens=100, default_max_tokens=64)
    s = resolve_sampling("trainer", g, None, **kw)
    assert (s.temperature, s.top_p, s.top_k, s.max_new_tokens) == (0.8, 0.9, 5, 16)
    s = resolve_sampling("agent", g, None, **kw)
    assert (s.temperature, s.top_p, s.top_k, s.max_new_tokens) == (0.2, 1.0, 0, 100)
    s = resolve_sampling("trainer", None, None, **kw)  # no trainer: the agent decides
    assert s.temperature == 0.2
    s = resolve_sampling("trainer", g, {"greedy": True}, **kw)
    assert s.greedy and s.logprob_temperature == 1.0
    with pytest.raises(ValueError, match="proxy.sampling"):
        resolve_sampling("both", g, None, **kw)
    with pytest.raises(ValueError, match="unknown field"):
        validate_session_sampling({"temp": 1})
