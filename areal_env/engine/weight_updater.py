"""``LocalEngine``'s weight updates: state dicts, HF model folders and LoRA adapters, swapped in
between two decode steps (the batch worker is held at a step boundary while they load)."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from areal_env.engine.adapters import AdapterError, AdapterSet, AdapterWeights
from areal_env.engine.batch_worker import BatchWorker
from areal_env.engine.lora import (
    apply_adapter,
    is_adapter_folder,
    load_adapter_folder,
    split_adapter,
)
from areal_env.engine.models import load_causal_lm

logger = logging.getLogger(__name__)


class WeightUpdater:
    """Loads new weights into the batch worker's model, between two of its decode steps."""

    def __init__(self, worker: BatchWorker) -> None:
        self.worker = worker
        self._lora_base: dict[str, Any] = {}
        """Base weights of the parameters a LoRA adapter changed (adapters merge onto them)."""

    def update(self, weights: dict[str, torch.Tensor] | str) -> None:
        """Swap in new weights between two decode steps, then bump the version (see
        ``LocalEngine.update_weights``)."""
        with self.worker.at_step_boundary():
            t0 = time.perf_counter()
            if isinstance(weights, (str, os.PathLike)) and is_adapter_folder(weights):
                self._apply_adapter(str(weights))
                state = None
            elif isinstance(weights, (str, os.PathLike)):
                state = self._load_folder(str(weights))
            elif isinstance(weights, dict):
                state = weights
            else:
                raise TypeError(
                    f"update_weights takes a state dict or a path, got {type(weights)!r}"
                )
            if state is not None:
                self._load_state(state)
                self._lora_base = {}  # new base weights: a later adapter merges onto these
            self.worker.new_weights_loaded()
            logger.info(
                "weights updated to version %d in %.2fs",
                self.worker.version,
                time.perf_counter() - t0,
            )

    def load_adapter(self, name: str, weights: AdapterWeights | str | os.PathLike[str]) -> None:
        """Load (or replace) the named adapter ``name``, served unmerged to the rows that ask
        for it (``ModelRequest.adapter``), between two decode steps. The weight version is not
        moved: the caller sets it (every policy on this engine shares the clock)."""
        if isinstance(weights, AdapterWeights):
            tensors, cfg = weights.tensors, weights.config
        elif isinstance(weights, (str, os.PathLike)) and is_adapter_folder(weights):
            tensors, cfg = load_adapter_folder(weights)
        else:
            raise TypeError(
                f"load_adapter takes a peft adapter folder or AdapterWeights, got {weights!r}"
            )
        with self.worker.at_step_boundary():
            t0 = time.perf_counter()
            if self.worker.adapters is None:
                self.worker.adapters = AdapterSet(self.worker.model)
            n = self.worker.adapters.load(name, tensors, cfg)
            self.worker.adapters_changed()
            logger.info(
                "LoRA adapter %r loaded on %d layers in %.2fs (%d adapters)",
                name,
                n,
                time.perf_counter() - t0,
                len(self.worker.adapters),
            )

    def unload_adapter(self, name: str) -> None:
        """Remove the named adapter between two decode steps (``AdapterError`` if unknown)."""
        with self.worker.at_step_boundary():
            if self.worker.adapters is None:
                raise AdapterError(f"no LoRA adapter named {name!r} is loaded (loaded: none)")
            self.worker.adapters.remove(name)
            self.worker.adapters_changed()

    def _apply_adapter(self, path: str) -> None:
        """Merge a LoRA adapter into the weights: ``W = W_base + (alpha / r) * B @ A``, always
        from the base weights (a new adapter replaces the previous one, never stacks on it)."""
        tensors, cfg = load_adapter_folder(path)
        params = dict(self.worker.model.named_parameters())
        base = self._lora_base
        names = {n for n in split_adapter(tensors)}
        for n in names:
            if n not in params:
                raise ValueError(f"update_weights: the adapter targets {n}, not in the model")
            if n not in base:
                base[n] = params[n].detach().clone()
        merged = apply_adapter(base, tensors, cfg)
        with torch.no_grad():
            for n, w in merged.items():
                params[n].copy_(w)
        logger.info("LoRA adapter %s merged into %d weight matrices", path, len(merged))

    def _load_folder(self, path: str) -> dict[str, torch.Tensor]:
        if not os.path.isdir(path):
            raise ValueError(f"update_weights: {path!r} is not a model folder")
        loaded = load_causal_lm(path, dtype=self.worker.model.dtype)
        return loaded.state_dict()

    def _load_state(self, state: dict[str, torch.Tensor]) -> None:
        # Tied weights (lm_head = embed_tokens) may be absent from a state dict: not an error.
        tied = set(getattr(self.worker.model, "_tied_weights_keys", None) or {})
        with torch.no_grad():
            result = self.worker.model.load_state_dict(state, strict=False)
        missing = [k for k in result.missing_keys if k not in tied]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"update_weights: state dict does not match the model "
                f"(missing {missing[:5]}, unexpected {list(result.unexpected_keys)[:5]})"
            )
