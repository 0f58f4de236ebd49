"""Token logprobs (and entropies) through the LM head, chunk by chunk.

Why: a batch's scored positions times the vocabulary is the largest tensor of a training step
(3,267 trie nodes x 151,936 Qwen2.5 tokens = 2 GB in fp32, and autograd keeps the logits, their
fp32 copy and the softmax for the backward pass). :func:`head_logprobs` never holds more than
one chunk of logits: the forward pass keeps only each position's log-sum-exp, and the backward
pass recomputes a chunk's logits from the hidden states and turns them straight into the
gradients of the hidden states and of the head's weight. That costs one more head matmul in the
backward pass (about 5 % of a 1.5B model's FLOPs) and saves the [tokens, vocab] tensors.

Fused kernels that compute the gradient inside the forward pass (Liger's linear cross-entropy)
need the loss to be the head's own output; here the logprobs feed the PPO loss, whose gradient is
only known in the backward pass, so the chunks are recomputed instead.

Positions and targets: ``hidden`` [U, H] holds one row per distinct position; ``rows`` [M] names
the position each scored token is predicted from and ``targets`` [M] the token. Flat rows have
one target per position (``rows = arange``); in a packed trie a node with several children
predicts several tokens from one row of logits.
"""

from __future__ import annotations

from typing import Any

import torch


class HeadInputs:
    """What the head scores: ``rows`` [M] (ascending), ``targets`` [M], ``inv_temp`` (1 /
    sampling temperature: one number, or [U] per position) and whether entropies are wanted
    (with a gradient).

    A plain class on purpose: FSDP2's mixed-precision policy casts every floating tensor among
    a sharded forward's arguments (dataclasses included) to bf16, which would round the inverse
    temperatures; an object of its own class is passed through untouched.
    """

    def __init__(
        self,
        rows: torch.Tensor,
        targets: torch.Tensor,
        inv_temp: float | torch.Tensor = 1.0,
        *,
        with_entropy: bool = False,
        entropy_grad: bool = False,
        chunk: int = 0,
    ) -> None:
        self.rows = rows
        self.targets = targets
        self.inv_temp = inv_temp
        self.with_entropy = with_entropy
        self.entropy_grad = entropy_grad
        self.chunk = chunk

    def inv_temp_column(self, lo: int, hi: int) -> float | torch.Tensor:
        """The inverse temperatures of positions ``lo..hi-1`` as a [hi-lo, 1] column (or the
        one number)."""
        it = self.inv_temp
        return it[lo:hi, None] if isinstance(it, torch.Tensor) else it


def inverse_temperatures(temperature: float | torch.Tensor) -> float | torch.Tensor:
    """``1 / temperature``: one number, or a float32 tensor for per-position temperatures (one
    number when they are all equal, which skips a pass over the logits)."""
    if isinstance(temperature, torch.Tensor):
        t = temperature.float()
        if t.numel() == 0 or bool((t == t.flatten()[0]).all()):
            return 1.0 / max(float(t.flatten()[0]) if t.numel() else 1.0, 1e-6)
        return 1.0 / t.clamp_min(1e-6)
    return 1.0 / float(temperature)


def compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's when it is on for the weight's device
    (``strategy: single`` in mixed precision), else the weight's own (FSDP2 hands the forward
    its parameters already cast)."""
    dev = weight.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return weight.dtype


def _chunk_bounds(rows: torch.Tensor, n_pos: int, chunk: int) -> list[tuple[int, int, int, int]]:
    """(first position, end position, first token, end token) of each chunk; ``rows`` is
    ascending, so a chunk's tokens are one slice."""
    step = chunk if chunk > 0 else max(n_pos, 1)
    starts = list(range(0, n_pos, step))
    edges = torch.tensor([*starts, n_pos], dtype=rows.dtype, device=rows.device)
    cuts = torch.searchsorted(rows, edges).tolist()  # one host sync per call
    return [(lo, min(lo + step, n_pos), cuts[i], cuts[i + 1]) for i, lo in enumerate(starts)]


class _ChunkedHeadLogprobs(torch.autograd.Function):
    """Logprobs [M] and entropies [U] of ``softmax(hidden @ weight.T * inv_temp)``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        spec: HeadInputs,
        dtype: torch.dtype,
        entropy_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, targets = spec.rows, spec.targets
        n_pos = hidden.shape[0]
        bounds = _chunk_bounds(rows, n_pos, spec.chunk)
        dev = hidden.device
        acc = _accumulation_dtype(dtype)
        logp = torch.empty(rows.shape[0], dtype=acc, device=dev)
        lse = torch.empty(n_pos, dtype=acc, device=dev)
        ent = torch.zeros(n_pos if spec.with_entropy else 0, dtype=acc, device=dev)
        with torch.autocast(dev.type, enabled=False):
            w = weight.to(dtype)
            for lo, hi, a, b in bounds:
                z = _chunk_logits(hidden[lo:hi], w, dtype, spec.inv_temp_column(lo, hi))
                lz = torch.logsumexp(z, dim=-1)
                lse[lo:hi] = lz
                local = rows[a:b] - lo
                logp[a:b] = z[local, targets[a:b]] - lz[local]
                if spec.with_entropy:
                    p = torch.exp(z - lz[:, None])
                    ent[lo:hi] = lz - torch.linalg.vecdot(p, z)
        ctx.save_for_backward(hidden, weight, rows, targets, lse)
        ctx.spec, ctx.bounds, ctx.dtype = spec, bounds, dtype
        if not (spec.with_entropy and entropy_grad):
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None
    ) -> tuple[Any, ...]:
        hidden, weight, rows, targets, lse = ctx.saved_tensors
        spec: HeadInputs = ctx.spec
        dtype = ctx.dtype
        dev = hidden.device
        acc = _accumulation_dtype(dtype)
        if g_logp is None:
            g_logp = torch.zeros(rows.shape[0], dtype=acc, device=dev)
        g_logp = g_logp.to(acc)
        if g_ent is not None and not g_ent.numel():
            g_ent = None
        # d logp_m / d z_u = onehot(target_m) - p_u  (u: the position token m is predicted from)
        # d entropy_u / d z_u = -p_u * (z_u - E_p[z_u]);  z = logits * inv_temp
        g_sum = torch.zeros(hidden.shape[0], dtype=acc, device=dev)
        g_sum.index_add_(0, rows, g_logp)
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        with torch.autocast(dev.type, enabled=False):
            w = weight.to(dtype)
            for lo, hi, a, b in ctx.bounds:
                it = spec.inv_temp_column(lo, hi)
                h = hidden[lo:hi].to(dtype)
                z = _chunk_logits(h, w, dtype, it)
                dz = torch.exp(z - lse[lo:hi, None])  # p, turned into dL/dz in place
                if g_ent is None:
                    dz.mul_(-g_sum[lo:hi, None] * it)
                else:
                    mean_z = torch.linalg.vecdot(dz, z)[:, None]
                    coef = z.sub_(mean_z).mul_(-g_ent[lo:hi, None].to(acc))
                    dz.mul_(coef.sub_(g_sum[lo:hi, None]).mul_(it))
                local = rows[a:b] - lo
                g_tok = g_logp[a:b] * (it[:, 0][local] if isinstance(it, torch.Tensor) else it)
                dz.index_put_((local, targets[a:b]), g_tok, accumulate=True)
                dzc = dz.to(dtype)
                if grad_h is not None:
                    grad_h[lo:hi] = (dzc @ w).to(hidden.dtype)
                if want_w and dzc.dtype == acc:
                    grad_w.addmm_(dzc.T, h)
                elif want_w:  # bf16/fp16 product, summed over chunks in fp32
                    grad_w += dzc.T @ h
        gw = grad_w.to(weight.dtype) if want_w else None
        return grad_h, gw, None, None, None


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax arithmetic runs in fp32 at least (fp64 stays fp64: the tests' reference)."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_logits(
    h: torch.Tensor, w: torch.Tensor, dtype: torch.dtype, inv_temp: float | torch.Tensor
) -> torch.Tensor:
    """Logits of one chunk in fp32 (or wider), divided by the temperature."""
    z = (h.to(dtype) @ w.T).to(_accumulation_dtype(dtype))
    if isinstance(inv_temp, torch.Tensor) or inv_temp != 1.0:
        z.mul_(inv_temp)
    return z


def head_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, spec: HeadInputs
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs [M] of ``spec.targets`` predicted from ``hidden[spec.rows]`` through a bias-free
    LM head ``weight`` [V, H], and entropies [U] per position when asked, chunk by chunk."""
    logp, ent = _ChunkedHeadLogprobs.apply(
        hidden, weight, spec, compute_dtype(weight), spec.entropy_grad and torch.is_grad_enabled()
    )
    return logp, (ent if spec.with_entropy else None)


def logits_logprobs(
    logits: torch.Tensor, spec: HeadInputs
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same from full logits [U, V] (models whose logits are not ``lm_head(hidden)``)."""
    it = spec.inv_temp
    z = logits.to(_accumulation_dtype(logits.dtype))
    z = z * (it[:, None].to(z.dtype) if isinstance(it, torch.Tensor) else it)
    lse = torch.logsumexp(z, dim=-1)
    logp = z[spec.rows, spec.targets] - lse[spec.rows]
    ent = None
    if spec.with_entropy:
        with torch.set_grad_enabled(spec.entropy_grad and torch.is_grad_enabled()):
            ent = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
    return logp, ent
