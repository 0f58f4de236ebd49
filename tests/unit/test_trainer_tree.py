"""Tree training: packed logprobs and gradients equal the flat (row by row) computation."""

from __future__ import annotations

import random

import pytest
import torch

from areal_env.api.config import ActorConfig, ConfigError, ModelConfig
from areal_env.trainer.actor import PPOActor
from areal_env.trainer.actor_lora import enable_checkpointing
from areal_env.trainer.actor_math import minibatch_rows
from areal_env.trainer.tree import pack_rows, packed_size, tree_micro_batches
from areal_env.trainer.tree_attention import (
    FLEX_BLOCK,
    TREE_ATTN,
    enable_tree_attention,
    flex_bucket,
    flex_probe,
    flex_tree_attention,
    flex_tree_mask,
    segment_tree_attention,
    tree_kernel,
)

# ---------------------------------------------------------------- packing (no model)


def test_pack_rows_shares_prefixes_and_keeps_row_order():
    rows = [[1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 4, 6, 7], [9], [1, 2, 5]]
    tree = pack_rows(rows)
    # nodes: 1,2,3,4 | 6,7 | 5 | 9  -> 8 distinct prefixed tokens
    assert tree.n_nodes == 8 == packed_size(rows)
    assert tree.n_logical == sum(map(len, rows))
    for row, path in zip(rows, tree.paths, strict=True):
        assert tree.input_ids[path].tolist() == row
        assert tree.position_ids[path].tolist() == list(range(len(row)))
    assert tree.paths[1].tolist() == tree.paths[4].tolist()  # identical rows, identical nodes
    assert tree.paths[2][:4].tolist() == tree.paths[0].tolist()  # multi-turn: extends row 0
    # every node is owned (added) by exactly one row
    owned = torch.cat([p[k:] for p, k in zip(tree.paths, tree.owned_from, strict=True)])
    assert sorted(owned.tolist()) == list(range(tree.n_nodes))


def _segment_keys(seg, node: int) -> list[int]:
    """The nodes ``node`` attends to under the trunk/segment layout."""
    if node < seg.trunk:
        return list(range(node + 1))
    lo = seg.trunk
    for i, size in enumerate(seg.sizes):
        if node < lo + size:
            allowed = seg.allowed(i)[node - lo]
            return sorted(seg.keys[i][allowed].tolist())
        lo += size
    raise AssertionError(f"node {node} is in no segment")


@pytest.mark.parametrize("seed", range(40))
def test_segment_attention_equals_the_dense_tree_mask(seed):
    """Random tries (shared system prompt or none, identical rows, rows inside the trunk): each
    node attends to exactly its ancestors, and outputs and gradients equal the dense mask's."""
    rng = random.Random(seed)
    system = [rng.randint(0, 5) for _ in range(rng.randint(0, 6))]
    rows = [
        system + [rng.randint(0, 3) for _ in range(rng.randint(0 if system else 1, 7))]
        for _ in range(rng.randint(1, 8))
    ]
    tree = pack_rows(rows)
    seg = tree.attention_segments()
    dense = tree.ancestor_mask()
    assert seg.trunk + sum(seg.sizes) == tree.n_nodes
    for node in range(tree.n_nodes):
        assert _segment_keys(seg, node) == dense[node].nonzero().squeeze(-1).tolist()
    n, heads, kv_heads, d = tree.n_nodes, 4, 2, 8
    g = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(1, h, n, d, dtype=torch.float64, generator=g).requires_grad_()
        for h in (heads, kv_heads, kv_heads)
    )
    rep = heads // kv_heads
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=dense[None, None]
    ).transpose(1, 2)
    out = segment_tree_attention(q, k, v, seg, None)
    assert out.shape == ref.shape and (out - ref).abs().max() < 1e-10
    w = torch.randn(ref.shape, dtype=torch.float64, generator=g)
    for a, b in zip(
        torch.autograd.grad((ref * w).sum(), (q, k, v)),
        torch.autograd.grad((out * w).sum(), (q, k, v)),
        strict=True,
    ):
        assert (a - b).abs().max() < 1e-10


def _random_tree(seed: int, long: bool = False):
    rng = random.Random(seed)
    system = [rng.randint(0, 5) for _ in range(rng.randint(0, 300 if long else 6))]
    longest = 200 if long else 7
    rows = [
        system + [rng.randint(0, 3) for _ in range(rng.randint(0 if system else 1, longest))]
        for _ in range(rng.randint(1, 12))
    ]
    return pack_rows(rows)


@pytest.mark.parametrize("seed", range(12))
def test_the_trie_is_laid_out_in_preorder(seed):
    """A node's descendants are one interval [k, end[k]): ancestors are k <= q < end[k]."""
    tree = _random_tree(seed)
    end = tree.subtree_end()
    q = torch.arange(tree.n_nodes)[:, None]
    k = torch.arange(tree.n_nodes)[None, :]
    assert torch.equal((k <= q) & (q < end[None, :]), tree.ancestor_mask())


def _block_mask_elements(fm) -> torch.Tensor:
    """The element mask a FlexAttention block mask stands for: full blocks all allowed,
    partial blocks as their mask function says, every other block skipped."""
    bm, length = fm.block_mask, fm.length
    nb = length // FLEX_BLOCK
    q = torch.arange(length)[:, None]
    k = torch.arange(length)[None, :]
    by_mod = bm.mask_mod(0, 0, q, k)
    out = torch.zeros(length, length, dtype=torch.bool)
    for qb in range(nb):
        rs = slice(qb * FLEX_BLOCK, (qb + 1) * FLEX_BLOCK)
        for j in range(int(bm.full_kv_num_blocks[0, 0, qb])):
            kb = int(bm.full_kv_indices[0, 0, qb, j])
            out[rs, kb * FLEX_BLOCK : (kb + 1) * FLEX_BLOCK] = True
        for j in range(int(bm.kv_num_blocks[0, 0, qb])):
            kb = int(bm.kv_indices[0, 0, qb, j])
            ks = slice(kb * FLEX_BLOCK, (kb + 1) * FLEX_BLOCK)
            out[rs, ks] = by_mod[rs, ks]
    return out


@pytest.mark.parametrize("seed", range(10))
def test_flex_block_mask_from_the_trie_equals_the_ancestor_mask(seed):
    """Built from the trie's intervals (no dense tensor): real nodes see exactly their
    ancestors, padding nodes only themselves, and blocks without an ancestor are skipped."""
    tree = _random_tree(seed, long=True)
    fm = flex_tree_mask(tree.subtree_end(), "cpu")
    n = tree.n_nodes
    assert fm.n_nodes == n and fm.length == flex_bucket(n) >= n and fm.length % FLEX_BLOCK == 0
    want = torch.eye(fm.length, dtype=torch.bool)
    want[:n, :n] = tree.ancestor_mask()
    assert torch.equal(_block_mask_elements(fm), want)
    # no block is listed that holds no allowed pair, and none both full and partial
    dense_blocks = want.view(fm.length // FLEX_BLOCK, FLEX_BLOCK, -1, FLEX_BLOCK).any(3).any(1)
    listed = fm.block_mask.to_dense()[0, 0].bool()
    assert torch.equal(listed, dense_blocks)


def test_flex_buckets_are_powers_of_two_blocks():
    assert [flex_bucket(n) for n in (1, 128, 129, 3267, 4096, 4097)] == [
        128,
        128,
        256,
        4096,
        4096,
        8192,
    ]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("seed", range(6))
def test_flex_tree_attention_forward_equals_the_segment_path(seed):
    """FlexAttention's eager forward (the CPU has no backward) over the trie's block mask
    equals the trunk/segment sdpa path and the dense mask (GQA, padding to the bucket)."""
    tree = _random_tree(seed, long=True)
    n, heads, kv_heads, d = tree.n_nodes, 4, 2, 16
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, n, d, generator=g) for h in (heads, kv_heads, kv_heads))
    seg = segment_tree_attention(q, k, v, tree.attention_segments(), 0.3)
    fm = flex_tree_mask(tree.subtree_end(), "cpu")
    flex = flex_tree_attention(q, k, v, fm, 0.3, compiled=False)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q,
        k.repeat_interleave(2, 1),
        v.repeat_interleave(2, 1),
        scale=0.3,
        attn_mask=tree.ancestor_mask()[None, None],
    ).transpose(1, 2)
    assert flex.shape == seg.shape == dense.shape == (1, n, heads, d)
    assert (flex - dense).abs().max() < 1e-5
    assert (flex - seg).abs().max() < 1e-5


def test_tree_kernel_picks_flex_on_cuda_only():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert tree_kernel("auto", cpu) == "sdpa"
    assert tree_kernel("sdpa", cuda) == "sdpa"
    assert tree_kernel("auto", cuda) == "flex"  # flex_attention ships with torch >= 2.5
    with pytest.raises(ConfigError, match="tree_attention=flex needs a CUDA device"):
        tree_kernel("flex", cpu)
    with pytest.raises(ConfigError, match="tree_attention"):
        ActorConfig(tree_attention="triton").validate()  # type: ignore[arg-type]


def test_flex_probe_finds_a_kernel_that_cannot_train_here(tiny_model_path, monkeypatch, caplog):
    """The CPU has no FlexAttention backward: the probe says so, and an actor whose automatic
    choice was flex (forced here, as on a GPU whose compiler fails) falls back to sdpa with a
    warning instead of failing mid-step."""
    import logging

    import areal_env.trainer.actor as actor_module

    why = flex_probe(torch.device("cpu"), 4, 2, 32, torch.float32)
    assert why is not None and "backward" in why
    monkeypatch.setattr(actor_module, "tree_kernel", lambda setting, device: "flex")
    with caplog.at_level(logging.WARNING, logger="areal_env.trainer.actor"):
        actor = PPOActor(tiny_model_path, ActorConfig(), ModelConfig(device="cpu"))
    assert actor.tree_kernel == "sdpa"
    assert "FlexAttention fails here" in caplog.text


def test_ancestor_mask_matches_brute_force():
    rng = random.Random(0)
    rows = [[rng.randint(0, 3) for _ in range(rng.randint(1, 9))] for _ in range(30)]
    tree = pack_rows(rows)
    mask = tree.ancestor_mask()
    # brute force: k is an ancestor-or-self of q iff some row's path holds k before/at q
    expect = torch.zeros_like(mask)
    for path in tree.paths:
        for i, q in enumerate(path.tolist()):
            for k in path[: i + 1].tolist():
                expect[q, k] = True
    assert torch.equal(mask, expect)
    # parents come first: the mask is lower-triangular in node order
    assert not torch.triu(mask, diagonal=1).any()


def test_tree_micro_batches_respect_the_node_budget():
    rng = random.Random(1)
    prefix = list(range(20))
    rows = [prefix + [rng.randint(0, 50) for _ in range(rng.randint(1, 15))] for _ in range(16)]
    rows.append(list(range(100, 160)))  # longer than the budget: alone
    groups = tree_micro_batches(rows, list(range(len(rows))), 50)
    assert sorted(r for g in groups for r in g) == list(range(len(rows)))
    for g in groups:
        assert len(g) == 1 or packed_size([rows[r] for r in g]) <= 50
    assert len(groups) > 2


def test_tree_training_config_is_validated():
    with pytest.raises(ConfigError, match="tree_training"):
        ActorConfig(tree_training="yes").validate()  # type: ignore[arg-type]


# ---------------------------------------------------------------- real model


def _agent_batch(tokenizer, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows shaped like agent RL: two GRPO groups over a shared system prompt, identical samples,
    multi-turn rows that extend an earlier row, and branches after a shared first turn."""
    g = random.Random(seed)
    system = tokenizer("You are a careful assistant with a calculator tool. " * 3)["input_ids"]
    tasks = [tokenizer(t)["input_ids"] for t in (" What is 3 + 4?", " Multiply 6 by 7 please.")]

    def words(n: int) -> list[int]:
        vocab = [" add", " 7", " the", " answer", " is", " tool", " call", " 42", " ok"]
        return sum((tokenizer(g.choice(vocab))["input_ids"] for _ in range(n)), [])

    rows: list[tuple[list[int], list[int]]] = []  # (tokens, loss mask)
    for task in tasks:
        prompt = system + task
        first = words(4)
        for i in range(4):
            comp = first if i == 1 else words(3 + i)  # samples 0/1 identical (first == first)
            if i == 0:
                comp = first
            rows.append((prompt + comp, [0] * len(prompt) + [1] * len(comp)))
        # multi-turn: turn 2 extends sample 0 with a tool result and a second answer
        tool = tokenizer(" <tool_response>7</tool_response>")["input_ids"]
        second = words(3)
        toks = prompt + first + tool + second
        lm = [0] * len(prompt) + [1] * len(first) + [0] * len(tool) + [1] * len(second)
        rows.append((toks, lm))
        # a branch: same first turn and tool result, different second answer
        other = words(2)
        rows.append(
            (
                prompt + first + tool + other,
                lm[: len(prompt) + len(first) + len(tool)] + [1] * len(other),
            )
        )
    width = max(len(t) for t, _ in rows) + 2
    b = len(rows)
    batch = {
        "input_ids": torch.full((b, width), tokenizer.eos_token_id, dtype=torch.int64),
        "attention_mask": torch.zeros(b, width, dtype=torch.bool),
        "loss_mask": torch.zeros(b, width, dtype=torch.int32),
        "logprobs": torch.zeros(b, width),
        "versions": torch.full((b, width), -1, dtype=torch.int32),
        "rewards": torch.tensor([float(i % 3 == 0) for i in range(b)]),
        "group_ids": torch.tensor([i // (b // 2) for i in range(b)]),
        "traj_ids": torch.arange(b),
    }
    for i, (t, lm) in enumerate(rows):
        batch["input_ids"][i, : len(t)] = torch.tensor(t)
        batch["attention_mask"][i, : len(t)] = True
        batch["loss_mask"][i, : len(t)] = torch.tensor(lm, dtype=torch.int32)
    return batch


@pytest.fixture(scope="module")
def actor(model_path):
    cfg = ActorConfig(ppo_n_minibatches=1, micro_batch_tokens=4096, lr=1e-5)
    return PPOActor(
        model_path, cfg, ModelConfig(gradient_checkpointing=True), temperature=0.8, seed=2
    )


def _logprobs(actor, batch, mode, budget):
    actor.cfg.tree_training, actor.cfg.micro_batch_tokens = mode, budget
    return actor.compute_logprobs(batch)


def test_tree_logprobs_equal_flat(actor, tokenizer):
    batch = _agent_batch(tokenizer)
    lengths = batch["attention_mask"].sum(1).tolist()
    plan = actor.plan_micro_batches(batch["input_ids"], lengths, list(range(len(lengths))))
    assert plan.tree and plan.computed_tokens < 0.6 * plan.logical_tokens
    flat = _logprobs(actor, batch, "off", 4096)
    tree = _logprobs(actor, batch, "on", 4096)
    small = _logprobs(actor, batch, "on", 120)  # several packed micro-batches
    assert len(actor.plan_micro_batches(batch["input_ids"], lengths, plan.groups[0]).groups) >= 1
    mask = batch["loss_mask"].bool()
    assert (flat[mask] != 0).all()
    assert (tree - flat).abs().max() < 1e-4
    assert (small - flat).abs().max() < 1e-4
    assert (tree[~mask] == 0).all()
    # the actor runs the trunk/segment attention; the dense mask gives the same numbers
    assert actor.model.config._attn_implementation == TREE_ATTN
    actor.model.set_attn_implementation("sdpa")
    try:
        dense = _logprobs(actor, batch, "on", 4096)
        plain_flat = _logprobs(actor, batch, "off", 4096)
    finally:
        assert enable_tree_attention(actor.model)
    assert (dense - tree).abs().max() < 1e-4
    assert (plain_flat - flat).abs().max() < 1e-5  # the wrapper leaves other calls to sdpa


def _grads(actor, batch, mode, budget):
    actor.cfg.tree_training, actor.cfg.micro_batch_tokens = mode, budget
    pb = actor.prepare(batch)
    n_tok = int(pb.mask.sum())
    actor.model.zero_grad(set_to_none=True)
    plan = actor.plan_micro_batches(pb.input_ids, pb.lengths, list(range(len(pb.lengths))))
    assert plan.tree == (mode == "on")
    total = 0.0
    for micro in plan.groups:
        loss, _ = actor._micro_loss(pb, micro, tree=plan.tree)
        (loss / n_tok).backward()
        total += float(loss.detach()) / n_tok
    grads = torch.cat([p.grad.flatten() for p in actor.model.parameters() if p.grad is not None])
    actor.model.zero_grad(set_to_none=True)
    return total, grads, len(plan.groups)


def test_tree_gradients_equal_flat_with_checkpointing_and_micro_batches(actor, tokenizer):
    batch = _agent_batch(tokenizer, seed=1)
    mask = batch["loss_mask"].bool()
    lp = _logprobs(actor, batch, "off", 4096)
    g = torch.Generator().manual_seed(0)
    batch["logprobs"] = torch.where(mask, lp + (torch.rand(lp.shape, generator=g) - 0.5) * 0.5, 0)
    actor.model.train()
    assert (
        getattr(actor.model, "is_activation_checkpointing", None)
        or actor.model.is_gradient_checkpointing
    )
    loss_f, grad_f, _ = _grads(actor, batch, "off", 4096)
    loss_t, grad_t, n_one = _grads(actor, batch, "on", 4096)
    loss_m, grad_m, n_many = _grads(actor, batch, "on", 120)
    assert n_one == 1 and n_many > 1
    assert loss_t == pytest.approx(loss_f, rel=1e-5, abs=1e-6)
    assert loss_m == pytest.approx(loss_f, rel=1e-5, abs=1e-6)
    scale = grad_f.norm()
    assert scale > 0
    assert float((grad_t - grad_f).norm() / scale) < 1e-4
    assert float((grad_m - grad_f).norm() / scale) < 1e-4


def _saved_bytes(actor, batch) -> tuple[int, torch.Tensor]:
    """Bytes autograd keeps for the backward pass of one tree micro-batch, and its gradients."""
    saved = 0

    def pack(t):
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, grads, _ = _grads(actor, batch, "on", 4096)
    return saved, grads


def test_checkpointed_layer_share_trades_saved_activations_not_gradients(actor, tokenizer):
    """Half of the layers checkpointed keep about half of the activations of none, more than
    all; the gradients are the same either way."""
    batch = _agent_batch(tokenizer, seed=1)
    batch["logprobs"] = torch.where(batch["loss_mask"].bool(), -1.0, 0.0)
    actor.model.train()
    n_layers = actor.model.config.num_hidden_layers
    try:
        assert enable_checkpointing(actor.model, 1.0) == n_layers
        all_saved, grad_all = _saved_bytes(actor, batch)
        assert enable_checkpointing(actor.model, 0.5) == n_layers // 2
        half_saved, grad_half = _saved_bytes(actor, batch)
        actor.model.gradient_checkpointing_disable()
        none_saved, grad_none = _saved_bytes(actor, batch)
    finally:
        enable_checkpointing(actor.model, 1.0)
    assert all_saved < half_saved < none_saved
    assert abs(half_saved - (all_saved + none_saved) / 2) < 0.1 * (none_saved - all_saved)
    for g in (grad_half, grad_none):
        assert float((g - grad_all).norm() / grad_all.norm()) < 1e-4


def test_update_reports_tree_packing_and_peak_memory(actor, tokenizer):
    batch = _agent_batch(tokenizer, seed=2)
    actor.cfg.tree_training, actor.cfg.micro_batch_tokens = "auto", 4096
    stats = actor.update(batch, step=1)
    assert stats["actor/update_skipped"] == 0.0
    assert stats["actor/tree_packed"] == 1.0
    assert stats["actor/token_sharing"] > 1.5
    assert 0.3 < stats["mem/update_peak_rss_gb"] < 64


def test_minibatches_keep_groups_whole_and_balance_tokens():
    groups = torch.tensor([g for g in range(6) for _ in range(4)])
    lengths = [100 + 10 * (r % 5) for r in range(24)]
    gen = torch.Generator().manual_seed(0)
    mbs = minibatch_rows(2, lengths, groups, gen, by_group=True)
    assert sorted(r for mb in mbs for r in mb) == list(range(24))
    assert all(len({int(groups[r]) for r in mb}) * 4 == len(mb) for mb in mbs)  # whole groups
    loads = [sum(lengths[r] for r in mb) for mb in mbs]
    assert max(loads) - min(loads) <= max(lengths) * 4
    # another draw deals the groups differently; rows at random split groups
    other = minibatch_rows(2, lengths, groups, torch.Generator().manual_seed(1), by_group=True)
    assert {frozenset(mb) for mb in other} != {frozenset(mb) for mb in mbs}
    rows = minibatch_rows(2, lengths, groups, torch.Generator().manual_seed(0), by_group=False)
    assert any(len({int(groups[r]) for r in mb}) == 6 for mb in rows)
    # fewer groups than minibatches, or no group ids: rows at random; never an empty minibatch
    one = minibatch_rows(2, lengths[:4], groups[:4], gen, by_group=True)
    assert sorted(map(len, one)) == [2, 2]
    few = minibatch_rows(4, lengths[:3], None, gen, by_group=True)
    assert sorted(map(len, few)) == [1, 1, 1]


def test_group_minibatches_compute_fewer_tree_tokens(model_path, tokenizer):
    batch = _agent_batch(tokenizer, seed=3)
    computed = {}
    for by_group in (True, False):
        cfg = ActorConfig(ppo_n_minibatches=2, micro_batch_tokens=4096, lr=1e-5)
        cfg.minibatch_by_group, cfg.tree_training = by_group, "on"
        a = PPOActor(model_path, cfg, ModelConfig(gradient_checkpointing=True), seed=2)
        stats = a.update(batch, step=1)
        assert stats["actor/update_skipped"] == 0.0
        computed[by_group] = stats["actor/computed_tokens"]
    assert computed[True] < computed[False]
