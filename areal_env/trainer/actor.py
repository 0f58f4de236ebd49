"""The policy being trained: logprob recompute, PPO loss and the optimiser step.

A batch is the executor's right-padded tensor dict: ``input_ids`` [B, L], ``attention_mask``,
``loss_mask``, ``logprobs`` (behaviour logprobs, aligned with the token they score, 0 on the
prompt), ``versions``, ``rewards`` [B], and optionally ``group_ids`` / ``traj_ids`` [B].

Masks come only from ``attention_mask`` / ``loss_mask``, never from pad ids (for SmolLM2 the pad
token is also the eos token, which the model does generate and must be trained on).

Everything token-level is handled as flat vectors over the *scored* tokens (loss-mask tokens at
position >= 1). Only those positions go through the LM head, which keeps the vocab-sized logits
small: a prompt token never needs one.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from areal_env.api.config import ActorConfig, ConfigError, ModelConfig
from areal_env.trainer import memory
from areal_env.trainer.advantages import group_advantages, shape_rewards, token_advantages
from areal_env.trainer.tree import (
    enable_tree_attention,
    pack_rows,
    packed_size,
    tree_micro_batches,
    tree_supported,
    tree_token_logprobs,
)

logger = logging.getLogger(__name__)

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


# ------------------------------------------------------------------------------------------
# Pure functions (tested against plain-loop references)
# ------------------------------------------------------------------------------------------


def scored_mask(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Bool [B, L]: tokens that get a loss — loss-mask, inside the attention mask, position >= 1."""
    mask = batch["loss_mask"].bool()
    if "attention_mask" in batch:
        mask = mask & batch["attention_mask"].bool()
    mask = mask.clone()
    mask[:, 0] = False
    return mask


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
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO loss (flat vectors over scored tokens) and per-token diagnostics.

    ``old_logp`` is the logprob the ratio is taken against: the behaviour logprob in the plain
    form, the recomputed *proximal* logprob in the decoupled form, where each token is further
    weighted by the behaviour importance weight ``exp(old_logp - behav_logp)`` capped at
    ``behav_imp_weight_cap`` (truncated importance sampling). ``ref_logp`` adds
    ``kl_coef * k3`` with ``k3 = exp(ref - logp) - (ref - logp) - 1``; ``entropy`` subtracts
    ``entropy_coef * entropy``. The caller reduces (token mean).
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
        kl = torch.exp(d) - d - 1.0
        loss = loss + kl_coef * kl
        diag["ref_kl"] = kl.detach()
    if entropy is not None and entropy_coef != 0:
        loss = loss - entropy_coef * entropy
    return loss, diag


# ------------------------------------------------------------------------------------------
# Model helpers
# ------------------------------------------------------------------------------------------


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """fp32 on CPU (bf16 is ~4x slower there), bf16 on GPU, unless set explicitly."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    mask: torch.Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (and entropies) of the tokens selected by ``mask`` [B, L], flattened in row-major
    order, under ``softmax(logits / temperature)`` — the distribution the sampler drew from."""
    sel_next = mask[:, 1:]  # position p predicts token p+1
    targets = input_ids[:, 1:][sel_next]
    if type(model).__name__ in _PLAIN_HEAD_MODELS:
        base = model.get_decoder()
        hidden = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)[0]
        logits = model.get_output_embeddings()(hidden[:, :-1][sel_next])
    else:
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        logits = out.logits[:, :-1][sel_next]
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            probs = torch.softmax(logits, dim=-1)
            entropy = lse - (probs * logits).sum(-1)
    return logp, entropy


def micro_batches(lengths: list[int], rows: list[int], max_tokens: int) -> list[list[int]]:
    """Pack ``rows`` (longest first) so each micro-batch's padded size rows×max_len ≤ max_tokens
    (a single longer row still gets its own micro-batch)."""
    order = sorted(rows, key=lambda r: -lengths[r])
    out: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for r in order:
        new_max = max(cur_max, lengths[r])
        if cur and new_max * (len(cur) + 1) > max_tokens:
            out.append(cur)
            cur, cur_max = [], 0
            new_max = lengths[r]
        cur.append(r)
        cur_max = new_max
    if cur:
        out.append(cur)
    return out


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


# ------------------------------------------------------------------------------------------
# The actor
# ------------------------------------------------------------------------------------------


class PPOActor:
    """Owns the trainer's copy of the policy (separate from the inference engine's), the
    optimiser and, when ``kl_coef > 0``, a frozen reference copy."""

    def __init__(
        self,
        model_path: str,
        actor: ActorConfig,
        model_cfg: ModelConfig | None = None,
        *,
        temperature: float = 1.0,
        seed: int = 1,
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.cfg = actor
        self.model_cfg = model_cfg or ModelConfig()
        self.temperature = float(actor.temperature or temperature or 1.0)
        self.seed = seed
        self.device = resolve_device(self.model_cfg.device)
        self.dtype = resolve_dtype(self.model_cfg.dtype, self.device)
        self.model_path = model_path
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype).to(
            self.device
        )
        self.model.config.use_cache = False
        if self.model_cfg.gradient_checkpointing:
            _enable_checkpointing(self.model)
        self.model.train()
        if actor.tree_training != "off":
            enable_tree_attention(self.model)
        self.tree_unsupported = tree_supported(self.model)
        if actor.tree_training == "on" and self.tree_unsupported:
            raise ConfigError(
                f"actor.tree_training=on, but {self.tree_unsupported}; set it to auto or off"
            )
        self.ref_model = None
        if actor.kl_coef > 0:
            self.ref_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype).to(
                self.device
            )
            self.ref_model.eval().requires_grad_(False)
            if actor.tree_training != "off":
                enable_tree_attention(self.ref_model)
        params = [p for p in self.model.parameters() if p.requires_grad]
        kwargs: dict[str, Any] = {}
        if self.device.type == "cpu" or self.device.type == "cuda":
            kwargs["fused"] = True
        try:
            self.optimizer = torch.optim.AdamW(
                params,
                lr=actor.lr,
                betas=tuple(actor.adam_betas),
                weight_decay=actor.weight_decay,
                **kwargs,
            )
        except (RuntimeError, TypeError):  # fused unsupported for this device/dtype
            self.optimizer = torch.optim.AdamW(
                params, lr=actor.lr, betas=tuple(actor.adam_betas), weight_decay=actor.weight_decay
            )
        self.update_count = 0

    # -- logprobs ---------------------------------------------------------------------------

    @torch.no_grad()
    def compute_logprobs(
        self, batch: dict[str, torch.Tensor], model: torch.nn.Module | None = None
    ) -> torch.Tensor:
        """Recompute logprobs [B, L] of the scored tokens at the sampling temperature (0
        elsewhere), in token-bounded micro-batches."""
        model = model or self.model
        input_ids = batch["input_ids"].to(self.device)
        attn = batch["attention_mask"].to(self.device).bool()
        mask = scored_mask(batch).to(self.device)
        lengths = _row_lengths(attn)
        out = torch.zeros(input_ids.shape, dtype=torch.float32, device=self.device)
        rows = list(range(len(lengths)))
        plan = self.plan_micro_batches(batch["input_ids"], lengths, rows)
        for mb in plan.groups:
            idx = torch.tensor(mb, device=self.device)
            width = max(lengths[r] for r in mb)
            m = mask[idx, :width]
            if not m.any():
                continue
            if plan.tree:
                lp, _ = self._tree_logprobs(model, input_ids, mask, lengths, mb)
            else:
                lp, _ = token_logprobs(
                    model, input_ids[idx, :width], attn[idx, :width], m, self.temperature
                )
            sub = torch.zeros(m.shape, dtype=torch.float32, device=self.device)
            sub[m] = lp.float()
            out[idx, :width] = sub
        return out.cpu()

    # -- micro-batching (flat or tree-packed) ------------------------------------------------

    def plan_micro_batches(
        self, input_ids: torch.Tensor, lengths: list[int], rows: list[int]
    ) -> MicroBatchPlan:
        """How ``rows`` go through the model: tree-packed groups or padded flat micro-batches.

        ``tree_training=auto`` packs when the trie saves at least a quarter of the tokens (GRPO
        groups, shared system prompts, multi-turn rows); below that the dense tree mask costs
        more than the saved tokens.
        """
        budget = self.cfg.micro_batch_tokens
        logical = sum(lengths[r] for r in rows)
        mode = self.cfg.tree_training
        if mode != "off" and not self.tree_unsupported and rows:
            toks = {r: input_ids[r, : lengths[r]].tolist() for r in rows}
            packed = packed_size([toks[r] for r in rows])
            if mode == "on" or packed <= 0.75 * logical:
                seqs = [toks.get(i, ()) for i in range(max(rows) + 1)]
                groups = tree_micro_batches(seqs, rows, budget)
                nodes = sum(packed_size([toks[r] for r in g]) for g in groups)
                return MicroBatchPlan(groups, True, logical, nodes)
        return MicroBatchPlan(micro_batches(lengths, rows, budget), False, logical, logical)

    def _tree_logprobs(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        lengths: list[int],
        rows: list[int],
        *,
        with_entropy: bool = False,
        entropy_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        seqs = [input_ids[r, : lengths[r]] for r in rows]
        tree = pack_rows([s.tolist() for s in seqs])
        return tree_token_logprobs(
            model,
            tree,
            [mask[r, : lengths[r]] for r in rows],
            seqs,
            self.temperature,
            plain_head=type(model).__name__ in _PLAIN_HEAD_MODELS,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
        )

    # -- preparation ------------------------------------------------------------------------

    def prepare(self, batch: dict[str, torch.Tensor]) -> PreparedBatch:
        """Advantages, and the logprobs the ratio is taken against (and the reference's)."""
        a = self.cfg
        batch = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        mask = scored_mask(batch)
        attn = batch["attention_mask"].bool()
        rewards = shape_rewards(
            batch["rewards"], scaling=a.reward_scaling, bias=a.reward_bias, clip=a.reward_clip
        )
        row_adv, astats = group_advantages(
            rewards,
            batch.get("group_ids"),
            batch.get("traj_ids"),
            mean_norm=a.group_adv_norm,
            std_norm=a.group_std_norm,
        )
        adv = token_advantages(row_adv, mask, batch_norm=a.batch_adv_norm)
        behav = batch["logprobs"].float()
        t0 = time.perf_counter()
        stats: dict[str, float] = {
            "adv/groups": float(astats.n_groups),
            "adv/trajectories": float(astats.n_trajectories),
            "adv/zero_variance_groups": float(astats.zero_variance_groups),
            "adv/shaped_reward_mean": astats.reward_mean,
            "adv/abs_mean": float(adv[mask].abs().mean()) if mask.any() else 0.0,
        }
        old = behav
        if a.use_decoupled_loss or a.recompute_logprobs:
            old = self.compute_logprobs(batch)
            if mask.any():
                stats["actor/behav_prox_logp_diff"] = float((old - behav)[mask].abs().mean())
        ref = self.compute_logprobs(batch, self.ref_model) if self.ref_model is not None else None
        stats["time/recompute_s"] = time.perf_counter() - t0
        return PreparedBatch(
            input_ids=batch["input_ids"].long(),
            attention_mask=attn,
            mask=mask,
            lengths=_row_lengths(attn),
            adv=adv,
            behav_logp=behav,
            old_logp=old,
            ref_logp=ref,
            stats=stats,
        )

    # -- update -----------------------------------------------------------------------------

    def update(
        self, batch: dict[str, torch.Tensor], *, step: int | None = None
    ) -> dict[str, float]:
        """One PPO update (``ppo_epochs`` × ``ppo_n_minibatches`` optimiser steps) on ``batch``.

        Blocking and CPU/GPU heavy: the trainer calls it through ``asyncio.to_thread``.
        """
        t_start = time.perf_counter()
        memory.reset_peak()
        pb = self.prepare(batch)
        a = self.cfg
        stats = dict(pb.stats)
        n_tokens = int(pb.mask.sum())
        stats["actor/scored_tokens"] = float(n_tokens)
        stats["actor/rows"] = float(pb.mask.shape[0])
        signal = bool((pb.adv[pb.mask] != 0).any()) if n_tokens else False
        if n_tokens == 0 or (not signal and a.kl_coef == 0 and a.entropy_coef == 0):
            # Every advantage is 0: the PPO gradient is exactly 0, so an optimiser step would only
            # move Adam's moments. Skip it (and say so).
            stats["actor/update_skipped"] = 1.0
            stats["time/update_s"] = time.perf_counter() - t_start
            stats["mem/update_peak_rss_gb"] = memory.peak_rss_gb()
            return stats
        stats["actor/update_skipped"] = 0.0
        gen = torch.Generator().manual_seed(self.seed * 100_003 + (step or self.update_count))
        n_rows = pb.mask.shape[0]
        sums: dict[str, float] = {}
        grad_norms: list[float] = []
        losses: list[float] = []
        skipped_nonfinite = 0
        self.model.train()
        trained_tokens = 0
        packed_tokens = 0
        tree_used = False
        for _ in range(a.ppo_epochs):
            perm = torch.randperm(n_rows, generator=gen).tolist()
            n_mb = min(a.ppo_n_minibatches, n_rows)
            for mb_rows in (perm[i::n_mb] for i in range(n_mb)):
                mb_tokens = int(pb.mask[mb_rows].sum())
                if mb_tokens == 0:
                    continue
                self.optimizer.zero_grad(set_to_none=True)
                mb_loss = 0.0
                plan = self.plan_micro_batches(pb.input_ids, pb.lengths, mb_rows)
                packed_tokens += plan.computed_tokens
                tree_used = tree_used or plan.tree
                for micro in plan.groups:
                    loss_sum, diag = self._micro_loss(pb, micro, tree=plan.tree)
                    (loss_sum / mb_tokens).backward()
                    mb_loss += float(loss_sum.detach()) / mb_tokens
                    for k, v in diag.items():
                        sums[k] = sums.get(k, 0.0) + v
                gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), a.max_grad_norm)
                gnorm_f = float(gnorm)
                if not math.isfinite(gnorm_f):
                    skipped_nonfinite += 1
                    logger.warning("non-finite grad norm (%s): optimiser step skipped", gnorm_f)
                    self.optimizer.zero_grad(set_to_none=True)
                    continue
                self.optimizer.step()
                grad_norms.append(gnorm_f)
                losses.append(mb_loss)
                trained_tokens += sum(pb.lengths[r] for r in mb_rows)
        self.optimizer.zero_grad(set_to_none=True)
        self.update_count += 1
        denom = max(sums.get("n", 0.0), 1.0)
        elapsed = time.perf_counter() - t_start
        stats.update(
            {
                "actor/loss": sum(losses) / max(len(losses), 1),
                "actor/clip_frac": sums.get("clipped", 0.0) / denom,
                "actor/approx_kl": sums.get("approx_kl", 0.0) / denom,
                "actor/ratio_mean": sums.get("ratio", 0.0) / denom,
                "actor/entropy": sums.get("entropy", 0.0) / denom,
                "actor/grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
                "actor/optimizer_steps": float(len(grad_norms)),
                "actor/nonfinite_skipped": float(skipped_nonfinite),
                "actor/lr": a.lr,
                "time/update_s": elapsed,
                "perf/train_tokens_per_s": trained_tokens / elapsed if elapsed > 0 else 0.0,
                "actor/tree_packed": float(tree_used),
                "actor/computed_tokens": float(packed_tokens),
                "actor/token_sharing": trained_tokens / packed_tokens if packed_tokens else 1.0,
                "mem/update_peak_rss_gb": memory.peak_rss_gb(),
            }
        )
        if "ref_kl" in sums:
            stats["actor/ref_kl"] = sums["ref_kl"] / denom
        if "behav_imp_weight" in sums:
            stats["actor/behav_imp_weight"] = sums["behav_imp_weight"] / denom
        return stats

    def _micro_loss(
        self, pb: PreparedBatch, rows: list[int], *, tree: bool = False
    ) -> tuple[torch.Tensor, dict[str, float]]:
        a = self.cfg
        width = max(pb.lengths[r] for r in rows)
        idx = torch.tensor(rows)
        m = pb.mask[idx, :width]
        if not m.any():
            return torch.zeros((), requires_grad=True), {}
        dev = self.device
        if tree:
            logp, ent = self._tree_logprobs(
                self.model,
                pb.input_ids,
                pb.mask,
                pb.lengths,
                rows,
                with_entropy=True,
                entropy_grad=a.entropy_coef != 0,
            )
        else:
            logp, ent = token_logprobs(
                self.model,
                pb.input_ids[idx, :width].to(dev),
                pb.attention_mask[idx, :width].to(dev),
                m.to(dev),
                self.temperature,
                with_entropy=True,
                entropy_grad=a.entropy_coef != 0,
            )
        sel = m
        old = pb.old_logp[idx, :width][sel].to(dev)
        adv = pb.adv[idx, :width][sel].to(dev)
        behav = None
        if a.use_decoupled_loss:
            behav = pb.behav_logp[idx, :width][sel].to(dev)
        ref = pb.ref_logp[idx, :width][sel].to(dev) if pb.ref_logp is not None else None
        loss, diag = ppo_token_loss(
            logp,
            old,
            adv,
            eps_clip=a.eps_clip,
            eps_clip_high=a.eps_clip_high,
            behav_logp=behav,
            behav_imp_weight_cap=a.behav_imp_weight_cap,
            ref_logp=ref,
            kl_coef=a.kl_coef,
            entropy=ent,
            entropy_coef=a.entropy_coef,
        )
        out = {k: float(v.sum()) for k, v in diag.items()}
        out["entropy"] = float(ent.detach().sum()) if ent is not None else 0.0
        out["n"] = float(logp.numel())
        return loss.sum(), out

    # -- weights ----------------------------------------------------------------------------

    def state_dict_for_engine(self) -> dict[str, torch.Tensor]:
        """A detached copy of the weights (the engine must never alias the tensors the optimiser
        keeps changing)."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def _enable_checkpointing(model: torch.nn.Module) -> None:
    """Activation (gradient) checkpointing, non-reentrant, across transformers versions."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _row_lengths(attn: torch.Tensor) -> list[int]:
    """Valid length of each right-padded row (index of the last attended token + 1)."""
    attn = attn.bool()
    pos = torch.arange(attn.shape[1]).expand_as(attn)
    last = torch.where(attn, pos, torch.full_like(pos, -1)).max(dim=1).values
    return [max(int(x) + 1, 1) for x in last]


__all__ = [
    "PPOActor",
    "ppo_token_loss",
    "token_logprobs",
    "micro_batches",
    "scored_mask",
]
