"""``LocalEngine``'s weight updates: state dicts, HF model folders and LoRA adapters, swapped in
between two decode steps (the decode loop is held at a step boundary while they load)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from areal_env.engine._prefix import PrefixCache
from areal_env.engine.lora import (
    apply_adapter,
    is_adapter_folder,
    load_adapter_folder,
    split_adapter,
)

logger = logging.getLogger(__name__)


class _WeightUpdates:
    """Mixin of ``LocalEngine``: the weight-update half of the engine's public API."""

    # State owned by LocalEngine (set in its __init__/initialize).
    model: Any
    prefix_cache_mb: float
    _prefix: PrefixCache
    _cv: threading.Condition
    _holders: int
    _in_step: bool
    _version: int
    _stats: dict[str, int]
    _lora_base: dict[str, Any]

    if TYPE_CHECKING:  # LocalEngine's methods

        def _require_alive(self) -> None: ...

        def _prefix_budget_tokens(self, cfg: Any, dtype: torch.dtype) -> int: ...

    @contextlib.contextmanager
    def _at_step_boundary(self) -> Iterator[None]:
        """Hold the decode loop between two steps while the block runs (waits for the running
        step to finish; generation continues afterwards)."""
        self._require_alive()
        with self._cv:
            self._holders += 1
            while self._in_step:
                self._cv.wait()
        try:
            yield
        finally:
            with self._cv:
                self._holders -= 1
                self._cv.notify_all()

    def update_weights(self, weights: dict[str, torch.Tensor] | str) -> None:
        """Swap in new weights between two decode steps, then bump the version.

        ``weights`` is a state dict (same parameter names as the loaded model) or the path of an
        HF model folder. Blocks until the swap is done; safe to call from any thread. In-flight
        requests continue with the new weights.
        """
        with self._at_step_boundary():
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
            self._prefix.clear()  # cached KV belongs to the old weights
            with self._cv:
                self._version += 1
                self._stats["weight_updates"] += 1
            logger.info(
                "weights updated to version %d in %.2fs", self._version, time.perf_counter() - t0
            )

    def set_prefix_cache_mb(self, mb: float) -> None:
        """Resize (and empty) the prefix cache at a step boundary; 0 turns it off."""
        if mb < 0:
            raise ValueError(f"prefix_cache_mb must be >= 0 (0 = off), got {mb!r}")
        with self._at_step_boundary():
            self.prefix_cache_mb = mb
            self._prefix = PrefixCache(
                self._prefix_budget_tokens(self.model.config, self.model.dtype)
            )

    def _apply_adapter(self, path: str) -> None:
        """Merge a LoRA adapter into the weights: ``W = W_base + (alpha / r) * B @ A``, always
        from the base weights (a new adapter replaces the previous one, never stacks on it)."""
        tensors, cfg = load_adapter_folder(path)
        params = dict(self.model.named_parameters())
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
        from transformers import AutoModelForCausalLM

        if not os.path.isdir(path):
            raise ValueError(f"update_weights: {path!r} is not a model folder")
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=self.model.dtype)
        return loaded.state_dict()

    def _load_state(self, state: dict[str, torch.Tensor]) -> None:
        # Tied weights (lm_head = embed_tokens) may be absent from a state dict: not an error.
        tied = set(getattr(self.model, "_tied_weights_keys", None) or {})
        with torch.no_grad():
            result = self.model.load_state_dict(state, strict=False)
        missing = [k for k in result.missing_keys if k not in tied]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"update_weights: state dict does not match the model "
                f"(missing {missing[:5]}, unexpected {list(result.unexpected_keys)[:5]})"
            )
