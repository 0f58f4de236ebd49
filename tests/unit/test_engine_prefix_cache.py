"""Prefix caching in the embedded engine: the radix cache itself, and outputs equal to the
uncached path on the real model."""

from __future__ import annotations

import asyncio

import pytest
import torch

from areal_env.api.io import GenerationConfig, ModelRequest
from areal_env.engine.prefix_cache import PrefixCache


def _kv(tokens: list[int]) -> torch.Tensor:
    """A fake KV [L=2, 2, H=1, n, D=3] whose values encode (position, token)."""
    n = len(tokens)
    base = torch.tensor(tokens, dtype=torch.float32)[None, None, None, :, None]
    pos = torch.arange(n, dtype=torch.float32)[None, None, None, :, None]
    return (base * 1000 + pos).expand(2, 2, 1, n, 3).clone()


def test_radix_cache_matches_longest_prefix_and_splits_edges():
    c = PrefixCache(max_tokens=1000)
    a = [5, 6, 7, 8, 9]
    assert c.match(a)[0] == 0
    assert c.insert(a, _kv(a)) == 5
    b = [5, 6, 7, 1, 2, 3]  # shares 3 tokens: the edge is split, only 3 tokens added
    assert c.insert(b, _kv(b)) == 3
    assert c.tokens == 8
    for seq, expect in ((a, 5), (b, 6), ([5, 6, 7, 8, 4], 4), ([5, 6], 2), ([4], 0)):
        n, kv = c.match(seq)
        assert n == expect == c.match_length(seq)
        if n:
            assert torch.equal(kv, _kv(seq[:n]))
    assert c.match(a, limit=4)[0] == 4  # never the whole prompt when the caller says so
    assert c.insert(a, _kv(a)) == 0  # already there
    c.clear()
    assert c.tokens == 0 and c.match(a)[0] == 0


def test_insert_takes_only_the_missing_tail_and_match_parts_are_views():
    c = PrefixCache(max_tokens=1000)
    a = [5, 6, 7, 8, 9]
    c.insert(a, _kv(a))
    b = [5, 6, 7, 8, 1, 2]
    have = c.match_length(b)
    assert have == 4
    assert c.insert(b, _kv(b)[:, :, :, have:], start=have) == 2  # the caller copied 2 columns
    n, parts = c.match_parts(b)
    assert n == 6 and torch.equal(torch.cat(parts, dim=3), _kv(b))
    with pytest.raises(ValueError, match="only 0 tokens are cached"):
        c.insert([3, 4, 5], _kv([4, 5]), start=1)  # a tail whose head is not cached
    with pytest.raises(ValueError, match="holds 3 positions for 2 tokens"):
        c.insert([3, 4], _kv([1, 2, 3]))


def test_radix_cache_stays_within_budget_evicting_least_recently_used():
    c = PrefixCache(max_tokens=10)
    old, new = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10]
    c.insert(old, _kv(old))
    c.insert(new, _kv(new))
    c.match(old)  # old is now the most recently used
    third = [11, 12, 13]
    c.insert(third, _kv(third))
    assert c.tokens <= 10
    assert c.match_length(old) == 6 and c.match_length(third) == 3
    assert c.match_length(new) == 0
    assert c.insert(list(range(20, 40)), _kv(list(range(20, 40)))) == 0  # larger than the budget
    assert PrefixCache(0).insert(old, _kv(old)) == 0


@pytest.fixture(scope="module")
def engines(model_path):
    from areal_env.engine.local import LocalEngine

    on = LocalEngine(model_path, max_batch_size=16, prefix_cache_mb=64)
    off = LocalEngine(model_path, max_batch_size=16, prefix_cache_mb=0)
    on.initialize()
    off.initialize()
    yield on, off
    on.destroy()
    off.destroy()


def _prompts(tokenizer) -> list[list[int]]:
    system = (
        "You are a helpful assistant. You can call tools. Tools: add(a, b) adds two numbers; "
        "mul(a, b) multiplies two numbers; sub(a, b) subtracts b from a. Answer briefly. "
    ) * 2
    tasks = ["What is 3 + 4?", "Compute 6 times 7.", "Subtract 5 from 12.", "Say hello."]
    return [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": t}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for t in tasks
    ]


async def _run(engine, prompts, new_tokens=12):
    g = GenerationConfig(max_new_tokens=new_tokens, greedy=True)
    return await asyncio.gather(*(engine.agenerate(ModelRequest(list(p), g)) for p in prompts))


def _same(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.output_tokens == y.output_tokens
        assert (
            max(abs(p - q) for p, q in zip(x.output_logprobs, y.output_logprobs, strict=True))
            < 1e-4
        )


def test_cached_prefill_gives_the_uncached_outputs(engines, tokenizer):
    on, off = engines
    prompts = _prompts(tokenizer)
    assert len(prompts[0]) > 80
    ref = asyncio.run(_run(off, prompts))
    # a first wave: the shared system prompt is prefilled once, every request reuses it
    got = asyncio.run(_run(on, prompts))
    _same(got, ref)
    s = on.stats()
    assert s["prefix_cache_hit_tokens"] >= 3 * 60
    assert s["prefix_cache_tokens"] > 0
    assert off.stats()["prefix_cache_hit_tokens"] == 0
    # a second wave, one at a time: whole earlier prompts (the next turn's prefix) are reused
    before = on.stats()["prefill_tokens"]
    turn2 = [
        p + r.output_tokens + tokenizer("\nuser: thanks, and 2+2?")["input_ids"]
        for p, r in zip(prompts, ref, strict=True)
    ]
    ref2 = asyncio.run(_run(off, turn2))
    for p, r in zip(turn2, ref2, strict=True):
        _same(asyncio.run(_run(on, [p])), [r])
    computed = on.stats()["prefill_tokens"] - before
    # each turn's prompt and output were cached when it finished: only the last output token
    # (never fed back) and the new user message are computed
    extra = len(tokenizer("\nuser: thanks, and 2+2?")["input_ids"])
    assert computed == len(turn2) * (extra + 1)


def test_a_row_decoded_across_a_weight_update_is_not_cached(engines, tokenizer):
    """Its keys/values mix two weight versions: the emptied cache must not take them back."""
    on, _ = engines
    prompt = _prompts(tokenizer)[3]
    state = {k: v.clone() for k, v in on.model.state_dict().items()}
    perturbed = {k: (v * 1.01 if "layers.0.mlp" in k else v) for k, v in state.items()}
    v0 = on.get_version()

    async def across_update():
        g = GenerationConfig(max_new_tokens=40, greedy=True, ignore_eos=True)
        task = asyncio.ensure_future(on.agenerate(ModelRequest(list(prompt), g)))
        start = on.stats()["tokens_generated"]
        while on.stats()["tokens_generated"] < start + 5:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(on.update_weights, perturbed)
        return await task

    try:
        out = asyncio.run(across_update())
        assert len(set(out.output_versions)) == 2
        assert on.worker.prefix_cache.match_length(list(prompt) + out.output_tokens[:-1]) == 0
    finally:
        on.update_weights(state)
        on.set_version(v0)


def test_weight_update_invalidates_the_cache(engines, tokenizer):
    on, off = engines
    prompts = _prompts(tokenizer)[:2]
    asyncio.run(_run(on, prompts))
    assert on.stats()["prefix_cache_tokens"] > 0
    state = {k: v.clone() for k, v in on.model.state_dict().items()}
    perturbed = {k: (v * 1.01 if "layers.0.mlp" in k else v) for k, v in state.items()}
    v0 = on.get_version()
    on.update_weights(perturbed)
    off.update_weights(perturbed)
    try:
        assert on.stats()["prefix_cache_tokens"] == 0
        _same(asyncio.run(_run(on, prompts)), asyncio.run(_run(off, prompts)))
    finally:
        on.update_weights(state)
        off.update_weights(state)
        on.set_version(v0)
        off.set_version(v0)
