"""Mixed precision: fp32 master weights and optimizer states, compute in ``model.dtype``.

Why: AdamW on bf16 weights rounds every update smaller than half a ulp of its weight back to
the weight itself. A bf16 ulp is 2^-7 of the weight's leading power of two (1.2e-4 at 0.02:
updates below 6e-5 vanish), so an RL-sized update (lr 1e-7 to 1e-5) leaves almost every weight where it was:
measured on one H200 with Qwen2.5-1.5B, 0.65 % of the parameters changed in an lr 1e-6 update
(99.6 % with fp32 master weights). So the trained weights and AdamW's moments stay fp32 and
only the arithmetic runs in bf16/fp16:

- ``strategy: single``: ``torch.autocast`` around every forward (the backward follows it);
  gradients land in fp32 on the fp32 parameters;
- ``strategy: fsdp`` (one rank included): FSDP2's ``MixedPrecisionPolicy`` gathers each layer's
  parameters in the compute dtype and reduces gradients in fp32;
- fp16 adds dynamic loss scaling (``torch.amp.GradScaler``): its gradients underflow otherwise;
- frozen weights (the KL reference model, the base under LoRA adapters with ``strategy:
  single``) need no master copy and load in the compute dtype;
- the inference engine serves in ``engine.dtype`` (the compute dtype unless set): pushed
  weights are cast to it, half the bytes of fp32 in bf16. On CPU the two differ usefully: bf16
  autocast speeds the update up, while fp32 generation is faster there and keeps the model's
  greedy answers (docs/training.md, "Precision").

``actor.lossy_low_precision_weights`` keeps the old behaviour (weights and moments in the
compute dtype, 8 instead of 16 bytes per parameter) for those who accept the rounding; it logs
what it costs.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch
from torch.profiler import record_function

logger = logging.getLogger(__name__)


class Precision:
    """The dtypes of one actor and the parts of its step that depend on them."""

    def __init__(
        self,
        compute: torch.dtype,
        device: torch.device,
        *,
        strategy: str,
        lossy: bool = False,
        engine: torch.dtype | None = None,
    ) -> None:
        self.compute = compute
        self.engine = engine or compute
        """The dtype the inference engine serves in: what pushed and exported weights are cast
        to."""
        self.device_type = device.type
        low = compute != torch.float32
        self.lossy = low and lossy
        self.master = compute if self.lossy else torch.float32
        self.autocast = low and not self.lossy and strategy == "single"
        # FSDP2: gather parameters in the compute dtype, reduce gradients in fp32
        self.fsdp_param_dtype = compute if low and not self.lossy else None
        self.scaler = (
            torch.amp.GradScaler(device.type)
            if compute == torch.float16 and not self.lossy
            else None
        )
        name = str(compute).removeprefix("torch.")
        if self.lossy:
            logger.warning(
                "actor.lossy_low_precision_weights: the trained weights and AdamW states are "
                "%s, not fp32. Every update smaller than half a %s ulp of its weight (0.2-0.4 "
                "%% of the weight in bf16) is rounded away: at lr 1e-6 nearly no weight moves "
                "(measured: 0.3 %% of the parameters changed, 99.8 %% with fp32 master "
                "weights). It saves 8 of 16 bytes per parameter; unset it to learn at RL "
                "learning rates",
                name,
                name,
            )
        elif low:
            logger.info(
                "mixed precision: fp32 master weights and optimizer states, %s compute (%s)%s",
                name,
                "autocast" if self.autocast else "FSDP2 MixedPrecisionPolicy",
                ", dynamic loss scaling" if self.scaler is not None else "",
            )

    def load_dtype(self, *, frozen: bool) -> torch.dtype:
        """The dtype to load a model in: frozen weights need no fp32 master copy."""
        return self.compute if frozen else self.master

    def context(self) -> contextlib.AbstractContextManager[None]:
        """Wrap every forward pass in this (autocast for ``strategy: single``). The autocast
        cache is off: with activation checkpointing it would hold a low-precision copy of every
        weight until the forward ends, and each weight is used once per forward anyway."""
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute, cache_enabled=False)

    def backward(self, loss: torch.Tensor) -> None:
        with record_function("actor/backward"):
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Before clipping: the gradients in their true scale (fp16 loss scaling)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        with record_function("actor/optimizer_step"):
            if self.scaler is None:
                optimizer.step()
                return
            self.scaler.step(optimizer)
            self.scaler.update()

    def skip_step(self) -> bool:
        """A step skipped for a non-finite gradient: lowers the fp16 loss scale. True when that
        is the expected fp16 overflow (not worth a warning)."""
        if self.scaler is None:
            return False
        # the new scale from the global verdict (the clipped norm is all-reduced), not from this
        # rank's own inf check: every FSDP rank lowers it alike
        self.scaler.update(self.scaler.get_scale() * self.scaler.get_backoff_factor())
        logger.info("fp16 gradient overflow: loss scale lowered to %g", self.scaler.get_scale())
        return True

    def for_engine(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``weights`` with floating tensors cast to the engine's dtype (in place, one tensor at
        a time, so a 7B model's fp32 copy and its cast copy are never both held whole)."""
        for name in list(weights):
            t = weights[name]
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != self.engine:
                weights[name] = t.to(self.engine)
        return weights

    def mark_folder(self, folder: Path) -> None:
        """Record the engine's dtype in an HF folder's ``config.json`` (``save_pretrained``
        writes the dtype of the live master parameters): servers loading it with ``dtype:
        auto`` serve in it, like the weights written in it."""
        path = Path(folder) / "config.json"
        if self.engine == self.master or not path.is_file():
            return
        config = json.loads(path.read_text())
        name = str(self.engine).removeprefix("torch.")
        config["dtype"] = name
        if "torch_dtype" in config:
            config["torch_dtype"] = name
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
