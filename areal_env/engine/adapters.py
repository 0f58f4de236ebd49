"""Several named LoRA adapters on one model, each row of a batch decoded with its own.

Why not merge: a merged adapter (``W + (alpha / r) * B @ A``) is free at decode time, but only one
can be merged at a time, and a multi-agent run samples every policy in the same steps. Rows of
different adapters share one batch instead: every targeted linear layer computes the base output
for the whole batch once, then adds each adapter's low-rank term ``(x @ A^T) @ B^T`` to its own
rows. Measured on the CPU (SmolLM2-135M, batch 16, r 16 on q/k/v/o, ``bench/policies.py``):
peft's mixed-adapter batches (``adapter_names``) ran at 0.62-0.70 of the plain model, mostly
Python bookkeeping repeated in each of the 120 adapted layers; these layers, which work out the
row groups once per forward, at 0.89-0.90. Per-adapter sub-batches (each adapter's rows decoded
as a batch of their own) lose the batch: see the bench for the figures.

The adapters are applied by forward hooks on the targeted ``nn.Linear`` modules, so parameter
names and ``state_dict`` stay those of the base model. An adapter is replaced whole (a new
version of it) or removed; rows in flight carry on with whatever is loaded under their adapter's
name at each step, as they do across full weight updates.

:class:`AdapterEngine` presents one adapter of a multi-adapter engine (the embedded
``LocalEngine`` or SGLang servers started with ``--enable-lora``) as an ``InferenceEngine`` of its
own: its requests name the adapter, its ``update_weights`` replaces only that adapter.
"""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from areal_env.api.io import ModelRequest, ModelResponse, StreamChunk
from areal_env.engine.lora import AdapterSpec, split_adapter


class AdapterError(ValueError):
    """An adapter that cannot be applied to this model (unknown module, wrong shape, a layer
    LoRA cannot adapt). A ``ValueError``: servers answer it with 400."""


@dataclass
class AdapterWeights:
    """An adapter handed over in memory: its tensors (peft names, with or without the adapter
    name) and its peft config (``r``, ``lora_alpha``, ``target_modules``, ...)."""

    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def zero_adapter(
    model: torch.nn.Module, r: int, alpha: float, targets: list[str]
) -> AdapterWeights:
    """An adapter that changes nothing (``B = 0``, as a new peft adapter starts) on every
    ``nn.Linear`` of ``model`` named by ``targets``: a policy answered by the base weights
    until its first trained adapter arrives."""
    tensors = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in targets and isinstance(module, torch.nn.Linear):
            key = f"base_model.model.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.zeros(r, module.in_features)
            tensors[f"{key}.lora_B.weight"] = torch.zeros(module.out_features, r)
    if not tensors:
        raise AdapterError(
            f"no nn.Linear layer of this model is named {', '.join(targets)}: LoRA adapters "
            "on these target modules cannot be served (set lora.target_modules to this model's "
            "linear layers, or train the policy as a model of its own)"
        )
    return AdapterWeights(tensors, {"r": r, "lora_alpha": alpha, "target_modules": targets})


class _Selection:
    """Which rows of the current forward use which adapter: ``groups`` is a list of
    ``(slot, row index tensor or None for every row)``; empty = the base model for all rows."""

    __slots__ = ("groups",)

    def __init__(self) -> None:
        self.groups: list[tuple[int, torch.Tensor | None]] = []


def _lora_hook(
    weights: dict[int, tuple[torch.Tensor, torch.Tensor]], selection: _Selection
) -> Callable[..., torch.Tensor | None]:
    """The forward hook of one adapted linear layer: add each selected adapter's low-rank term
    to its rows (``B`` is stored pre-scaled by ``alpha / r``)."""

    def hook(module: Any, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor | None:
        groups = selection.groups
        if not groups:
            return None
        x = args[0]
        for slot, rows in groups:
            ab = weights.get(slot)
            if ab is None:  # this adapter does not target this layer
                continue
            a, b = ab
            if rows is None:
                out = out + (x @ a.T) @ b.T
            else:
                out.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)
        return out

    return hook


class AdapterSet:
    """Named LoRA adapters on ``model``, selected per row of each forward.

    Slot 0 is the base model (no adapter); each loaded name keeps its slot until removed, so a
    new version of an adapter replaces its weights in place. Not thread-safe: the engine loads
    and removes adapters at a step boundary and selects rows from its worker thread only.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._modules = dict(model.named_modules())
        self._slots: dict[str, int] = {}
        self._weights: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._hooks: dict[str, Any] = {}
        self._selection = _Selection()
        self._next_slot = 1
        self.configs: dict[str, dict[str, Any]] = {}
        """Each loaded adapter's peft config (what ``/load_lora_adapter`` was given)."""

    @property
    def names(self) -> list[str]:
        return sorted(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, name: object) -> bool:
        return name in self._slots

    def slot(self, name: str) -> int:
        """The slot of adapter ``name`` (``AdapterError`` when none is loaded by that name)."""
        try:
            return self._slots[name]
        except KeyError:
            loaded = ", ".join(self.names) or "none"
            raise AdapterError(
                f"no LoRA adapter named {name!r} is loaded (loaded: {loaded})"
            ) from None

    # -- loading ------------------------------------------------------------------------------

    def load(self, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> int:
        """Load (or replace) adapter ``name``; returns the number of layers it adapts.

        Checked whole before anything changes: an adapter that names a module the model does not
        have, adapts a layer that is not an ``nn.Linear`` or has the wrong shapes raises
        :class:`AdapterError` and leaves the loaded adapters as they were.
        """
        spec = AdapterSpec.from_config(config)
        if spec.r < 1:
            raise AdapterError(f"adapter {name!r}: its config has no rank r >= 1")
        pairs = split_adapter(tensors)
        if not pairs:
            raise AdapterError(f"adapter {name!r} has no lora_A/lora_B tensors")
        ref = next(iter(self.model.parameters()))
        staged: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for weight_name, (a, b) in pairs.items():
            module_name = weight_name.removesuffix(".weight")
            module = self._modules.get(module_name)
            if module is None:
                raise AdapterError(
                    f"adapter {name!r} targets {module_name}, which this model does not have"
                )
            if not isinstance(module, torch.nn.Linear):
                raise AdapterError(
                    f"adapter {name!r} targets {module_name}, a {type(module).__name__}: LoRA "
                    "adapters are served on nn.Linear layers only (this model's layer cannot "
                    "take one)"
                )
            if a.shape != (spec.r, module.in_features) or b.shape != (module.out_features, spec.r):
                raise AdapterError(
                    f"adapter {name!r}: {module_name} has A {tuple(a.shape)} and B "
                    f"{tuple(b.shape)}, expected ({spec.r}, {module.in_features}) and "
                    f"({module.out_features}, {spec.r})"
                )
            staged[module_name] = (
                a.to(device=ref.device, dtype=ref.dtype).contiguous(),
                (b.float() * spec.scale).to(device=ref.device, dtype=ref.dtype).contiguous(),
            )
        slot = self._slots.get(name)
        if slot is None:
            slot = self._slots[name] = self._next_slot
            self._next_slot += 1
        self._drop(slot)
        for module_name, ab in staged.items():
            self._layer(module_name)[slot] = ab
        self.configs[name] = dict(config)
        return len(staged)

    def tensors(self, name: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Adapter ``name``'s weights as served: ``{module: (A, alpha/r * B)}``."""
        slot = self.slot(name)
        return {m: w[slot] for m, w in self._weights.items() if slot in w}

    def remove(self, name: str) -> None:
        """Unload adapter ``name`` (``AdapterError`` when none is loaded by that name)."""
        slot = self.slot(name)
        self._drop(slot)
        del self._slots[name]
        self.configs.pop(name, None)

    def _layer(self, module_name: str) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The per-slot weights of one layer, hooking the layer the first time."""
        weights = self._weights.get(module_name)
        if weights is None:
            weights = self._weights[module_name] = {}
            module = self._modules[module_name]
            self._hooks[module_name] = module.register_forward_hook(
                _lora_hook(weights, self._selection)
            )
        return weights

    def _drop(self, slot: int) -> None:
        for weights in self._weights.values():
            weights.pop(slot, None)

    def close(self) -> None:
        """Remove every hook (the model is the base model again)."""
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        self._weights.clear()
        self._slots.clear()
        self.configs.clear()

    # -- per forward --------------------------------------------------------------------------

    def select(self, slots: list[int], device: torch.device) -> None:
        """The adapter slot of each row of the next forward (0 = the base model). One adapter
        for every row costs no indexing; mixed rows are grouped here once, not in every layer."""
        first = slots[0] if slots else 0
        if all(s == first for s in slots):
            self._selection.groups = [] if first == 0 else [(first, None)]
            return
        by_slot: dict[int, list[int]] = {}
        for i, s in enumerate(slots):
            if s:
                by_slot.setdefault(s, []).append(i)
        self._selection.groups = [
            (s, torch.tensor(rows, dtype=torch.long, device=device)) for s, rows in by_slot.items()
        ]

    def clear_selection(self) -> None:
        self._selection.groups = []


class AdapterHost(Protocol):
    """An engine that serves named LoRA adapters on its base model (``LocalEngine``, and
    ``SGLangEngine`` on servers started with ``--enable-lora``)."""

    def load_adapter(self, name: str, weights: AdapterWeights | str | os.PathLike[str]) -> None:
        """Load or replace adapter ``name`` (a peft adapter folder or tensors + config)."""
        ...

    def unload_adapter(self, name: str) -> None: ...

    @property
    def adapter_names(self) -> list[str]: ...

    # what AdapterEngine passes through
    @property
    def tokenizer(self) -> Any: ...

    @property
    def eos_token_ids(self) -> list[int]: ...

    @property
    def max_context_len(self) -> int | None: ...

    @property
    def model_path(self) -> str | None: ...

    @property
    def supports_state_dict_update(self) -> bool: ...

    async def agenerate(self, req: ModelRequest) -> ModelResponse: ...

    def agenerate_stream(self, req: ModelRequest) -> AsyncGenerator[StreamChunk, None]: ...

    def get_version(self) -> int: ...

    def set_version(self, version: int) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def stats(self) -> dict[str, float]: ...


class AdapterEngine:
    """One adapter of an :class:`AdapterHost`, as an ``InferenceEngine`` of its own.

    Its requests are answered with the adapter (``ModelRequest.adapter``); ``update_weights``
    replaces the adapter alone (a peft adapter folder, or :class:`AdapterWeights` in memory when
    the host takes them). Versions, pausing and the lifecycle are the host's: every policy on
    one engine shares its weight-version clock (the trainer moves it once per step), and the
    owner of the host initializes and destroys it.
    """

    supports_lora = True
    """``update_weights`` takes the adapter only (never merged weights)."""

    def __init__(self, host: AdapterHost, name: str) -> None:
        self.host = host
        self.name = name

    @property
    def tokenizer(self) -> Any:
        return self.host.tokenizer

    @property
    def eos_token_ids(self) -> list[int]:
        return self.host.eos_token_ids

    @property
    def max_context_len(self) -> int | None:
        return self.host.max_context_len

    @property
    def model_path(self) -> str | None:
        return self.host.model_path

    @property
    def supports_state_dict_update(self) -> bool:
        """In-memory adapter tensors (:class:`AdapterWeights`) are taken (else a folder)."""
        return self.host.supports_state_dict_update

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        req.adapter = self.name
        return await self.host.agenerate(req)

    async def agenerate_stream(self, req: ModelRequest) -> AsyncGenerator[StreamChunk, None]:
        req.adapter = self.name
        async for chunk in self.host.agenerate_stream(req):
            yield chunk

    def update_weights(self, weights: AdapterWeights | dict[str, Any] | str) -> None:
        """Replace this adapter (a peft adapter folder, or :class:`AdapterWeights`). A plain
        state dict has no adapter config: pass :class:`AdapterWeights` instead."""
        if isinstance(weights, dict):
            raise TypeError(
                f"policy {self.name!r} is a LoRA adapter: update it with an adapter folder or "
                "AdapterWeights(tensors, peft_config), not a state dict"
            )
        self.host.load_adapter(self.name, weights)

    def get_version(self) -> int:
        return self.host.get_version()

    def set_version(self, version: int) -> None:
        self.host.set_version(version)

    def pause(self) -> None:
        self.host.pause()

    def resume(self) -> None:
        self.host.resume()

    def initialize(self) -> None:
        """Nothing: the host is initialized by its owner."""

    def destroy(self) -> None:
        """Nothing: the host is destroyed by its owner (other policies still use it)."""

    def stats(self) -> dict[str, float]:
        return self.host.stats()
