"""oneDNN's fp32 matrix product for the embedded engine's linear layers on a CPU.

Why: a decode step multiplies a few dozen rows (one per running sequence) by every weight
matrix, a shape where PyTorch's default fp32 product (MKL's sgemm) runs well below the CPU's
rate: on the demo's 2-core AMD EPYC, SmolLM2-135M's 210 layer products at 26 rows took 65-86 ms
through ``F.linear`` and 52 ms through oneDNN's kernel, on the same dense weights (1.25x; 1.06x
at 500 rows, a prefill's size). In an evaluation of the demo's 64 held-out problems the decode
step went from 163-175 ms to 132-133 ms, the prefills from 30-34 s to 27-28 s and the whole
evaluation from 73-79 s to 63-64 s, with the same answers (``bench/engine_throughput.py --case
linear`` measures it in one process).

What stays the same: the product is fp32 with fp32 accumulation, as before; its values differ
from the default's by the order of the additions only (about 4e-6 relative on the model's
shapes). The module keeps its own ``weight`` and ``bias`` parameters, read at every call, so
weight updates, tied embeddings and the LoRA adapters' forward hooks work unchanged. A
pre-packed (reordered) weight would be faster on decode alone (1.6x in isolation) but is a
second copy of every matrix, and was no faster in a whole evaluation.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


def onednn_linear_unavailable() -> str | None:
    """Why oneDNN's linear kernel cannot be used in this PyTorch build (None when it can)."""
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch build has no oneDNN (mkldnn)"
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this PyTorch build lacks torch.ops.mkldnn._linear_pointwise"
    return None


class OneDnnLinear(torch.nn.Linear):
    """``nn.Linear`` whose fp32 CPU product runs through oneDNN (other inputs: ``F.linear``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.dtype != torch.float32 or w.dtype != torch.float32 or x.device.type != "cpu":
            return F.linear(x, w, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, w, self.bias, "none", [], "")


def set_onednn_linears(model: torch.nn.Module, enabled: bool) -> int:
    """Route every plain ``nn.Linear`` of ``model`` through oneDNN (``enabled``) or back to
    ``F.linear``; returns how many layers were switched. The modules keep their parameters and
    hooks: only their class changes (subclasses of ``nn.Linear`` with a forward of their own,
    such as quantized layers, are left alone). Nothing is switched on where
    :func:`onednn_linear_unavailable` says why not."""
    if enabled:
        why = onednn_linear_unavailable()
        if why is not None:
            logger.info("oneDNN linear kernel off: %s", why)
            return 0
    source, target = (torch.nn.Linear, OneDnnLinear) if enabled else (OneDnnLinear, torch.nn.Linear)
    switched = 0
    for module in model.modules():
        if type(module) is source:
            module.__class__ = target
            switched += 1
    return switched
