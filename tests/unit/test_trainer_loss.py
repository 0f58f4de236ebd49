"""PPO loss against plain-loop references, on hand-built batches and real model forward passes."""

from __future__ import annotations

import math

import pytest
import torch

from areal_env.api.config import ActorConfig, ConfigError, ModelConfig
from areal_env.trainer.actor import PPOActor
from areal_env.trainer.actor_math import (
    high_entropy_mask,
    optimizer_steps_taken,
    ppo_token_loss,
    token_logprobs,
    warmup_lr,
)
from areal_env.trainer.advantages import weight_negatives_by_prob
from areal_env.trainer.dist import micro_batches
from areal_env.trainer.tree_attention import TREE_ATTN


def ref_token_loss(
    lp, old, adv, eps, eps_high=None, behav=None, cap=None, ref=None, kl=0.0, estimator="k2"
):
    """Plain-Python PPO-clip (optionally decoupled, with a k2 or k3 KL), one token at a time."""
    eps_high = eps if eps_high is None else eps_high
    out, clipped = [], 0
    for i in range(len(lp)):
        r = math.exp(lp[i] - old[i])
        a = adv[i]
        unclipped = -a * r
        rc = min(max(r, 1 - eps), 1 + eps_high)
        clip_obj = -a * rc
        loss = max(unclipped, clip_obj)
        clipped += clip_obj > unclipped
        if behav is not None:
            w = math.exp(old[i] - behav[i])
            if cap is not None:
                w = min(w, cap)
            loss *= w
        if ref is not None and kl > 0:
            d = ref[i] - lp[i]
            loss += kl * (d * d / 2 if estimator == "k2" else math.exp(d) - d - 1)
        out.append(loss)
    return out, clipped


def test_ppo_token_loss_matches_reference_loops():
    g = torch.Generator().manual_seed(0)
    n = 64
    lp = -torch.rand(n, generator=g) * 3
    old = lp + (torch.rand(n, generator=g) - 0.5) * 0.8
    behav = old + (torch.rand(n, generator=g) - 0.5) * 4
    ref = lp + (torch.rand(n, generator=g) - 0.5)
    adv = torch.randn(n, generator=g)
    L = lambda t: t.tolist()  # noqa: E731
    for kwargs, rkwargs in [
        ({}, {}),
        ({"eps_clip_high": 0.28}, {"eps_high": 0.28}),
        (
            {"behav_logp": behav, "behav_imp_weight_cap": 2.0},
            {"behav": L(behav), "cap": 2.0},
        ),
        ({"ref_logp": ref, "kl_coef": 0.1}, {"ref": L(ref), "kl": 0.1}),
        (
            {"ref_logp": ref, "kl_coef": 0.1, "kl_estimator": "k3"},
            {"ref": L(ref), "kl": 0.1, "estimator": "k3"},
        ),
    ]:
        loss, diag = ppo_token_loss(lp, old, adv, eps_clip=0.2, **kwargs)
        expect, n_clipped = ref_token_loss(L(lp), L(old), L(adv), 0.2, **rkwargs)
        assert loss.tolist() == pytest.approx(expect, rel=1e-5, abs=1e-6), kwargs
        assert int(diag["clipped"].sum()) == n_clipped
    # the cap really binds in this data
    w = torch.exp(old - behav)
    assert (w > 2.0).any()
    _, diag = ppo_token_loss(lp, old, adv, eps_clip=0.2, behav_logp=behav, behav_imp_weight_cap=2.0)
    assert float(diag["behav_imp_weight"].max()) <= 2.0


def test_micro_batches_respect_token_budget():
    lengths = [10, 50, 30, 30, 5, 64]
    mbs = micro_batches(lengths, list(range(6)), 64)
    assert sorted(r for mb in mbs for r in mb) == list(range(6))
    for mb in mbs:
        assert len(mb) == 1 or max(lengths[r] for r in mb) * len(mb) <= 64


def _batch(tokenizer, gen):
    """Four hand-built rows (right-padded, unequal lengths) with loss masks on the completions."""
    texts = [
        ("Say hi.", " Hi there! How are you today?"),
        ("What is 2+2?", " 4"),
        ("Name a colour.", " Blue, like the sky on a clear day."),
        ("Count to three.", " one two three"),
    ]
    rows = []
    for p, c in texts:
        pid = tokenizer(p)["input_ids"]
        cid = tokenizer(c)["input_ids"] + [tokenizer.eos_token_id]  # eos is trained on
        rows.append((pid, cid))
    width = max(len(p) + len(c) for p, c in rows) + 3
    b = len(rows)
    batch = {
        "input_ids": torch.full((b, width), tokenizer.eos_token_id, dtype=torch.int64),
        "attention_mask": torch.zeros(b, width, dtype=torch.bool),
        "loss_mask": torch.zeros(b, width, dtype=torch.int32),
        "logprobs": torch.zeros(b, width),
        "versions": torch.full((b, width), -1, dtype=torch.int32),
        "rewards": torch.tensor([1.0, 0.0, 1.0, 0.0]),
        "group_ids": torch.tensor([0, 0, 1, 1]),
        "traj_ids": torch.tensor([0, 1, 2, 3]),
    }
    for i, (p, c) in enumerate(rows):
        n = len(p) + len(c)
        batch["input_ids"][i, :n] = torch.tensor(p + c)
        batch["attention_mask"][i, :n] = True
        batch["loss_mask"][i, len(p) : n] = 1
        batch["versions"][i, len(p) : n] = 0
    return batch


def _ref_logprobs(model, batch, temperature):
    """Full-vocabulary teacher-forced logprobs with a plain loop over rows (no batching)."""
    out = torch.zeros(batch["input_ids"].shape)
    with torch.no_grad():
        for i in range(batch["input_ids"].shape[0]):
            n = int(batch["attention_mask"][i].sum())
            ids = batch["input_ids"][i : i + 1, :n]
            logits = model(input_ids=ids).logits[0].float() / temperature
            lsm = torch.log_softmax(logits, -1)
            for t in range(1, n):
                if batch["loss_mask"][i, t]:
                    out[i, t] = lsm[t - 1, ids[0, t]]
    return out


@pytest.fixture(scope="module")
def actor_and_batch(model_path, tokenizer):
    cfg = ActorConfig(ppo_n_minibatches=1, micro_batch_tokens=48, lr=1e-5)
    actor = PPOActor(
        model_path, cfg, ModelConfig(gradient_checkpointing=False), temperature=0.7, seed=3
    )
    batch = _batch(tokenizer, None)
    return actor, batch


def test_recomputed_logprobs_match_reference(actor_and_batch):
    actor, batch = actor_and_batch
    got = actor.compute_logprobs(batch)
    ref = _ref_logprobs(actor.model, batch, 0.7)
    assert torch.allclose(got, ref, atol=2e-4), (got - ref).abs().max()
    assert (got[~batch["loss_mask"].bool()] == 0).all()


def test_update_loss_and_grads_match_reference(actor_and_batch, model_path):
    actor, batch = actor_and_batch
    ref_lp = _ref_logprobs(actor.model, batch, 0.7)
    mask = batch["loss_mask"].bool()
    g = torch.Generator().manual_seed(1)
    behav = torch.where(mask, ref_lp + (torch.rand(ref_lp.shape, generator=g) - 0.5), 0.0)
    batch = {**batch, "logprobs": behav}
    # reference: group-normalised advantages by hand (groups [1,0] and [1,0]: ±1/sqrt(.5)/…)
    a = 0.5 / math.sqrt(0.5)
    row_adv = [a, -a, a, -a]
    lp, old, adv = [], [], []
    for i in range(4):
        for t in range(batch["input_ids"].shape[1]):
            if mask[i, t]:
                lp.append(float(ref_lp[i, t]))
                old.append(float(behav[i, t]))
                adv.append(row_adv[i])
    per_tok, n_clipped = ref_token_loss(lp, old, adv, 0.2)
    expect_loss = sum(per_tok) / len(per_tok)

    # gradients with small micro-batches (accumulated) equal gradients of one full batch
    pb = actor.prepare(batch)
    grads = []
    for mbt in (48, 10_000):
        actor.model.zero_grad(set_to_none=True)
        actor.cfg.micro_batch_tokens = mbt
        total = 0.0
        n_tok = int(pb.mask.sum())
        for micro in micro_batches(pb.lengths, list(range(4)), mbt):
            loss_sum, _ = actor._micro_loss(pb, micro)
            (loss_sum / n_tok).backward()
            total += float(loss_sum.detach()) / n_tok
        assert total == pytest.approx(expect_loss, rel=1e-3, abs=1e-4)
        grads.append(actor.model.model.layers[3].mlp.up_proj.weight.grad.clone())
    assert len(micro_batches(pb.lengths, list(range(4)), 48)) > 1
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-3)
    actor.model.zero_grad(set_to_none=True)

    before = actor.model.model.layers[3].mlp.up_proj.weight.detach().clone()
    stats = actor.update(batch, step=0)
    assert stats["actor/update_skipped"] == 0.0
    assert stats["actor/loss"] == pytest.approx(expect_loss, rel=1e-3, abs=1e-4)
    assert stats["actor/clip_frac"] == pytest.approx(n_clipped / len(per_tok), abs=1e-6)
    # one minibatch: the start-of-update KL is the whole update's, measured against the noisy
    # behaviour logprobs before the optimiser step (the rollout/trainer gap it exists to show)
    gaps = [x - o for x, o in zip(lp, old, strict=True)]
    start_kl = sum(math.exp(d) - 1 - d for d in gaps) / len(gaps)
    assert stats["actor/start_kl"] == pytest.approx(start_kl, rel=1e-3)
    assert stats["actor/start_kl"] == pytest.approx(stats["actor/approx_kl"], rel=1e-6)
    assert stats["actor/log_ratio_max"] == pytest.approx(max(abs(d) for d in gaps), abs=1e-4)
    assert stats["actor/grad_norm"] > 0
    assert stats["adv/zero_variance_groups"] == 0
    assert not torch.equal(before, actor.model.model.layers[3].mlp.up_proj.weight)


def test_update_skipped_when_no_signal(actor_and_batch):
    actor, batch = actor_and_batch
    batch = {**batch, "rewards": torch.tensor([1.0, 1.0, 0.0, 0.0])}
    before = actor.model.model.layers[0].mlp.up_proj.weight.detach().clone()
    stats = actor.update(batch, step=5)
    assert stats["actor/update_skipped"] == 1.0
    assert stats["adv/zero_variance_groups"] == 2
    assert torch.equal(before, actor.model.model.layers[0].mlp.up_proj.weight)


def test_decoupled_loss_and_kl_to_reference(model_path, tokenizer):
    cfg = ActorConfig(
        ppo_n_minibatches=2,
        use_decoupled_loss=True,
        behav_imp_weight_cap=1.5,
        kl_coef=0.05,
        micro_batch_tokens=4096,
    )
    actor = PPOActor(model_path, cfg, ModelConfig(gradient_checkpointing=True), temperature=1.0)
    batch = _batch(tokenizer, None)
    mask = batch["loss_mask"].bool()
    prox = _ref_logprobs(actor.model, batch, 1.0)
    g = torch.Generator().manual_seed(2)
    behav = torch.where(mask, prox - torch.rand(prox.shape, generator=g) * 2, 0.0)
    batch["logprobs"] = behav
    pb = actor.prepare(batch)
    # proximal logprobs are recomputed (not the behaviour ones), the reference matches at start
    assert torch.allclose(pb.old_logp, prox, atol=2e-4)
    assert torch.allclose(pb.ref_logp, prox, atol=2e-4)
    w = torch.exp(prox - behav)[mask]
    assert (w > 1.5).any()
    loss_sum, diag = actor._micro_loss(pb, [0, 1, 2, 3])
    assert diag["behav_imp_weight"] <= 1.5 * diag["n"] + 1e-4
    # reference at ratio 1 (policy == proximal == reference): loss = -A * min(w, cap), KL 0
    a = 0.5 / math.sqrt(0.5)
    row_adv = [a, -a, a, -a]
    expect = 0.0
    for i in range(4):
        for t in range(mask.shape[1]):
            if mask[i, t] and t > 0:
                expect += -row_adv[i] * min(math.exp(float(prox[i, t] - behav[i, t])), 1.5)
    assert float(loss_sum) == pytest.approx(expect, rel=1e-3, abs=1e-3)
    assert diag["ref_kl"] == pytest.approx(0.0, abs=1e-4)
    stats = actor.update(batch, step=0)
    assert stats["actor/optimizer_steps"] == 2.0
    assert "actor/ref_kl" in stats and "actor/behav_imp_weight" in stats
    # after the update the policy moved away from the frozen reference: the KL term is positive
    pb2 = actor.prepare(batch)
    _, diag2 = actor._micro_loss(pb2, [0, 1, 2, 3])
    assert diag2["ref_kl"] > 0


def test_reference_in_bf16_is_half_the_bytes_and_close_to_fp32(model_path, tokenizer):
    """actor.ref_dtype=bfloat16 keeps the frozen reference in bf16 beside fp32 trained weights;
    its logprobs stay within bf16's rounding of the fp32 reference's, and the KL term trains."""
    cfg = ActorConfig(kl_coef=0.05, ref_dtype="bfloat16", micro_batch_tokens=4096)
    actor = PPOActor(model_path, cfg, ModelConfig(gradient_checkpointing=False), temperature=1.0)
    assert {p.dtype for p in actor.ref_model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in actor.model.parameters()} == {torch.float32}
    assert not any(p.requires_grad for p in actor.ref_model.parameters())
    # the reference scores packed trees with the tree kernels, not a dense [N, N] mask
    assert actor.ref_model.config._attn_implementation == TREE_ATTN
    batch = _batch(tokenizer, None)
    mask = batch["loss_mask"].bool()
    fp32 = _ref_logprobs(actor.model, batch, 1.0)
    batch["logprobs"] = torch.where(mask, fp32, 0.0)
    pb = actor.prepare(batch)
    gap = (pb.ref_logp - fp32)[mask].abs()
    assert 0 < float(gap.mean()) < 0.1 and float(gap.max()) < 1.0
    stats = actor.update(batch, step=0)
    assert stats["actor/ref_kl"] > 0  # the bf16 rounding is seen as a (small) distance
    assert stats["actor/optimizer_steps"] >= 1
    assert stats["actor/has_signal"] == 1.0

    # a batch without signal (every reward equal): the KL term alone still trains on it, unless
    # the trainer requires a signal (it may redraw the batch): then nothing is recomputed either
    flat = {**batch, "rewards": torch.zeros(4)}
    scored: list[object] = []
    real = actor.compute_logprobs

    def counting(b, model=None):
        scored.append(model)
        return real(b, model)

    actor.compute_logprobs = counting  # type: ignore[method-assign]
    skipped = actor.update(flat, step=1, require_signal=True)
    assert skipped["actor/update_skipped"] == 1.0 and skipped["actor/has_signal"] == 0.0
    assert scored == []  # no reference forward for a batch that is not trained on
    kl_only = actor.update(flat, step=1)
    assert kl_only["actor/update_skipped"] == 0.0 and kl_only["actor/ref_kl"] > 0
    assert actor.ref_model in scored


def test_failed_explorations_are_not_pushed_down(actor_and_batch):
    """A row whose tool was picked by choice_exploration keeps a positive advantage and loses a
    negative one (actor.punish_failed_exploration keeps it)."""
    actor, batch = actor_and_batch
    mask = batch["loss_mask"].bool()
    batch = {**batch, "explored": torch.tensor([False, True, True, False])}
    a = 0.5 / math.sqrt(0.5)  # groups [1, 0] and [1, 0]
    pb = actor.prepare(batch)
    assert (pb.adv[1][mask[1]] == 0).all()  # failed after exploring: no push
    assert torch.allclose(pb.adv[2][mask[2]], torch.tensor(a), atol=1e-4)  # paid: trained on
    assert torch.allclose(pb.adv[3][mask[3]], torch.tensor(-a), atol=1e-4)  # own failure: kept
    assert pb.stats["adv/explored_failures_dropped"] == 1.0
    actor.cfg.punish_failed_exploration = True
    try:
        pb = actor.prepare(batch)
    finally:
        actor.cfg.punish_failed_exploration = False
    assert torch.allclose(pb.adv[1][mask[1]], torch.tensor(-a), atol=1e-4)
    assert pb.stats["adv/explored_failures_dropped"] == 0.0


def test_negatives_weighted_by_prob_spare_rare_failures():
    """The failure of a rare pick, pushed down with the full advantage, hands its probability
    mostly to the favourite; weighted by the pick's probability the favourite barely moves,
    while a failed favourite is still pushed down fully and positives are untouched."""
    logits0 = torch.log(torch.tensor([0.7, 0.1, 0.1, 0.1]))

    def favourite_after_failure(token: int, weighted: bool) -> float:
        logits = logits0.clone().requires_grad_(True)
        logp = torch.log_softmax(logits, -1)[token]
        adv = torch.tensor([[-1.0]])
        if weighted:
            adv = weight_negatives_by_prob(adv, logp.detach().view(1, 1))
        (-(adv[0, 0] * logp)).backward()
        with torch.no_grad():
            return float(torch.softmax(logits - 1.0 * logits.grad, -1)[0])

    plain, weighted = favourite_after_failure(1, False), favourite_after_failure(1, True)
    assert plain - 0.7 > 5 * (weighted - 0.7) > 0  # the rare failure's push is ~10x smaller
    assert favourite_after_failure(0, True) < 0.7 - 0.05  # a failed favourite still goes down

    adv = torch.tensor([[-2.0, -2.0, 1.0], [0.5, 0.5, 0.0]])
    logp = torch.log(torch.tensor([[0.25, 1.0, 0.1], [0.1, 0.9, 0.5]]))
    out = weight_negatives_by_prob(adv, logp)
    assert torch.allclose(out, torch.tensor([[-0.5, -2.0, 1.0], [0.5, 0.5, 0.0]]))


def test_actor_weights_negatives_when_asked(actor_and_batch):
    actor, batch = actor_and_batch
    mask = batch["loss_mask"].bool()
    g = torch.Generator().manual_seed(2)
    logp = torch.where(mask, torch.log(torch.rand(mask.shape, generator=g) * 0.9 + 0.05), 0.0)
    batch = {**batch, "logprobs": logp}
    plain = actor.prepare(batch).adv
    actor.cfg.weight_negatives_by_prob = True
    try:
        weighted = actor.prepare(batch).adv
    finally:
        actor.cfg.weight_negatives_by_prob = False
    prob = batch["logprobs"].float().exp()
    expect = torch.where(plain < 0, plain * prob, plain)
    assert torch.allclose(weighted[mask], expect[mask], atol=1e-6)
    assert (weighted[mask] != plain[mask]).any()  # the fixture has failed rows


def test_warmup_lr_rises_linearly_then_holds():
    assert [warmup_lr(1e-4, k, 4) for k in range(6)] == pytest.approx(
        [2.5e-5, 5e-5, 7.5e-5, 1e-4, 1e-4, 1e-4]
    )
    assert warmup_lr(1e-4, 0, 0) == 1e-4  # 0 = no warmup


def test_actor_warms_up_the_learning_rate_and_resumes_it(model_path, tokenizer):
    """Optimiser steps 1-2 of a 4-step warmup run at lr/4 and lr/2; a new actor given the
    first one's optimiser state (a resume) goes on at 3/4 rather than starting over."""
    cfg = ActorConfig(ppo_n_minibatches=2, micro_batch_tokens=48, lr=1e-5, lr_warmup_steps=4)
    model_cfg = ModelConfig(gradient_checkpointing=False)
    actor = PPOActor(model_path, cfg, model_cfg, temperature=0.7, seed=3)
    batch = _batch(tokenizer, None)
    stats = actor.update(batch, step=0)
    assert stats["actor/optimizer_steps"] == 2.0
    assert stats["actor/lr"] == pytest.approx(5e-6)  # the second step's: lr * 2/4
    assert optimizer_steps_taken(actor.optimizer) == 2

    resumed = PPOActor(model_path, cfg, model_cfg, temperature=0.7, seed=3)
    resumed.model.load_state_dict(actor.model.state_dict())
    resumed.optimizer.load_state_dict(actor.optimizer.state_dict())
    stats = resumed.update(batch, step=1)
    assert stats["actor/lr"] == pytest.approx(1e-5)  # steps 3 and 4: 3/4, then the full lr
    assert optimizer_steps_taken(resumed.optimizer) == 4

    # without warmup the optimiser's own lr stands (a swapped-in optimiser, a user's scheduler)
    cfg.lr_warmup_steps = 0
    for group in resumed.optimizer.param_groups:
        group["lr"] = 3e-3
    assert resumed.update(batch, step=2)["actor/lr"] == pytest.approx(3e-3)

    with pytest.raises(ConfigError, match="lr_warmup_steps"):
        ActorConfig(lr_warmup_steps=-1).validate()


def test_high_entropy_mask_keeps_the_top_share():
    ent = torch.tensor([0.1, 2.0, 0.0, 1.5, 0.3, 0.9, 0.05, 1.1])
    assert high_entropy_mask(ent, 0.25).tolist() == [0, 1, 0, 1, 0, 0, 0, 0]
    assert high_entropy_mask(ent, 0.5).tolist() == [0, 1, 0, 1, 0, 1, 0, 1]
    assert high_entropy_mask(ent, 1.0).all()
    assert high_entropy_mask(ent, 0.01).sum() == 1  # at least one token
    tied = torch.tensor([1.0, 1.0, 1.0, 0.0])
    assert high_entropy_mask(tied, 0.25).tolist() == [1, 1, 1, 0]  # ties at the threshold stay
    assert high_entropy_mask(torch.zeros(0), 0.2).numel() == 0
    with pytest.raises(ConfigError, match="high_entropy_token_share"):
        ActorConfig(high_entropy_token_share=0.0).validate()


def test_high_entropy_token_share_trains_only_the_forks(actor_and_batch):
    """The gradient with share 0.25 is the full gradient of a batch whose other tokens have
    advantage 0: the low-entropy tokens get no policy gradient, and nothing else changes."""
    actor, batch = actor_and_batch
    mask = batch["loss_mask"].bool()
    behav = actor.compute_logprobs(batch)
    batch = {**batch, "logprobs": behav}
    rows = [0, 1, 2, 3]
    width = max(int(batch["attention_mask"][r].sum()) for r in rows)

    def grads(pb, share):
        actor.cfg.high_entropy_token_share = share
        try:
            actor.model.zero_grad(set_to_none=True)
            loss, diag = actor._micro_loss(pb, rows)
            loss.backward()
        finally:
            actor.cfg.high_entropy_token_share = 1.0
        g = [p.grad.clone() for p in actor.model.parameters() if p.grad is not None]
        actor.model.zero_grad(set_to_none=True)
        return g, diag

    pb = actor.prepare(batch)
    got, diag = grads(pb, 0.25)
    n = int(mask.sum())
    assert diag["pg_tokens"] == math.ceil(0.25 * n)
    with torch.no_grad():
        _, ent = token_logprobs(
            actor.model,
            batch["input_ids"][:, :width],
            batch["attention_mask"][:, :width],
            mask[:, :width],
            0.7,
            with_entropy=True,
        )
    assert ent is not None
    keep = high_entropy_mask(ent, 0.25)
    adv = pb.adv.clone()
    flat = adv[:, :width][mask[:, :width]]
    flat[~keep] = 0.0
    adv[:, :width][mask[:, :width]] = flat
    assert (flat != 0).sum() < (pb.adv[mask] != 0).sum()  # some trained token was dropped
    pb.adv = adv
    want, _ = grads(pb, 1.0)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


def test_update_reports_the_trained_token_share(actor_and_batch):
    actor, batch = actor_and_batch
    batch = {**batch, "logprobs": actor.compute_logprobs(batch)}
    state = {k: v.detach().clone() for k, v in actor.model.state_dict().items()}
    opt_state = actor.optimizer.state_dict()
    actor.cfg.high_entropy_token_share = 0.5
    try:
        stats = actor.update(batch, step=1)
    finally:
        actor.cfg.high_entropy_token_share = 1.0
        actor.model.load_state_dict(state)
        actor.optimizer.load_state_dict(opt_state)
    # per micro-batch top half (micro_batch_tokens=48 splits the rows): about half overall
    assert 0.5 <= stats["actor/pg_token_share"] <= 0.75


def test_adam_eps_reaches_the_optimiser_and_each_policy(model_path):
    from areal_env.api.config import PolicyConfig

    actor = PPOActor(
        model_path,
        ActorConfig(adam_eps=1e-4),
        ModelConfig(gradient_checkpointing=False),
        temperature=0.7,
    )
    assert {g["eps"] for g in actor.optimizer.param_groups} == {1e-4}
    assert PolicyConfig(adam_eps=1e-3).optimiser_overrides() == {"adam_eps": 1e-3}
    assert PolicyConfig().optimiser_overrides() == {}
    with pytest.raises(ConfigError, match="adam_eps"):
        ActorConfig(adam_eps=0.0).validate()


def test_guided_tokens_that_paid_are_imitated(actor_and_batch):
    """With actor.guided_nll_coef, a guide-written token with a positive advantage is trained by
    its negative log-likelihood (no clip), not the PPO surrogate; a guided token whose episode
    did not pay, and the model's own tokens, keep the surrogate."""
    actor, batch = actor_and_batch
    mask = batch["loss_mask"].bool()
    ref_lp = _ref_logprobs(actor.model, batch, 0.7)
    guided = torch.zeros_like(mask)
    guided[0] = mask[0]  # paid (reward 1): imitated
    guided[1] = mask[1]  # did not pay: not imitated
    guided[2, :] = mask[2] & (torch.arange(mask.shape[1]) % 2 == 0)  # part of a paid row
    batch = {**batch, "logprobs": ref_lp, "guided": guided}
    assert actor.prepare(batch).imitate is None  # off by default
    actor.cfg.guided_nll_coef = 0.5
    try:
        pb = actor.prepare(batch)
        assert torch.equal(pb.imitate, guided & mask & torch.tensor([1, 0, 1, 0]).bool()[:, None])
        assert pb.stats["actor/imitated_tokens"] == float(pb.imitate.sum())
        with torch.no_grad():
            loss_sum, _ = actor._micro_loss(pb, [0])
        # the ratio is 1 (behaviour = current logprobs): the surrogate would be -adv per token
        expect = -0.5 * float(ref_lp[0][mask[0]].sum())
        assert float(loss_sum) == pytest.approx(expect, rel=1e-3)
        with torch.no_grad():
            loss_sum, _ = actor._micro_loss(pb, [2])
        own = mask[2] & ~guided[2]
        adv2 = float(pb.adv[2][mask[2]][0])
        expect = -0.5 * float(ref_lp[2][guided[2]].sum()) - adv2 * int(own.sum())
        assert float(loss_sum) == pytest.approx(expect, rel=1e-3)
        stats = actor.update(batch, step=5)
        assert stats["actor/update_skipped"] == 0.0 and stats["actor/imitated_tokens"] > 0
    finally:
        actor.cfg.guided_nll_coef = 0.0
    with pytest.raises(ConfigError, match="guided_nll_coef"):
        ActorConfig(guided_nll_coef=-1).validate()
