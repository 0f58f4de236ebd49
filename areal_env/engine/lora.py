"""LoRA adapters as plain tensors: merge an adapter into base weights, read a peft adapter folder.

Kept free of ``peft`` on purpose: the inference side (the embedded engine, ``areal-env serve``)
applies an adapter by merging ``W + (alpha / r) * B @ A`` into its own weights, so it needs only
the adapter's tensors and its ``adapter_config.json`` — the files ``peft``'s ``save_pretrained``
writes and SGLang's ``/load_lora_adapter`` reads.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class AdapterSpec:
    """What a merge needs from an adapter config: the scale is ``alpha / r``."""

    r: int
    alpha: float

    @property
    def scale(self) -> float:
        return self.alpha / self.r

    @classmethod
    def from_config(cls, cfg: Any) -> AdapterSpec:
        """From a peft ``LoraConfig`` object or an ``adapter_config.json`` dict."""
        get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
        return cls(r=int(get("r") or 0), alpha=float(get("lora_alpha") or 0.0))


def _base_name(key: str) -> str:
    """A peft key (``base_model.model.x.q_proj.base_layer.weight``) as the base model's name."""
    if key.startswith(_PEFT_PREFIX):
        key = key[len(_PEFT_PREFIX) :]
    return key.replace(".base_layer.", ".")


def split_adapter(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{base weight name: (A, B)}`` from adapter tensors named ``...lora_A[.default].weight``."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in state.items():
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in key:
                module = key.split(marker)[0]
                pairs.setdefault(_base_name(module) + ".weight", {})[part] = t
    out = {}
    for name, ab in pairs.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"adapter for {name} has {sorted(ab)}; needs lora_A and lora_B")
        out[name] = (ab["lora_A"], ab["lora_B"])
    return out


def merge_lora_weights(state: dict[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """A peft model's full state dict → base weights (base names) with the adapters merged."""
    spec = AdapterSpec.from_config(cfg)
    adapters = split_adapter({k: v for k, v in state.items() if ".lora_" in k})
    base = {_base_name(k): v for k, v in state.items() if ".lora_" not in k}
    for name, (a, b) in adapters.items():
        w = base[name]
        base[name] = (w.float() + spec.scale * (b.float() @ a.float())).to(w.dtype)
    return base


def apply_adapter(
    weights: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], cfg: Any
) -> dict[str, torch.Tensor]:
    """``{base name: merged weight}`` for every module ``adapter`` touches (others untouched)."""
    spec = AdapterSpec.from_config(cfg)
    out = {}
    for name, (a, b) in split_adapter(adapter).items():
        if name not in weights:
            raise KeyError(f"the adapter targets {name}, which the model does not have")
        w = weights[name]
        out[name] = (w.float() + spec.scale * (b.float() @ a.float())).to(w.dtype)
    return out


def is_adapter_folder(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def load_adapter_folder(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and config of a peft adapter folder."""
    from safetensors.torch import load_file

    p = Path(path)
    cfg = json.loads((p / ADAPTER_CONFIG).read_text())
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"adapter folder {p} has no .safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors, cfg


def save_adapter_folder(
    path: str | os.PathLike[str],
    adapter: dict[str, torch.Tensor],
    config: dict,
    name: str = "default",
) -> int:
    """Write ``adapter`` (peft names; the adapter's own name, ``name``, is dropped from them as
    peft's ``save_pretrained`` does) + its config; return the bytes written."""
    from safetensors.torch import save_file

    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    tensors = {
        k.replace(f".lora_A.{name}.", ".lora_A.").replace(f".lora_B.{name}.", ".lora_B."): (
            v.contiguous()
        )
        for k, v in adapter.items()
    }
    save_file(tensors, str(p / ADAPTER_WEIGHTS))
    (p / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, default=list))
    return sum(f.stat().st_size for f in p.iterdir() if f.is_file())
