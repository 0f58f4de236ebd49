"""``actor.frozen_layers``: the lowest decoder layers are not trained, and the update neither
recomputes nor back-propagates through them.

On a tiny Llama (4 layers, tied embeddings) with activation checkpointing: the frozen layers'
weights stay bitwise, the others and the tied head move, the optimiser holds only what trains,
the trained layers get the same gradients as in a full fine-tune, and a frozen layer runs once
per micro-batch where a checkpointed trained layer runs twice (forward and recompute).
"""

from __future__ import annotations

import pytest
import torch

from areal_env.api.config import ActorConfig, ConfigError, LoraConfig, ModelConfig
from areal_env.trainer.actor import PPOActor
from areal_env.trainer.dist import decoder_layers
from tests.unit.test_trainer_precision import one_rank_group  # noqa: F401 (a fixture)
from tests.unit.test_trainer_tree import _agent_batch


def _actor(path: str, frozen: int, **actor_kw) -> PPOActor:
    actor_kw.setdefault("ppo_n_minibatches", 1)
    cfg = ActorConfig(lr=1e-4, frozen_layers=frozen, **actor_kw)
    return PPOActor(path, cfg, ModelConfig(device="cpu", gradient_checkpointing=True), seed=3)


def _layer_of(name: str) -> int | None:
    if ".layers." not in name:
        return None
    return int(name.split(".layers.")[1].split(".")[0])


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach()


@pytest.mark.parametrize("strategy", ["single", "fsdp"])
def test_frozen_layers_keep_their_weights_and_the_rest_trains(
    tiny_model_path, tokenizer, strategy, request
):
    if strategy == "fsdp":
        request.getfixturevalue("one_rank_group")
    actor = _actor(tiny_model_path, 2, strategy=strategy)
    before = {k: _local(v).clone() for k, v in actor.model.named_parameters()}
    trainable = [p for p in actor.model.parameters() if p.requires_grad]
    assert sum(len(g["params"]) for g in actor.optimizer.param_groups) == len(trainable)
    stats = actor.update(_agent_batch(tokenizer), step=1)
    assert stats["actor/optimizer_steps"] == 1.0
    after = dict(actor.model.named_parameters())
    moved = {k for k, v in before.items() if not torch.equal(v, _local(after[k]))}
    assert {_layer_of(k) for k in moved if _layer_of(k) is not None} == {2, 3}
    # tied embeddings: the shared matrix trains as the output head
    assert "model.embed_tokens.weight" in moved
    frozen = [k for k in before if _layer_of(k) in (0, 1)]
    assert frozen and not moved & set(frozen)


def test_trained_layers_get_the_full_fine_tunes_gradients(tiny_model_path, tokenizer):
    """Freezing removes work below layer N, not signal above it."""
    batch = _agent_batch(tokenizer)
    ids = batch["input_ids"][:2, :48]

    def grads(frozen: int) -> dict[str, torch.Tensor]:
        actor = _actor(tiny_model_path, frozen)
        actor.model.zero_grad()
        out = actor.model(input_ids=ids)
        out.logits.float().logsumexp(-1).mean().backward()
        return {
            k: p.grad.clone()
            for k, p in actor.model.named_parameters()
            if (_layer_of(k) or -1) >= 2 and p.grad is not None
        }

    full, frozen = grads(0), grads(2)
    assert full.keys() == frozen.keys() and len(full) > 0
    for k in full:
        torch.testing.assert_close(frozen[k], full[k], rtol=1e-4, atol=1e-6, msg=k)


def test_a_frozen_layer_runs_once_per_micro_batch(tiny_model_path, tokenizer):
    """The point of freezing: no recompute and no backward below layer N. With checkpointing a
    trained layer runs its forward twice per micro-batch (forward, then the recompute in the
    backward pass); a frozen one once."""
    actor = _actor(tiny_model_path, 2, tree_training="off")
    calls = [0] * 4
    for i, layer in enumerate(decoder_layers(actor.model)):
        # counted in forward itself: module hooks do not fire in a checkpoint's recompute
        def counted(*args, _forward=layer.mlp.forward, _i=i, **kwargs):
            calls[_i] += 1
            return _forward(*args, **kwargs)

        layer.mlp.forward = counted
    actor.update(_agent_batch(tokenizer), step=1)
    assert calls[0] >= 1 and calls[0] == calls[1] and calls[2] == calls[3]
    assert calls[2] == 2 * calls[0], calls


def test_lora_adapters_below_the_line_stay_put(tiny_model_path):
    actor = _actor(tiny_model_path, 3, lora=LoraConfig(r=4, alpha=8))
    trained = {k for k, p in actor.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in k for k in trained)
    assert {_layer_of(k) for k in trained} == {3}


@pytest.mark.parametrize("bad", [-1, True, 1.5])
def test_frozen_layers_must_be_a_count(bad):
    with pytest.raises(ConfigError, match="frozen_layers"):
        ActorConfig(frozen_layers=bad).validate()


def test_freezing_every_layer_says_how_many_there_are(tiny_model_path):
    with pytest.raises(ConfigError, match="at most 3"):
        _actor(tiny_model_path, 4)


def test_a_checkpoint_of_a_frozen_run_resumes(tiny_model_path, tokenizer, tmp_path):
    """The optimiser holds state for the trained parameters only; a checkpoint restores it
    into a fresh actor of the same config, and the two then take the same next step."""
    from areal_env.trainer import checkpoint as ckpt

    batch = _agent_batch(tokenizer)
    actor = _actor(tiny_model_path, 2)
    actor.update(batch, step=1)
    ckpt.save_checkpoint(
        tmp_path, 1, model=actor.model, optimizer=actor.optimizer, trainer_state={"version": 1}
    )
    fresh = _actor(tiny_model_path, 2)
    ckpt.restore_checkpoint(tmp_path / "step_1", model=fresh.model, optimizer=fresh.optimizer)
    trained = dict(actor.model.named_parameters())
    for name, p in fresh.model.named_parameters():
        torch.testing.assert_close(p, trained[name], rtol=0, atol=0, msg=name)
    assert len(fresh.optimizer.state) == len(actor.optimizer.state) > 0
    actor.update(batch, step=2)
    fresh.update(batch, step=2)
    for name, p in fresh.model.named_parameters():
        torch.testing.assert_close(p, trained[name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_model_shared_by_adapter_policies_is_refused(tiny_model_path):
    """peft's set_adapter re-enables every layer's active adapter, so the freeze could not
    hold in a model that several policies share."""
    lora = LoraConfig(r=4, alpha=8)
    cfg = ActorConfig(frozen_layers=1, lora=lora)
    with pytest.raises(ConfigError, match="2 adapter policies share"):
        PPOActor(
            tiny_model_path,
            cfg,
            ModelConfig(device="cpu"),
            adapter="a",
            adapters={"a": lora, "b": lora},
        )
