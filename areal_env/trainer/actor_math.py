"""The actor's math: the PPO token loss, token logprobs over scored positions, the batch
records the update works on, and the update's metrics.

Everything token-level is a flat vector over the *scored* tokens (loss-mask tokens at position
>= 1). Only those positions go through the LM head, chunk by chunk (``logprobs``), which keeps
the vocab-sized logits small: a prompt token never needs one. The loss and logprobs are tested
against plain-loop references.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from areal_env.trainer import memory
from areal_env.trainer.dist import DistContext, all_reduce_sums
from areal_env.trainer.logprobs import (
    HeadInputs,
    head_logprobs,
    inverse_temperatures,
    logits_logprobs,
)
from areal_env.trainer.tree import tree_logprobs

# Model classes whose logits are exactly ``lm_head(final hidden state)``: for these we run the
# decoder and apply the head to scored positions only. Others use the full forward pass.
_PLAIN_HEAD_MODELS = {
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Phi3ForCausalLM",
}


def scored_mask(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Bool [B, L]: tokens that get a loss — loss-mask, inside the attention mask, position >= 1."""
    mask = batch["loss_mask"].bool()
    if "attention_mask" in batch:
        mask = mask & batch["attention_mask"].bool()
    mask = mask.clone()
    mask[:, 0] = False
    return mask


def high_entropy_mask(entropy: torch.Tensor, share: float) -> torch.Tensor:
    """Bool mask of the ``share`` of tokens with the highest ``entropy`` (at least one; ties at
    the threshold are all kept). Where the policy was nearly sure, its token made no choice, so
    the episode's advantage is noise there (``actor.high_entropy_token_share``)."""
    n = entropy.numel()
    if share >= 1.0 or n == 0:
        return torch.ones_like(entropy, dtype=torch.bool)
    k = max(1, math.ceil(share * n))
    threshold = torch.topk(entropy.detach().float(), k).values[-1]
    return entropy.detach() >= threshold


def ppo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    behav_logp: torch.Tensor | None = None,
    behav_imp_weight_cap: float | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: Literal["k2", "k3"] = "k2",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO loss (flat vectors over scored tokens) and per-token diagnostics.

    ``old_logp`` is the logprob the ratio is taken against: the behaviour logprob in the plain
    form, the recomputed *proximal* logprob in the decoupled form, where each token is further
    weighted by the behaviour importance weight ``exp(old_logp - behav_logp)`` capped at
    ``behav_imp_weight_cap`` (truncated importance sampling). ``ref_logp`` adds ``kl_coef``
    times ``k2 = (logp - ref)² / 2`` or ``k3 = exp(ref - logp) - (ref - logp) - 1``
    (``kl_estimator``); ``entropy`` subtracts ``entropy_coef * entropy``. The caller reduces
    (token mean).
    """
    high = eps_clip if eps_clip_high is None else eps_clip_high
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    loss = torch.maximum(pg1, pg2)
    clipped = (pg2 > pg1).float()
    diag: dict[str, torch.Tensor] = {
        "clipped": clipped.detach(),
        "approx_kl": ((ratio - 1.0) - log_ratio).detach(),
        "ratio": ratio.detach(),
    }
    if behav_logp is not None:
        w = torch.exp(old_logp - behav_logp).detach()
        if behav_imp_weight_cap is not None:
            w = w.clamp(max=behav_imp_weight_cap)
        loss = loss * w
        diag["behav_imp_weight"] = w
    if ref_logp is not None and kl_coef > 0:
        d = ref_logp - logp
        kl = 0.5 * d * d if kl_estimator == "k2" else torch.exp(d) - d - 1.0
        loss = loss + kl_coef * kl
        diag["ref_kl"] = kl.detach()
    if entropy is not None and entropy_coef != 0:
        loss = loss - entropy_coef * entropy
    return loss, diag


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """fp32 on CPU (a bf16-autocast update gains only 1.15-1.3x there, for bf16's rounding),
    bf16 on GPU, unless set explicitly."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def _head_weight(inner: Any) -> torch.Tensor | None:
    """The LM head's weight when the head is a plain bias-free linear layer (what the chunked
    logprobs take); None otherwise (e.g. a LoRA-adapted head), and the logits are computed in
    full."""
    head = inner.get_output_embeddings()
    if type(head) is torch.nn.Linear and head.bias is None:
        return head.weight
    return None


def scored_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    sel_next: torch.Tensor,
    spec: HeadInputs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (and entropies) of the tokens after the positions ``sel_next`` [B, L-1] selects
    (position p predicts token p+1); see :class:`HeadInputs`.

    For plain-head models only the selected positions go through the LM head, chunk by chunk
    (``logprobs.head_logprobs``). A LoRA (``peft``) wrapper is looked through. A sharded (FSDP)
    model runs this as a registered forward method (see ``install_scored_forward``) so its root
    parameters are gathered before it runs and its gradients reduced after.
    """
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if type(inner).__name__ in _PLAIN_HEAD_MODELS:
        hidden = inner.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        )[0]
        weight = _head_weight(inner)
        if weight is not None:
            return head_logprobs(hidden[:, :-1][sel_next], weight, spec)
        return logits_logprobs(inner.get_output_embeddings()(hidden[:, :-1][sel_next]), spec)
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return logits_logprobs(out.logits[:, :-1][sel_next], spec)


def install_scored_forward(model: Any) -> None:
    """Make ``scored_logprobs`` and ``tree_logprobs`` forward methods of ``model`` that FSDP
    hooks: the root's sharded parameters (embeddings, final norm, LM head) are gathered before
    they run and their gradients reduced after, exactly as for ``forward``."""
    import types

    from torch.distributed.fsdp import register_fsdp_forward_method

    model.areal_scored_logprobs = types.MethodType(scored_logprobs, model)  # type: ignore[assignment]
    register_fsdp_forward_method(model, "areal_scored_logprobs")
    model.areal_tree_logprobs = types.MethodType(tree_logprobs, model)  # type: ignore[assignment]
    register_fsdp_forward_method(model, "areal_tree_logprobs")


def has_plain_head(model: Any) -> bool:
    """Whether ``model`` (looked through a LoRA wrapper) has logits = lm_head(final hidden)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return type(inner).__name__ in _PLAIN_HEAD_MODELS


def token_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    mask: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (and entropies) of the tokens selected by ``mask`` [B, L], flattened in row-major
    order, under ``softmax(logits / temperature)`` — the distribution the sampler drew from.

    ``temperature``: one number, or a [B, L] tensor giving each token's own (the temperature
    its logprob was recorded at; ``proxy.sampling: agent`` lets it differ per row). ``chunk``:
    positions per LM-head chunk (0 = all at once)."""
    sel_next = mask[:, 1:]  # position p predicts token p+1
    targets = input_ids[:, 1:][sel_next]
    n = int(targets.numel())
    if isinstance(temperature, torch.Tensor):
        temps: float | torch.Tensor = temperature.to(input_ids.device)[:, 1:][sel_next]
    else:
        temps = temperature
    inv_temp = inverse_temperatures(temps)
    spec = HeadInputs(
        torch.arange(n, device=input_ids.device),
        targets,
        inv_temp.to(input_ids.device) if isinstance(inv_temp, torch.Tensor) else inv_temp,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        chunk=chunk,
    )
    fn = getattr(model, "areal_scored_logprobs", None)  # a sharded model's registered method
    if fn is not None:
        return fn(input_ids, attention_mask, sel_next, spec)
    return scored_logprobs(model, input_ids, attention_mask, sel_next, spec)


def first_token_mask(width: int) -> torch.Tensor:
    """A [1, width] mask scoring only position 1: a minimal pass for padding micro-batches."""
    m = torch.zeros(1, width, dtype=torch.bool)
    m[0, min(1, width - 1)] = True
    return m


def single_temperature(
    temps: torch.Tensor | float, rows: list[int], mask: torch.Tensor, default: float
) -> float | None:
    """The one temperature the scored tokens of ``rows`` were sampled at (tree packing takes a
    single one), ``default`` when none is scored, or None when they differ."""
    if not isinstance(temps, torch.Tensor):
        return float(temps)
    idx = torch.tensor(rows)
    scored = temps[idx][mask[idx].bool().cpu()] if len(rows) else temps.flatten()[:0]
    if scored.numel() == 0:
        return default
    first = float(scored[0])
    return first if bool((scored == first).all()) else None


def row_lengths(attn: torch.Tensor) -> list[int]:
    """Valid length of each right-padded row (index of the last attended token + 1)."""
    attn = attn.bool()
    pos = torch.arange(attn.shape[1], device=attn.device).expand_as(attn)
    last = torch.where(attn, pos, torch.full_like(pos, -1)).max(dim=1).values
    return [max(int(x) + 1, 1) for x in last]


def minibatch_rows(
    n_minibatches: int,
    lengths: list[int],
    group_ids: torch.Tensor | None,
    generator: torch.Generator,
    *,
    by_group: bool,
) -> list[list[int]]:
    """The rows of each minibatch of one PPO epoch, in a random order drawn from ``generator``.

    ``by_group``: whole groups go to one minibatch (shuffled, each to the minibatch with the
    fewest tokens so far), so that the prompt and turns a group's rows share are packed into
    one trie; otherwise, or with fewer groups than minibatches, rows are dealt round-robin from
    a random permutation. Empty minibatches are never returned."""
    n_rows = len(lengths)
    n_mb = min(n_minibatches, n_rows)
    perm = torch.randperm(n_rows, generator=generator).tolist()
    if by_group and group_ids is not None and n_mb > 1:
        members: dict[int, list[int]] = {}
        for r in perm:  # groups in the order their first row was drawn
            members.setdefault(int(group_ids[r]), []).append(r)
        if len(members) >= n_mb:
            out: list[list[int]] = [[] for _ in range(n_mb)]
            load = [0] * n_mb
            for rows in members.values():
                i = min(range(n_mb), key=lambda j: (load[j], j))
                out[i].extend(rows)
                load[i] += sum(lengths[r] for r in rows)
            return [mb for mb in out if mb]
    return [mb for mb in (perm[i::n_mb] for i in range(n_mb)) if mb]


@dataclass
class MicroBatchPlan:
    """The micro-batches of a set of rows and whether they are tree-packed."""

    groups: list[list[int]]
    tree: bool
    logical_tokens: int  # sum of the rows' lengths
    computed_tokens: int  # tokens the model runs over (trie nodes when packed)


@dataclass
class PreparedBatch:
    """A batch with everything the update needs, flattened over scored tokens per row."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    mask: torch.Tensor
    lengths: list[int]
    adv: torch.Tensor  # [B, L]
    behav_logp: torch.Tensor  # [B, L]
    old_logp: torch.Tensor  # [B, L]  (behaviour or proximal)
    ref_logp: torch.Tensor | None
    stats: dict[str, float]
    temps: torch.Tensor | float = 1.0  # [B, L] per-token sampling temperatures, or one value
    imitate: torch.Tensor | None = None  # [B, L] guided tokens trained by NLL (guided_nll_coef)


@dataclass
class UpdateTally:
    """What one update counts as it goes, for its metrics."""

    t_start: float
    losses: list[float] = field(default_factory=list)  # per optimiser step
    grad_norms: list[float] = field(default_factory=list)  # per optimiser step
    skipped_nonfinite: int = 0  # optimiser steps skipped for a non-finite gradient norm
    trained_tokens: int = 0  # tokens of the rows trained on (logical)
    packed_tokens: int = 0  # tokens the model computed (fewer when trees share prefixes)
    tree_used: bool = False
    local_rows: int = 0  # rows this rank trained on (all of them on one rank)
    # The first minibatch's approx KL, summed, and its token count: measured before the first
    # optimiser step, so it is the gap between the logprobs recorded at rollout and the ones
    # this model computes now (0 unless the rollout's policy differs or something drifted).
    start_kl: float = 0.0
    start_n: float = 0.0
    log_ratio_max: float = 0.0  # the largest |log ratio| of any token, over the whole update

    def note_micro(self, diag: dict[str, float], *, first_minibatch: bool) -> None:
        """Take a micro-batch's start-of-update KL and largest log ratio out of ``diag``."""
        self.log_ratio_max = max(self.log_ratio_max, diag.pop("log_ratio_max", 0.0))
        if first_minibatch:
            self.start_kl += diag.get("approx_kl", 0.0)
            self.start_n += diag.get("n", 0.0)


def summarize_update(
    stats: dict[str, float],
    sums: dict[str, float],
    dist: DistContext,
    *,
    lr: float,
    tally: UpdateTally,
) -> dict[str, float]:
    """The update's metrics from its tallies: loss diagnostics (summed over ranks), speed and
    memory; ``stats`` (the batch's own) is extended and returned."""
    t_start, losses, grad_norms = tally.t_start, tally.losses, tally.grad_norms
    trained_tokens, packed_tokens = tally.trained_tokens, tally.packed_tokens
    if dist.distributed:
        keys = (
            "n",
            "clipped",
            "approx_kl",
            "ratio",
            "entropy",
            "ref_kl",
            "behav_imp_weight",
            "pg_tokens",
        )
        present = {k: sums.get(k, 0.0) for k in keys}
        present["start_kl"], present["start_n"] = tally.start_kl, tally.start_n
        reduced = all_reduce_sums(present, dist)
        tally.start_kl, tally.start_n = reduced.pop("start_kl"), reduced.pop("start_n")
        sums = {k: v for k, v in reduced.items() if k in sums or k in ("n",) or v != 0.0}
    denom = max(sums.get("n", 0.0), 1.0)
    elapsed = time.perf_counter() - t_start
    stats.update(
        {
            "actor/loss": sum(losses) / max(len(losses), 1),
            "actor/clip_frac": sums.get("clipped", 0.0) / denom,
            "actor/approx_kl": sums.get("approx_kl", 0.0) / denom,
            "actor/start_kl": tally.start_kl / max(tally.start_n, 1.0),
            "actor/log_ratio_max": tally.log_ratio_max,
            "actor/ratio_mean": sums.get("ratio", 0.0) / denom,
            "actor/entropy": sums.get("entropy", 0.0) / denom,
            "actor/grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
            "actor/optimizer_steps": float(len(grad_norms)),
            "actor/nonfinite_skipped": float(tally.skipped_nonfinite),
            "actor/lr": lr,
            "time/update_s": elapsed,
            "perf/train_tokens_per_s": trained_tokens / elapsed if elapsed > 0 else 0.0,
            "actor/tree_packed": float(tally.tree_used),
            "actor/computed_tokens": float(packed_tokens),
            "actor/token_sharing": trained_tokens / packed_tokens if packed_tokens else 1.0,
            "mem/update_peak_rss_gb": memory.peak_rss_gb(),
        }
    )
    if dist.distributed:
        stats["dist/rank0_rows"] = float(tally.local_rows)  # rank 0 logs: its share of the rows
    if "ref_kl" in sums:
        stats["actor/ref_kl"] = sums["ref_kl"] / denom
    if "behav_imp_weight" in sums:
        stats["actor/behav_imp_weight"] = sums["behav_imp_weight"] / denom
    if "pg_tokens" in sums:
        stats["actor/pg_token_share"] = sums["pg_tokens"] / denom
    return stats


def warmup_lr(base_lr: float, steps_taken: int, warmup_steps: int) -> float:
    """The learning rate of the next optimiser step: linear warmup over ``warmup_steps`` steps
    (the first step gets ``base_lr / warmup_steps``), then ``base_lr``."""
    if warmup_steps <= 0:
        return base_lr
    return base_lr * min(1.0, (steps_taken + 1) / warmup_steps)


def optimizer_steps_taken(optimizer: torch.optim.Optimizer) -> int:
    """Steps this optimiser has taken, from its own state (so a resumed run, which restores
    the optimiser, goes on with the warmup where it stopped)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param)
            if state and "step" in state:
                return int(state["step"])
    return 0
