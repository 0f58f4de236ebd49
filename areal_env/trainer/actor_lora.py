"""Model wrapping helpers of the actor: LoRA adapters (and their merged export), activation
checkpointing, and gradient sync under FSDP.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from areal_env.api.config import ConfigError, LoraConfig
from areal_env.trainer.dist import DistContext, decoder_layers, full_state_dict

logger = logging.getLogger(__name__)


def enable_checkpointing(model: Any, share: float = 1.0) -> int:
    """Activation (gradient) checkpointing, non-reentrant, across transformers versions, for
    ``share`` of the decoder layers spread evenly (the rest keep their activations: faster
    backward, more memory). Returns how many layers are checkpointed."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    from transformers import PreTrainedModel

    layers = [
        m
        for m in model.modules()
        if getattr(m, "gradient_checkpointing", None) is True and not isinstance(m, PreTrainedModel)
    ]
    kept = 0
    for i, layer in enumerate(layers):
        # layer i is checkpointed when the running count floor((i + 1) * share) steps up
        on = int((i + 1) * share + 1e-9) > int(i * share + 1e-9)
        layer.gradient_checkpointing = on
        kept += on
    return kept


def _detached(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor:
    return output.detach()


def freeze_lowest_layers(model: Any, n: int) -> None:
    """Stop gradients below decoder layer ``n``: the lowest ``n`` layers' parameters (LoRA
    adapters included) stop requiring grad and are no longer checkpointed, and the input
    embeddings' output is detached. Why the detach: with tied embeddings the lookup shares the
    output head's trainable matrix, and a lookup that required grad would carry the backward
    (and the checkpoints' recompute) through every frozen layer. Only the head trains that
    matrix then; an untied input embedding is frozen outright (no optimiser state)."""
    if n <= 0:
        return
    try:
        layers = decoder_layers(model)
    except ValueError as e:
        raise ConfigError(f"actor.frozen_layers={n}: {e}; set it to 0 for this model") from e
    if n >= len(layers):
        raise ConfigError(
            f"actor.frozen_layers={n} leaves no layer to train: the model has {len(layers)} "
            f"decoder layers; set it to at most {len(layers) - 1}"
        )
    for layer in layers[:n]:
        layer.requires_grad_(False)
        if getattr(layer, "gradient_checkpointing", None) is True:
            # nothing to recompute without a backward pass
            layer.gradient_checkpointing = False  # type: ignore[assignment]
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    embeddings = base.get_input_embeddings()
    head = base.get_output_embeddings()
    if head is None or head.weight is not embeddings.weight:
        embeddings.requires_grad_(False)
    embeddings.register_forward_hook(_detached)
    logger.info("training decoder layers %d-%d of %d", n, len(layers) - 1, len(layers))


def set_gradient_sync(model: Any, sync: bool) -> None:
    """Under FSDP reduce gradients only after the last micro-batch of a minibatch."""
    fn = getattr(model, "set_requires_gradient_sync", None)
    if fn is not None:
        fn(sync)


def apply_lora(
    model: Any, adapters: Mapping[str, LoraConfig], *, fp32_adapters: bool = True
) -> torch.nn.Module:
    """Wrap ``model`` with ``peft`` LoRA adapters, one per name (``default`` for a run with one
    policy; a name per adapter policy of a multi-agent run); only the adapters stay trainable.
    A model peft cannot adapt (no module matches the target names) raises ``ConfigError``.

    ``fp32_adapters``: the adapters are fp32 master weights even on a bf16/fp16 base, so small
    updates are not rounded away."""
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
    except ImportError as e:  # pragma: no cover - peft is a dependency
        raise RuntimeError("actor.lora needs the `peft` package: pip install peft") from e

    def peft_config(lora: LoraConfig) -> Any:
        return PeftLoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules),
            bias="none",
            task_type="CAUSAL_LM",
        )

    (first, lora), *rest = adapters.items()
    try:
        wrapped = get_peft_model(
            model, peft_config(lora), adapter_name=first, autocast_adapter_dtype=fp32_adapters
        )
        for name, more in rest:
            wrapped.add_adapter(name, peft_config(more))
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        raise ConfigError(
            f"LoRA adapters cannot be put on {type(model).__name__}: {e}. Set the target "
            "modules to this model's linear layers (lora.target_modules), or train the policy "
            "as a model of its own"
        ) from e
    if fp32_adapters:  # peft casts only the first adapter: the later ones too
        for name, param in wrapped.named_parameters():
            if "lora_" in name and param.dtype in (torch.bfloat16, torch.float16):
                param.data = param.data.float()
    n_train = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    n_all = sum(p.numel() for p in wrapped.parameters())
    logger.info(
        "LoRA: %d of %d parameters trainable (%.2f%%)", n_train, n_all, 100 * n_train / n_all
    )
    return wrapped


def merged_lora_state_dict(
    model: Any, ctx: DistContext, adapter: str = "default"
) -> dict[str, torch.Tensor]:
    """Base weights with adapter ``adapter`` merged in (any other adapter of the model left
    out), under the base model's own names (what a server without LoRA support loads).
    Collective under FSDP; rank 0 gets the weights."""
    full = full_state_dict(model)
    if not full:
        return {}
    from areal_env.engine.lora import merge_lora_weights

    own = (f".lora_A.{adapter}.", f".lora_B.{adapter}.")
    kept = {k: v for k, v in full.items() if ".lora_" not in k or any(o in k for o in own)}
    return merge_lora_weights(kept, model.peft_config[adapter])
