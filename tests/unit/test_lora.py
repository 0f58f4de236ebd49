"""LoRA: adapter merging matches peft, the actor trains and pushes only the adapter, and a real
``areal-env serve`` server answers with the pushed adapter applied."""

from __future__ import annotations

import asyncio

import pytest
import torch

from areal_env.api.config import ActorConfig, LoraConfig, ModelConfig
from areal_env.engine.lora import is_adapter_folder, load_adapter_folder, merge_lora_weights


def _randomise_adapter(model, seed: int = 0) -> None:
    """peft starts B at 0 (a no-op adapter): give it weights that change the model's output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def test_merge_matches_peft_merge_and_unload(model_path):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    peft_model = get_peft_model(
        model, PeftLoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    _randomise_adapter(peft_model)
    ours = merge_lora_weights(peft_model.state_dict(), peft_model.peft_config["default"])
    theirs = peft_model.merge_and_unload().state_dict()
    assert set(theirs) <= set(ours) | {"lm_head.weight"}
    diff = max(float((ours[k] - theirs[k]).abs().max()) for k in theirs if k in ours)
    assert diff < 1e-6
    q = "model.layers.0.self_attn.q_proj.weight"
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).state_dict()
    assert float((ours[q] - base[q]).abs().max()) > 1e-3  # the adapter did change the weight


@pytest.mark.slow
def test_lora_actor_trains_adapter_only_and_serve_applies_it(tmp_path, model_path):
    from transformers import AutoModelForCausalLM

    from areal_env.api.io import GenerationConfig, ModelRequest
    from areal_env.engine.sglang import SGLangEngine
    from areal_env.trainer.actor import PPOActor
    from tests.distributed.step_worker import fixed_batch
    from tests.fixtures.sglang import launch_serve

    actor = PPOActor(
        model_path,
        ActorConfig(lora=LoraConfig(r=8, alpha=16), ppo_n_minibatches=1, lr=1e-3),
        ModelConfig(device="cpu"),
    )
    trainable = {n for n, p in actor.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    frozen_before = actor.model.get_base_model().model.layers[0].mlp.up_proj.weight.clone()
    stats = actor.update(fixed_batch(actor.model.config.vocab_size), step=0)
    assert stats["actor/optimizer_steps"] == 1.0
    assert torch.equal(
        actor.model.get_base_model().model.layers[0].mlp.up_proj.weight, frozen_before
    )
    _randomise_adapter(actor.model, seed=1)  # a visible adapter (one small step barely shows)
    folder = tmp_path / "adapter"
    size = actor.save_adapter(folder)
    full_size = sum(
        f.stat().st_size for f in __import__("pathlib").Path(model_path).glob("*.safetensors")
    )
    assert is_adapter_folder(folder) and size < 0.05 * full_size
    tensors, cfg = load_adapter_folder(folder)
    assert tensors and all("lora_" in k for k in tensors) and cfg["r"] == 8

    # the expected greedy answer: the base model with the adapter merged in
    merged = actor.state_dict_for_engine()
    ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    ref.load_state_dict(merged, strict=False)
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 30, 2, 198, 1, 4093, 198]
    want = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=2)[
        0, len(prompt) :
    ].tolist()
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    base_out = base.generate(
        torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=2
    )[0, len(prompt) :].tolist()
    assert want != base_out  # the adapter changes the answer

    group = launch_serve(model_path, 1, tmp_path / "logs")
    try:
        eng = SGLangEngine(group.addresses)
        eng.supports_lora = True
        eng.initialize()
        eng.update_weights(str(folder))
        req = ModelRequest(
            rid="lora-1", input_ids=prompt, gconfig=GenerationConfig(max_new_tokens=8, greedy=True)
        )
        got = asyncio.run(eng.agenerate(req)).output_tokens
        eng.destroy()
    finally:
        group.stop()
    assert got[: len(want)] == want[: len(got)] and len(got) > 0
