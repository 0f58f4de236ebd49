"""A prompt prefix held once for the whole batch: the attention is the attention over the
concatenation, the batch's KV moves in and out of sharing without losing a column, and the
engine's outputs on the real model are the ones it gives with a copy of the prefix per row."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from areal_env.api.io import GenerationConfig, ModelRequest
from areal_env.engine.kv_cache import BatchKV
from areal_env.engine.shared_prefix import (
    SharedPrefix,
    shared_prefix_attention,
    supports_shared_prefix,
)


def _reference(q, k, v, mask, pk, pv, scale):
    """sdpa over [prefix, own columns], the key/value heads repeated for the query heads."""
    B, Hq, T, _ = q.shape
    group = Hq // k.shape[1]
    keys = torch.cat([pk[None].expand(B, -1, -1, -1), k], dim=2).repeat_interleave(group, 1)
    vals = torch.cat([pv[None].expand(B, -1, -1, -1), v], dim=2).repeat_interleave(group, 1)
    full = None
    if mask is not None:
        seen = torch.ones(B, 1, T, pk.shape[1], dtype=mask.dtype)
        if mask.dtype != torch.bool:
            seen = torch.zeros(B, 1, T, pk.shape[1], dtype=mask.dtype)
        full = torch.cat([seen, mask.expand(B, 1, T, -1)], dim=3)
    out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=full, scale=scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_attention_equals_attention_over_the_concatenation(T, mask_kind):
    g = torch.Generator().manual_seed(T)
    B, Hq, Hkv, S, P, D = 3, 6, 2, 5, 7, 8
    q = torch.randn(B, Hq, T, D, generator=g)
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    pk, pv = torch.randn(Hkv, P, D, generator=g), torch.randn(Hkv, P, D, generator=g)
    mask = None
    if mask_kind != "none":
        # causal over the own columns (the last T are the queries'), row 1 left-padded by 2
        allowed = torch.ones(B, 1, T, S, dtype=torch.bool)
        for t in range(T):
            allowed[:, :, t, S - T + t + 1 :] = False
        allowed[1, :, :, :2] = False
        mask = allowed
        if mask_kind == "additive":
            mask = torch.zeros(B, 1, T, S).masked_fill(~allowed, torch.finfo(torch.float32).min)
    got = shared_prefix_attention(q, k, v, mask, pk, pv, 0.3)
    want = _reference(q, k, v, mask, pk, pv, 0.3)
    assert got.shape == (B, T, Hq, D)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _kv(rows: list[list[int]]) -> BatchKV:
    """A batch of fake KV [L=2, 2, rows, H=1, T, D=2] whose values are the token ids,
    right-aligned with left padding, as the engine lays rows out."""
    T = max(map(len, rows))
    kv = torch.zeros(2, 2, len(rows), 1, T, 2)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for i, r in enumerate(rows):
        kv[:, :, i, 0, T - len(r) :] = torch.tensor(r, dtype=torch.float32)[:, None]
        mask[i, T - len(r) :] = True
    return BatchKV.merge(None, kv, mask, max_rows=8)


def _tokens(kv: BatchKV) -> list[list[int]]:
    """Each live row's tokens as its real columns hold them, in column order."""
    out = []
    for i in range(kv.rows):
        cols = kv.mask[i].nonzero().squeeze(1) + kv.start
        out.append([int(x) for x in kv.storage[0, 0, i, 0, cols, 0]])
    return out


def test_batch_moves_in_and_out_of_sharing_without_losing_a_column():
    prefix = [11, 12, 13, 14, 15]
    rows = [prefix + [1, 2, 3], prefix + [4], prefix + [5, 6]]
    kv = _kv(rows)
    kv.share(prefix)
    assert kv.shared is not None and kv.shared.key == prefix
    assert kv.shared.kv[0, 0, 0, :, 0].tolist() == prefix
    assert _tokens(kv) == [[1, 2, 3], [4], [5, 6]]
    assert kv.length == 3  # the all-padding columns in front are skipped, nothing copied
    # a row joins that shares only the first 3 tokens: 14, 15 go back into every row
    joining = [11, 12, 13, 9, 9, 7]
    kv.unshare_to(3)
    assert kv.shared is not None and kv.shared.key == prefix[:3]
    assert _tokens(kv) == [[14, 15, 1, 2, 3], [14, 15, 4], [14, 15, 5, 6]]
    new = _kv([joining])
    live = new.buf[..., new.start : new.start + new.length, :]
    new_kv, new_mask = BatchKV.strip_prefix(live, new.mask, 3)
    assert new_mask.shape[1] == 3  # the joining row's shared columns are dropped
    kv = BatchKV.merge(kv, new_kv, new_mask, max_rows=8)
    assert kv.shared is not None and kv.shared.length == 3
    assert _tokens(kv)[-1] == [9, 9, 7]
    # all of it back: every row holds its whole sequence again, in order
    kv.unshare_to(0)
    assert kv.shared is None
    assert _tokens(kv) == [r for r in rows] + [joining]
    with pytest.raises(ValueError, match="holds no more than"):
        _kv([prefix, prefix + [1]]).share(prefix)
    with pytest.raises(ValueError, match="holds 2 columns"):
        SharedPrefix([1, 2, 3], torch.zeros(1, 2, 1, 2, 4))


def test_models_whose_attention_cannot_share_are_refused():
    def model(**cfg):
        cfg.setdefault("_attn_implementation", "sdpa")
        return SimpleNamespace(config=SimpleNamespace(to_dict=lambda: cfg, **cfg))

    assert supports_shared_prefix(model()) is None
    assert "eager" in str(supports_shared_prefix(model(_attn_implementation="eager")))
    assert "sliding" in str(supports_shared_prefix(model(sliding_window=4096)))
    assert supports_shared_prefix(model(sliding_window=4096, use_sliding_window=False)) is None
    assert "layer types" in str(
        supports_shared_prefix(model(layer_types=["full_attention", "sliding_attention"]))
    )
    assert "soft-capped" in str(supports_shared_prefix(model(attn_logit_softcapping=50.0)))


@pytest.fixture(scope="module")
def engines(model_path):
    from areal_env.engine.local import LocalEngine

    shared = LocalEngine(model_path, max_batch_size=16, prefix_cache_mb=64)
    copied = LocalEngine(model_path, max_batch_size=16, prefix_cache_mb=64, share_prefixes=False)
    shared.initialize()
    copied.initialize()
    assert shared.worker.share_prefixes and not copied.worker.share_prefixes
    yield shared, copied
    shared.destroy()
    copied.destroy()


def _prompt(tokenizer, system: str, task: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": task}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )


SYSTEM = (
    "You are a careful assistant. Tools: add(a, b) adds two numbers; multiply(a, b) multiplies "
    "them; subtract(a, b) takes b from a. Call a tool, then answer with the number. "
) * 3


async def _waves(engine, waves: list[list[list[int]]], steps: int = 6):
    """Requests in waves; each wave after the first is sent once the running rows have decoded
    ``steps`` more tokens each, so it joins a running batch."""
    g = GenerationConfig(max_new_tokens=24, greedy=True, ignore_eos=True)
    tasks: list[asyncio.Future] = []
    for wave in waves:
        if tasks:
            until = engine.stats()["tokens_generated"] + steps * len(tasks)
            while engine.stats()["tokens_generated"] < until:
                await asyncio.sleep(0.005)
        tasks += [asyncio.ensure_future(engine.agenerate(ModelRequest(p, g))) for p in wave]
    return await asyncio.gather(*tasks)


def _same(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.output_tokens == y.output_tokens
        gaps = [abs(p - q) for p, q in zip(x.output_logprobs, y.output_logprobs, strict=True)]
        assert max(gaps) < 1e-4


def test_engine_outputs_equal_those_with_a_copy_per_row(engines, tokenizer):
    shared, copied = engines
    tasks = ["What is 3 + 4?", "Compute 6 times 7.", "Take 5 from 12.", "Add 8 and 9."]
    # two samples of one problem: they share the system prompt and the question
    first = [_prompt(tokenizer, SYSTEM, tasks[0])] * 2
    # joins the running batch: shares the system prompt, not the question (which goes back
    # into the running rows)
    second = [_prompt(tokenizer, SYSTEM, t) for t in tasks[1:]]
    # shares nothing long with them: the batch goes back to a copy per row
    odd = [_prompt(tokenizer, "Be brief.", "Say hello.")]
    waves = [first, second, odd]
    steps0 = shared.stats()["shared_prefix_steps"]
    got = asyncio.run(_waves(shared, waves))
    want = asyncio.run(_waves(copied, waves))
    _same(got, want)
    assert shared.stats()["shared_prefix_steps"] - steps0 >= 10
    assert copied.stats()["shared_prefix_steps"] == 0
    # the next turns start with this turn's prompt and output: rows that finished while the
    # prefix was shared were cached whole, and the next turn's outputs agree too
    turn2 = [
        p + r.output_tokens + tokenizer("\n<tool_response>\n7\n</tool_response>")["input_ids"]
        for p, r in zip(first + second, want[:5], strict=True)
    ]
    before = shared.stats()["prefill_tokens"]
    _same(asyncio.run(_waves(shared, [turn2])), asyncio.run(_waves(copied, [turn2])))
    assert shared.stats()["prefill_tokens"] - before < sum(map(len, turn2)) // 4


def test_next_turns_joining_a_sharing_batch_read_its_prefix_once(engines, tokenizer):
    """An agent's next turn (its last prompt and output cached, a tool result after them)
    joins a batch that holds the system prompt once: its prefill reads that prefix from the
    batch instead of copying it into its row, and decodes as with a copy per row."""
    shared, copied = engines
    tool = tokenizer("\n<tool_response>\n7\n</tool_response>")["input_ids"]
    first = [_prompt(tokenizer, SYSTEM, t) for t in ("What is 3 + 4?", "Add 8 and 9.")]
    outs = asyncio.run(_waves(copied, [first]))
    asyncio.run(_waves(shared, [first]))  # both engines cache the first turn
    turn2 = [p + r.output_tokens + tool for p, r in zip(first, outs, strict=True)]
    running = [_prompt(tokenizer, SYSTEM, t) for t in ("Take 5 from 12.", "Compute 6 times 7.")]
    before = shared.stats()["shared_prefix_prefill_row_tokens"]
    got = asyncio.run(_waves(shared, [running, turn2]))
    read_once = shared.stats()["shared_prefix_prefill_row_tokens"] - before
    _same(got, asyncio.run(_waves(copied, [running, turn2])))
    assert read_once >= len(turn2) * len(tokenizer(SYSTEM)["input_ids"])
    assert copied.stats()["shared_prefix_prefill_row_tokens"] == 0


def test_rows_prefilled_after_a_weight_update_do_not_attend_to_the_old_prefix(engines, tokenizer):
    """The shared prefix's keys belong to the weights it was computed under: rows that join
    after an update must see their own (the rows running across the update keep theirs)."""
    shared, copied = engines
    running = [_prompt(tokenizer, SYSTEM, t) for t in ("What is 3 + 4?", "Add 8 and 9.")]
    joining = [_prompt(tokenizer, SYSTEM, t) for t in ("Take 5 from 12.", "Compute 6 times 7.")]
    state = {k: v.clone() for k, v in shared.model.state_dict().items()}
    perturbed = {k: (v * 1.01 if "layers.0.mlp" in k else v) for k, v in state.items()}
    versions = shared.get_version(), copied.get_version()

    async def across_update():
        g = GenerationConfig(max_new_tokens=48, greedy=True, ignore_eos=True)
        first = [asyncio.ensure_future(shared.agenerate(ModelRequest(p, g))) for p in running]
        start = shared.stats()["tokens_generated"]
        while shared.stats()["tokens_generated"] < start + 12:
            await asyncio.sleep(0.005)
        steps = shared.stats()["shared_prefix_steps"]
        await asyncio.to_thread(shared.update_weights, perturbed)
        got = await _waves(shared, [joining])
        await asyncio.gather(*first)
        return got, steps

    try:
        got, shared_steps = asyncio.run(across_update())
        assert shared_steps > 0  # the running rows did share their prefix before the update
        copied.update_weights(perturbed)
        _same(got, asyncio.run(_waves(copied, [joining])))
    finally:
        shared.update_weights(state)
        copied.update_weights(state)
        shared.set_version(versions[0])
        copied.set_version(versions[1])


def test_attention_arguments_it_does_not_implement_are_refused_not_ignored():
    from areal_env.engine.shared_prefix import transformers_attention

    q, k = torch.randn(1, 2, 1, 4), torch.randn(1, 1, 3, 4)
    prefix = SharedPrefix([1, 2], torch.randn(1, 2, 1, 2, 4))
    layer = SimpleNamespace(layer_idx=0, num_key_value_groups=2, is_causal=True)
    out, _ = transformers_attention(layer, q, k, k, None, scaling=0.5, shared_prefix=prefix)
    assert out.shape == (1, 1, 2, 4)
    with pytest.raises(RuntimeError, match="s_aux.*engine.share_prefixes: false"):
        transformers_attention(
            layer, q, k, k, None, scaling=0.5, shared_prefix=prefix, s_aux=torch.zeros(2)
        )
    # without a prefix it is plain sdpa, whatever the model passes
    plain, _ = transformers_attention(layer, q, k, k, None, scaling=0.5)
    assert plain.shape == (1, 1, 2, 4)


def test_common_prefix_len_agrees_with_a_token_by_token_scan():
    """Its slice bisection (two lists, two tuples) and its scan (mixed types) count the same."""
    from areal_env.api.tokens import common_prefix_len

    def scan(a, b):
        i = 0
        while i < min(len(a), len(b)) and a[i] == b[i]:
            i += 1
        return i

    g = torch.Generator().manual_seed(0)
    for _ in range(2000):
        a = torch.randint(0, 3, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g)
        cut = int(torch.randint(0, len(a) + 1, (1,), generator=g))
        tail = torch.randint(0, 3, (int(torch.randint(0, 6, (1,), generator=g)),), generator=g)
        x, y = a.tolist(), a[:cut].tolist() + tail.tolist()
        for p, q in ((x, y), (tuple(x), tuple(y)), (tuple(x), y)):
            assert common_prefix_len(p, q) == scan(p, q)
