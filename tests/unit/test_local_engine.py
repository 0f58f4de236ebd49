"""LocalEngine against the real default model (shared ``engine`` fixture)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from areal_env.api.engine import EngineUnavailableError, PromptTooLongError
from areal_env.api.io import GenerationConfig, ModelRequest, ModelResponse
from areal_env.engine.local import LocalEngine

QUESTIONS = [
    "What is 2+2?",
    "Name a colour.",
    "Write one sentence about the sea and the wind and the boats that sail on it.",
    "Hi",
    "List three fruits, then explain which one is the sweetest and why you think so.",
    "What is the capital of France?",
    "Count from one to five.",
    "Say something nice about cats, dogs, and also about birds that sing in the morning.",
]


def chat_ids(tokenizer, text: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )


def request(tokenizer, text: str, **gen) -> ModelRequest:
    return ModelRequest(input_ids=chat_ids(tokenizer, text), gconfig=GenerationConfig(**gen))


def reference_logprobs(model, resp: ModelResponse, g: GenerationConfig) -> torch.Tensor:
    """Teacher-forced logprobs of ``resp``'s output in ONE forward pass, processed like HF does.

    Written independently of the engine's sampler (transformers' own warpers), so a mismatch in
    temperature / top-k / top-p handling shows up here.
    """
    ids = torch.tensor([resp.input_tokens + resp.output_tokens])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].float()
    n_in = len(resp.input_tokens)
    scores = logits[n_in - 1 : n_in - 1 + len(resp.output_tokens)]
    if not g.is_greedy:
        scores = TemperatureLogitsWarper(g.temperature)(None, scores)
        if g.top_k:
            scores = TopKLogitsWarper(g.top_k)(None, scores)
        if g.top_p < 1.0:
            scores = TopPLogitsWarper(g.top_p)(None, scores)
    logp = torch.log_softmax(scores, dim=-1)
    return logp.gather(1, torch.tensor(resp.output_tokens)[:, None])[:, 0]


def assert_logprobs_match(engine, resp: ModelResponse, g: GenerationConfig) -> None:
    assert len(resp.output_logprobs) == len(resp.output_tokens) > 0
    ref = reference_logprobs(engine.model, resp, g)
    got = torch.tensor(resp.output_logprobs)
    assert torch.isfinite(got).all()
    diff = (got - ref).abs().max().item()
    assert diff < 1e-4, f"logprobs differ by {diff} ({g})"


async def test_logprobs_single_request(engine, tokenizer):
    g = GenerationConfig(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=1)
    req = ModelRequest(input_ids=chat_ids(tokenizer, QUESTIONS[2]), gconfig=g)
    resp = await engine.agenerate(req)
    assert resp.output_versions == [0] * len(resp.output_tokens)
    assert_logprobs_match(engine, resp, g)


async def test_logprobs_concurrent_mixed_settings(engine, tokenizer):
    settings = [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=20),
        dict(temperature=1.3, top_p=0.8),
        dict(greedy=True),
        dict(temperature=1.0, top_k=50, top_p=0.9),
        dict(temperature=0.5),
        dict(temperature=1.0, top_p=0.95),
        dict(temperature=0.9, top_k=5),
    ]
    gs = [GenerationConfig(max_new_tokens=16, seed=i, **s) for i, s in enumerate(settings)]

    async def staggered(i: int) -> ModelResponse:
        await asyncio.sleep(0.05 * (i % 4))  # some join a batch that is already decoding
        return await engine.agenerate(
            ModelRequest(input_ids=chat_ids(tokenizer, QUESTIONS[i]), gconfig=gs[i])
        )

    resps = await asyncio.gather(*(staggered(i) for i in range(8)))
    assert len({len(r.input_tokens) for r in resps}) > 4  # really different prompt lengths
    for resp, g in zip(resps, gs, strict=True):
        assert_logprobs_match(engine, resp, g)


async def test_greedy_identical_alone_and_in_busy_batch(engine, tokenizer):
    g = GenerationConfig(max_new_tokens=16, greedy=True, ignore_eos=True)
    target = ModelRequest(input_ids=chat_ids(tokenizer, QUESTIONS[4]), gconfig=g)
    alone = await engine.agenerate(target)

    async def busy(i: int) -> ModelResponse:
        await asyncio.sleep(0.03 * i)
        return await engine.agenerate(
            request(tokenizer, QUESTIONS[i], max_new_tokens=6 + 3 * i, ignore_eos=True, seed=i)
        )

    others = [asyncio.create_task(busy(i)) for i in range(7)]
    await asyncio.sleep(0.1)
    in_batch = await engine.agenerate(ModelRequest(input_ids=list(target.input_ids), gconfig=g))
    await asyncio.gather(*others)
    assert engine.stats()["max_batch_size_seen"] >= 4
    assert in_batch.output_tokens == alone.output_tokens
    assert (
        max(
            abs(a - b) for a, b in zip(in_batch.output_logprobs, alone.output_logprobs, strict=True)
        )
        < 1e-4
    )


async def test_versions_span_a_weight_update(engine, tokenizer, model_path):
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    perturbed = {k: v + 1e-3 * torch.randn_like(v) for k, v in original.items()}
    v0 = engine.get_version()
    req = request(tokenizer, QUESTIONS[0], max_new_tokens=24, ignore_eos=True, seed=3)
    chunks = []
    try:
        async for chunk in engine.agenerate_stream(req):
            chunks.append(chunk)
            if len(chunks) == 8:
                await asyncio.to_thread(engine.update_weights, perturbed)
                assert engine.get_version() == v0 + 1
        final = chunks[-1].final
        assert final is not None and len(final.output_tokens) == 24
        versions = final.output_versions
        assert versions == sorted(versions)
        assert versions[0] == v0 and versions[-1] == v0 + 1
        assert 8 <= versions.index(v0 + 1) <= 14
        torch.testing.assert_close(engine.model.model.norm.weight, perturbed["model.norm.weight"])
    finally:
        # restore from disk (the update-from-path code path), then the version
        await asyncio.to_thread(engine.update_weights, model_path)
        engine.set_version(v0)
    torch.testing.assert_close(engine.model.model.norm.weight, original["model.norm.weight"])
    with pytest.raises(ValueError):
        engine.update_weights({"not.a.param": torch.zeros(1)})


async def test_pause_holds_requests_and_resume_releases_them(engine, tokenizer):
    running = request(tokenizer, QUESTIONS[2], max_new_tokens=200, ignore_eos=True)
    stream = engine.agenerate_stream(running)
    first = await stream.__anext__()  # it is decoding
    assert first.final is None
    await asyncio.to_thread(engine.pause)
    try:
        task = asyncio.create_task(
            engine.agenerate(request(tokenizer, QUESTIONS[1], max_new_tokens=4, greedy=True))
        )
        queued = request(tokenizer, QUESTIONS[3], max_new_tokens=4)
        queued_task = asyncio.create_task(engine.agenerate(queued))
        await asyncio.sleep(0.5)
        assert not task.done() and not queued_task.done()
        assert engine.stats()["queued"] == 2
        # aborts are answered at once while paused, for queued and running requests alike
        assert engine.abort(queued.rid)
        resp = await asyncio.wait_for(queued_task, 5)
        assert resp.stop_reason == "abort" and resp.output_tokens == []
        assert engine.abort(running.rid)
        chunks = [c async for c in stream]
        final = chunks[-1].final
        assert final is not None and final.stop_reason == "abort"
        assert 0 < len(final.output_tokens) < 200
        assert not task.done()
    finally:
        engine.resume()
    resp = await asyncio.wait_for(task, 60)
    assert 1 <= len(resp.output_tokens) <= 4


async def test_stop_reasons(engine, tokenizer):
    eos = await engine.agenerate(request(tokenizer, QUESTIONS[0], max_new_tokens=64, greedy=True))
    assert eos.stop_reason == "stop"
    assert eos.output_tokens[-1] in engine.eos_token_ids  # the eos token is kept (trained on)

    text = tokenizer.decode(eos.output_tokens)
    word = text.split()[2]
    stopped = await engine.agenerate(
        request(tokenizer, QUESTIONS[0], max_new_tokens=64, greedy=True, stop=[word])
    )
    assert stopped.stop_reason == "stop"
    assert tokenizer.decode(stopped.output_tokens).endswith(word)  # completing token included
    assert word not in tokenizer.decode(stopped.output_tokens[:-1])
    assert stopped.output_tokens == eos.output_tokens[: len(stopped.output_tokens)]

    extra_stop = eos.output_tokens[1]
    by_id = await engine.agenerate(
        request(
            tokenizer, QUESTIONS[0], max_new_tokens=64, greedy=True, stop_token_ids=[extra_stop]
        )
    )
    assert by_id.stop_reason == "stop" and by_id.output_tokens == eos.output_tokens[:2]

    length = await engine.agenerate(request(tokenizer, QUESTIONS[0], max_new_tokens=5))
    assert length.stop_reason == "length" and len(length.output_tokens) == 5

    ignore = await engine.agenerate(
        request(
            tokenizer,
            QUESTIONS[0],
            max_new_tokens=len(eos.output_tokens) + 3,
            greedy=True,
            ignore_eos=True,
        )
    )
    assert ignore.stop_reason == "length"
    assert len(ignore.output_tokens) == len(eos.output_tokens) + 3


async def test_abort_and_cancellation(engine, tokenizer):
    long_req = request(tokenizer, QUESTIONS[2], max_new_tokens=200, ignore_eos=True)
    task = asyncio.create_task(engine.agenerate(long_req))
    await asyncio.sleep(0.5)
    assert engine.abort(long_req.rid)
    resp = await asyncio.wait_for(task, 30)
    assert resp.stop_reason == "abort" and 0 < len(resp.output_tokens) < 200
    assert len(resp.output_versions) == len(resp.output_tokens)

    before = engine.stats()["aborted"]
    task = asyncio.create_task(
        engine.agenerate(request(tokenizer, QUESTIONS[2], max_new_tokens=200, ignore_eos=True))
    )
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    deadline = time.monotonic() + 10
    while engine.stats()["aborted"] == before and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    stats = engine.stats()
    assert stats["running"] == 0 and stats["aborted"] == before + 1


async def test_seeded_requests_reproducible(engine, tokenizer):
    def seeded(seed: int) -> ModelRequest:
        return request(tokenizer, QUESTIONS[6], max_new_tokens=16, ignore_eos=True, seed=seed)

    first = await engine.agenerate(seeded(7))
    noise = [
        asyncio.create_task(engine.agenerate(request(tokenizer, q, max_new_tokens=12)))
        for q in QUESTIONS[:4]
    ]
    again, other = await asyncio.gather(engine.agenerate(seeded(7)), engine.agenerate(seeded(8)))
    await asyncio.gather(*noise)
    assert again.output_tokens == first.output_tokens
    assert other.output_tokens != first.output_tokens


async def test_bad_input_refused_while_others_complete(engine, tokenizer):
    good = asyncio.create_task(
        engine.agenerate(request(tokenizer, QUESTIONS[3], max_new_tokens=12, ignore_eos=True))
    )
    await asyncio.sleep(0.1)
    g = GenerationConfig(max_new_tokens=4)
    with pytest.raises(ValueError, match="non-empty"):
        await engine.agenerate(ModelRequest(input_ids=[], gconfig=g))
    with pytest.raises(ValueError, match="vocabulary"):
        await engine.agenerate(ModelRequest(input_ids=[1, engine.vocab_size], gconfig=g))
    with pytest.raises(ValueError, match="vocabulary"):
        await engine.agenerate(ModelRequest(input_ids=[1, -5], gconfig=g))
    with pytest.raises(PromptTooLongError):
        await engine.agenerate(ModelRequest(input_ids=[1] * engine.max_context_len, gconfig=g))
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenerationConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match="unknown sampling option"):
        GenerationConfig.from_dict({"max_new_tokens": 4, "beam_width": 3})
    resp = await asyncio.wait_for(good, 60)
    assert resp.stop_reason == "length" and len(resp.output_tokens) == 12


async def test_event_loop_stays_responsive(engine, tokenizer):
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    resps = await asyncio.gather(
        *(
            engine.agenerate(request(tokenizer, QUESTIONS[i % 8], max_new_tokens=16))
            for i in range(16)
        )
    )
    stop.set()
    await tick
    assert all(r.output_tokens for r in resps)
    assert len(gaps) > 20
    assert max(gaps) < 0.5, f"event loop blocked for {max(gaps):.3f}s"


async def test_stream_chunks_concatenate_to_final(engine, tokenizer):
    req = request(tokenizer, QUESTIONS[5], max_new_tokens=16, seed=11)
    chunks = [c async for c in engine.agenerate_stream(req)]
    final = chunks[-1].final
    assert final is not None and all(c.final is None for c in chunks[:-1])
    assert len(chunks) >= len(final.output_tokens)  # one chunk per decode step
    assert [t for c in chunks for t in c.token_ids] == final.output_tokens
    assert [x for c in chunks for x in c.logprobs] == final.output_logprobs
    assert [v for c in chunks for v in c.versions] == final.output_versions


async def test_callable_from_another_thread_and_loop(engine, tokenizer):
    req_here = request(tokenizer, QUESTIONS[1], max_new_tokens=8, greedy=True, ignore_eos=True)
    req_there = request(tokenizer, QUESTIONS[1], max_new_tokens=8, greedy=True, ignore_eos=True)
    result: dict[str, ModelResponse] = {}

    def other_thread() -> None:
        result["there"] = asyncio.run(engine.agenerate(req_there))

    th = threading.Thread(target=other_thread)
    th.start()
    here = await engine.agenerate(req_here)
    await asyncio.to_thread(th.join, 60)
    assert result["there"].output_tokens == here.output_tokens


async def test_unavailable_destroyed_and_context_limit(model_path, tokenizer):
    from areal_env.api.config import EngineConfig, ModelConfig

    idle = LocalEngine.from_config(ModelConfig(), EngineConfig(max_batch_size=4))
    assert idle.model_path == model_path and idle.max_batch_size == 4
    assert LocalEngine.supports_state_dict_update is True
    with pytest.raises(EngineUnavailableError):
        await idle.agenerate(request(tokenizer, "hi", max_new_tokens=2))

    small = LocalEngine(model_path, max_context_len=48, max_batch_size=4)
    small.initialize()
    try:
        prompt = chat_ids(tokenizer, QUESTIONS[0])
        resp = await small.agenerate(
            ModelRequest(prompt, GenerationConfig(max_new_tokens=100, ignore_eos=True))
        )
        assert resp.stop_reason == "length" and len(prompt) + len(resp.output_tokens) == 48
        with pytest.raises(PromptTooLongError):
            await small.agenerate(ModelRequest([1] * 48, GenerationConfig(max_new_tokens=1)))

        long_req = request(tokenizer, "hi", max_new_tokens=30, ignore_eos=True)
        task = asyncio.create_task(small.agenerate(long_req))
        await asyncio.sleep(0.3)
        await asyncio.to_thread(small.destroy)
        resp = await asyncio.wait_for(task, 30)
        assert resp.stop_reason == "abort"
    finally:
        small.destroy()
    with pytest.raises(EngineUnavailableError):
        await small.agenerate(request(tokenizer, "hi", max_new_tokens=2))


def test_cache_keyword_follows_the_forward_signature():
    """transformers 5.24 renamed forward's KV argument to ``cache``; older releases take
    ``past_key_values``. The engine passes whichever the model's forward declares."""
    from areal_env.engine.batch_worker import cache_keyword

    class New:
        def forward(self, input_ids=None, cache=None, **kwargs): ...

    class Old:
        def forward(self, input_ids=None, past_key_values=None, **kwargs): ...

    assert cache_keyword(New()) == "cache"
    assert cache_keyword(Old()) == "past_key_values"


async def test_generation_raises_no_cache_deprecation(engine, tokenizer):
    """The real model's decode loop uses the keyword its transformers wants: no FutureWarning
    about ``past_key_values`` (an argument that is removed in transformers 5.40)."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        resp = await engine.agenerate(request(tokenizer, QUESTIONS[3], max_new_tokens=4))
    assert resp.output_tokens
    assert not [w for w in seen if "past_key_values" in str(w.message)], [
        str(w.message) for w in seen
    ]
