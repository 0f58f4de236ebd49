"""SGLangEngine against real ``areal-env serve`` processes (SGLang's HTTP protocol) on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import httpx
import pytest

from areal_env.api.engine import EngineUnavailableError, PromptTooLongError
from areal_env.api.io import GenerationConfig, ModelRequest
from areal_env.engine.sglang import SGLangEngine
from areal_env.engine.sglang_wire import sampling_params_from_gconfig, stream_skip
from tests.fixtures.sglang import launch_serve


def prompt(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(rendered, add_special_tokens=False)


def greedy(n: int, **kw) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=n, greedy=True, **kw)


def request_counts(addresses: list[str]) -> dict[str, int]:
    out = {}
    for addr in addresses:
        info = httpx.get(f"http://{addr}/get_server_info", trust_env=False).json()
        out[addr] = int(info["engine_stats"]["requests"])
    return out


def tokens_generated(addresses: list[str]) -> int:
    total = 0
    for addr in addresses:
        info = httpx.get(f"http://{addr}/get_server_info", trust_env=False).json()
        total += int(info["engine_stats"]["tokens_generated"])
    return total


async def wait_for_tokens(addresses: list[str], since: int, n: int, timeout: float = 120) -> None:
    """Wait until the servers produced ``n`` more tokens: the request is really in flight."""
    deadline = asyncio.get_running_loop().time() + timeout
    while await asyncio.to_thread(tokens_generated, addresses) < since + n:
        assert asyncio.get_running_loop().time() < deadline, "no tokens produced"
        await asyncio.sleep(0.1)


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in before}


def test_sampling_params_mapping():
    g = GenerationConfig(max_new_tokens=7, temperature=0.7, top_p=0.9, top_k=0, stop=["x"], seed=3)
    sp = sampling_params_from_gconfig(g)
    assert sp["top_k"] == -1 and sp["max_new_tokens"] == 7 and sp["temperature"] == 0.7
    assert sp["stop"] == ["x"] and sp["sampling_seed"] == 3 and sp["top_p"] == 0.9
    assert sampling_params_from_gconfig(g.new(top_k=5, greedy=True))["top_k"] == 5
    assert sampling_params_from_gconfig(g.new(greedy=True))["temperature"] == 0.0
    assert sampling_params_from_gconfig(g, max_new_tokens=2)["max_new_tokens"] == 2


def test_stream_skip_cumulative_and_incremental():
    # Cumulative events (SGLang default): [a], [a, b], [a, b, c]
    assert stream_skip(0, 1, {"completion_tokens": 1}) == 0
    assert stream_skip(1, 2, {"completion_tokens": 2}) == 1
    assert stream_skip(2, 3, {}) == 2
    # Deltas: [a], [b, c], [d] with running totals
    assert stream_skip(1, 2, {"completion_tokens": 3}) == 0
    assert stream_skip(3, 1, {"completion_tokens": 4}) == 0
    assert stream_skip(1, 1, {"completion_tokens": 4}) < 0  # a gap


def test_bad_addresses_refused():
    with pytest.raises(ValueError, match="host:port"):
        SGLangEngine(["nohostport"])
    with pytest.raises(ValueError, match="at least one"):
        SGLangEngine([])


async def test_greedy_logprobs_equal_local_engine(sglang_engine, engine, tokenizer):
    ids = prompt(tokenizer, "Name three colours.")
    local = await engine.agenerate(ModelRequest(ids, greedy(24)))
    remote = await sglang_engine.agenerate(ModelRequest(ids, greedy(24)))
    assert remote.output_tokens == local.output_tokens
    assert len(remote.output_logprobs) == len(local.output_logprobs) > 0
    assert (
        max(abs(a - b) for a, b in zip(remote.output_logprobs, local.output_logprobs, strict=True))
        < 1e-4
    )
    assert remote.stop_reason == local.stop_reason
    assert remote.output_versions == [sglang_engine.get_version()] * len(remote.output_tokens)
    assert remote.input_tokens == ids and remote.latency > 0
    assert sglang_engine.max_context_len == engine.max_context_len == 8192


async def test_round_robin_and_stickiness(sglang_engine, sglang_servers, tokenizer):
    addrs = sglang_servers.addresses
    ids = prompt(tokenizer, "Hi")
    before = request_counts(addrs)
    await asyncio.gather(*(sglang_engine.agenerate(ModelRequest(ids, greedy(2))) for _ in range(4)))
    assert delta(before, request_counts(addrs)) == {addrs[0]: 2, addrs[1]: 2}

    # One session's turns all go to one server, whatever round-robin would say.
    before = request_counts(addrs)
    for _ in range(3):
        await sglang_engine.agenerate(ModelRequest(ids, greedy(2), metadata={"session_id": "s1"}))
    d = delta(before, request_counts(addrs))
    assert sorted(d.values()) == [0, 3]

    # A reused rid goes back to its server.
    before = request_counts(addrs)
    for _ in range(3):
        await sglang_engine.agenerate(ModelRequest(ids, greedy(2), rid="fixed-rid"))
    assert sorted(delta(before, request_counts(addrs)).values()) == [0, 3]


async def test_stream_matches_generate(sglang_engine, tokenizer):
    ids = prompt(tokenizer, "Count to five.")
    full = await sglang_engine.agenerate(ModelRequest(ids, greedy(12)))
    chunks = [c async for c in sglang_engine.agenerate_stream(ModelRequest(ids, greedy(12)))]
    final = chunks[-1].final
    assert final is not None and len(chunks) >= 3  # token by token, then the final
    streamed = [t for c in chunks[:-1] for t in c.token_ids]
    assert streamed == final.output_tokens == full.output_tokens
    lps = [lp for c in chunks[:-1] for lp in c.logprobs]
    assert max(abs(a - b) for a, b in zip(lps, full.output_logprobs, strict=True)) < 1e-4


async def test_pause_resume_inflight_completes(sglang_engine, sglang_servers, tokenizer):
    ids = prompt(tokenizer, "Tell me a long story about a cat.")
    # long enough that the pause always lands mid-request: with 40 tokens a loaded machine
    # (the token poll below is an HTTP round trip per 0.1 s) sometimes saw it finish first
    cfg = greedy(160, ignore_eos=True)
    reference = await sglang_engine.agenerate(ModelRequest(ids, cfg))
    aborted_before = sum(_aborted(a) for a in sglang_servers.addresses)
    produced = tokens_generated(sglang_servers.addresses)

    task = asyncio.create_task(sglang_engine.agenerate(ModelRequest(ids, cfg)))
    await wait_for_tokens(sglang_servers.addresses, produced, 3)
    await asyncio.to_thread(sglang_engine.pause)
    await asyncio.sleep(0.8)
    assert not task.done()  # held while paused
    await asyncio.to_thread(sglang_engine.resume)
    resp = await asyncio.wait_for(task, 120)
    assert sum(_aborted(a) for a in sglang_servers.addresses) > aborted_before  # really aborted
    assert resp.stop_reason == "length" and len(resp.output_tokens) == 160  # nothing lost
    assert resp.output_tokens == reference.output_tokens
    assert (
        max(
            abs(a - b) for a, b in zip(resp.output_logprobs, reference.output_logprobs, strict=True)
        )
        < 1e-3
    )


def _aborted(addr: str) -> int:
    info = httpx.get(f"http://{addr}/get_server_info", trust_env=False).json()
    return int(info["engine_stats"]["aborted"])


async def test_requests_wait_while_paused(sglang_engine, tokenizer):
    ids = prompt(tokenizer, "Hello")
    await asyncio.to_thread(sglang_engine.pause)
    try:
        task = asyncio.create_task(sglang_engine.agenerate(ModelRequest(ids, greedy(3))))
        await asyncio.sleep(0.5)
        assert not task.done()
    finally:
        await asyncio.to_thread(sglang_engine.resume)
    resp = await asyncio.wait_for(task, 60)
    assert len(resp.output_tokens) >= 1


@pytest.fixture(scope="module")
def perturbed_model(model_path, tmp_path_factory):
    """A copy of the model with noisy weights, saved as an HF folder."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layers.0." in name or "layers.1." in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    out = tmp_path_factory.mktemp("perturbed")
    model.save_pretrained(out)
    return str(out)


async def test_update_weights_from_disk(sglang_engine, model_path, perturbed_model, tokenizer):
    ids = prompt(tokenizer, "What is the capital of France?")
    v0 = sglang_engine.get_version()
    before = await sglang_engine.agenerate(ModelRequest(ids, greedy(16)))
    long_cfg = greedy(48, ignore_eos=True)
    try:
        produced = tokens_generated(sglang_engine.addresses)
        inflight = asyncio.create_task(sglang_engine.agenerate(ModelRequest(ids, long_cfg)))
        await wait_for_tokens(sglang_engine.addresses, produced, 3)
        await asyncio.to_thread(sglang_engine.update_weights, perturbed_model)
        assert sglang_engine.get_version() == v0 + 1
        spanning = await asyncio.wait_for(inflight, 120)
        after = await sglang_engine.agenerate(ModelRequest(ids, greedy(16)))
        assert after.output_versions == [v0 + 1] * len(after.output_tokens)
        assert after.output_logprobs != before.output_logprobs  # new weights answer differently
        # The completion that spanned the update shows the switch, in order, nothing lost.
        assert len(spanning.output_tokens) == 48
        assert spanning.output_versions[0] == v0 and spanning.output_versions[-1] == v0 + 1
        assert spanning.output_versions == sorted(spanning.output_versions)
        for addr in sglang_engine.addresses:
            info = httpx.get(f"http://{addr}/get_model_info", trust_env=False).json()
            assert info["weight_version"] == str(v0 + 1)
    finally:
        await asyncio.to_thread(sglang_engine.update_weights, model_path)
    restored = await sglang_engine.agenerate(ModelRequest(ids, greedy(16)))
    assert restored.output_tokens == before.output_tokens
    assert restored.output_versions == [v0 + 2] * len(restored.output_tokens)


def test_update_weights_refuses_state_dict_and_bad_path(sglang_engine, tmp_path):
    assert SGLangEngine.supports_state_dict_update is False
    with pytest.raises(TypeError, match="save_pretrained"):
        sglang_engine.update_weights({"w": 1})
    v = sglang_engine.get_version()
    with pytest.raises(ValueError, match="not a model folder"):
        sglang_engine.update_weights(str(tmp_path / "missing"))
    assert sglang_engine.get_version() == v
    assert all(sglang_engine.health().values())  # resumed after the failure


async def test_set_version_reaches_servers(sglang_engine, tokenizer):
    v = sglang_engine.get_version()
    try:
        await asyncio.to_thread(sglang_engine.set_version, v + 7)
        resp = await sglang_engine.agenerate(ModelRequest(prompt(tokenizer, "Hi"), greedy(2)))
        assert resp.output_versions == [v + 7] * len(resp.output_tokens)
    finally:
        await asyncio.to_thread(sglang_engine.set_version, v)


async def test_errors_mapped(sglang_engine, tokenizer):
    with pytest.raises(PromptTooLongError):
        await sglang_engine.agenerate(ModelRequest([1] * 9000, greedy(2)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        await sglang_engine.agenerate(ModelRequest([10**7], greedy(2)))
    # Other requests are unaffected.
    resp = await sglang_engine.agenerate(ModelRequest(prompt(tokenizer, "Hi"), greedy(2)))
    assert resp.output_tokens


async def test_callable_from_another_event_loop(sglang_engine, tokenizer):
    ids = prompt(tokenizer, "Say hi")
    results = {}

    def other_thread():
        results["r"] = asyncio.run(sglang_engine.agenerate(ModelRequest(ids, greedy(4))))

    t = threading.Thread(target=other_thread)
    t.start()
    here = await sglang_engine.agenerate(ModelRequest(ids, greedy(4)))
    await asyncio.to_thread(t.join, 120)
    assert results["r"].output_tokens == here.output_tokens


async def test_dead_server_reported_by_address(sglang_servers, model_path, tokenizer, tmp_path):
    """Kill one server mid-request: retries, then an error naming it; the other serves on."""
    extra = launch_serve(model_path, 1, tmp_path)
    victim = extra.addresses[0]
    survivor = sglang_servers.addresses[0]
    eng = SGLangEngine([survivor, victim], max_retries=2, retry_backoff=0.05, down_cooldown=60)
    eng.initialize()
    try:
        ids = prompt(tokenizer, "Write a poem.")
        sticky = {"session_id": "doomed"}
        # Pin the session to the victim.
        eng.servers.router.rebind(ModelRequest(ids, metadata=sticky), victim)
        produced = tokens_generated([victim])
        task = asyncio.create_task(
            eng.agenerate(ModelRequest(ids, greedy(64, ignore_eos=True), metadata=sticky))
        )
        await wait_for_tokens([victim], produced, 2)
        os.killpg(extra.servers[0].pid, signal.SIGKILL)
        with pytest.raises(EngineUnavailableError) as err:
            await asyncio.wait_for(task, 60)
        assert f"server {victim} unreachable after 3 attempts" in str(err.value)
        # The next turn of that session names the dead server too...
        with pytest.raises(EngineUnavailableError, match=victim):
            await eng.agenerate(ModelRequest(ids, greedy(2), metadata=sticky))
        # ...while new requests are served by the survivor.
        for _ in range(3):
            resp = await eng.agenerate(ModelRequest(ids, greedy(2)))
            assert resp.output_tokens
        assert eng.health() == {survivor: True, victim: False}
    finally:
        eng.destroy()
        extra.stop()


async def test_destroyed_engine_unavailable(sglang_servers, tokenizer):
    eng = SGLangEngine(sglang_servers.addresses)
    eng.initialize()
    eng.destroy()
    with pytest.raises(EngineUnavailableError):
        await eng.agenerate(ModelRequest(prompt(tokenizer, "Hi"), greedy(2)))


async def test_stream_continues_across_pause(sglang_engine, sglang_servers, tokenizer):
    ids = prompt(tokenizer, "Describe a walk in the forest.")
    cfg = greedy(24, ignore_eos=True)
    reference = await sglang_engine.agenerate(ModelRequest(ids, cfg))
    aborted_before = sum(_aborted(a) for a in sglang_servers.addresses)
    chunks = []

    async def consume():
        async for c in sglang_engine.agenerate_stream(ModelRequest(ids, cfg)):
            chunks.append(c)

    task = asyncio.create_task(consume())
    while sum(len(c.token_ids) for c in chunks) < 3:
        await asyncio.sleep(0.05)
    await asyncio.to_thread(sglang_engine.pause)
    await asyncio.sleep(0.5)
    await asyncio.to_thread(sglang_engine.resume)
    await asyncio.wait_for(task, 120)
    assert sum(_aborted(a) for a in sglang_servers.addresses) > aborted_before
    final = chunks[-1].final
    assert final is not None and final.stop_reason == "length"
    streamed = [t for c in chunks[:-1] for t in c.token_ids]
    assert streamed == final.output_tokens == reference.output_tokens  # no gap, no repeat
