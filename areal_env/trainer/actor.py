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
from pathlib import Path
from typing import Any

import torch

from areal_env.api.config import ActorConfig, ConfigError, LoraConfig, ModelConfig
from areal_env.trainer import memory
from areal_env.trainer.advantages import group_advantages, shape_rewards, token_advantages
from areal_env.trainer.dist import (
    SINGLE,
    DistContext,
    all_reduce_sums,
    all_reduce_tensor,
    full_state_dict,
    init_distributed,
    micro_batches,
    padded_micro_batches,
    shard_model,
    split_rows,
    to_local_float,
)
from areal_env.trainer.tree import (
    pack_rows,
    packed_size,
    tree_logits,
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


def scored_logits(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    sel_next: torch.Tensor,
) -> torch.Tensor:
    """Logits at the positions ``sel_next`` [B, L-1] selects (position p predicts token p+1).

    For plain-head models only the selected positions go through the LM head. A LoRA
    (``peft``) wrapper is looked through; a sharded (FSDP) model runs this as a registered
    forward method (see ``install_scored_forward``) so its root parameters are gathered.
    """
    fn = getattr(model, "areal_scored_logits", None)
    if fn is not None:
        return fn(input_ids, attention_mask, sel_next)
    return _scored_logits_impl(model, input_ids, attention_mask, sel_next)


def _scored_logits_impl(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    sel_next: torch.Tensor,
) -> torch.Tensor:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if type(inner).__name__ in _PLAIN_HEAD_MODELS:
        hidden = inner.get_decoder()(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        )[0]
        return inner.get_output_embeddings()(hidden[:, :-1][sel_next])
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return out.logits[:, :-1][sel_next]


def install_scored_forward(model: Any) -> None:
    """Make ``scored_logits`` a forward method of ``model`` that FSDP hooks: the root's sharded
    parameters (embeddings, final norm, LM head) are gathered before it runs and its gradients
    reduced after, exactly as for ``forward``."""
    import types

    from torch.distributed.fsdp import register_fsdp_forward_method

    model.areal_scored_logits = types.MethodType(_scored_logits_impl, model)  # type: ignore[assignment]
    register_fsdp_forward_method(model, "areal_scored_logits")
    model.areal_tree_logits = types.MethodType(tree_logits, model)  # type: ignore[assignment]
    register_fsdp_forward_method(model, "areal_tree_logits")


def _plain_head(model: Any) -> bool:
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (and entropies) of the tokens selected by ``mask`` [B, L], flattened in row-major
    order, under ``softmax(logits / temperature)`` — the distribution the sampler drew from.

    ``temperature``: one number, or a [B, L] tensor giving each token's own (the temperature
    its logprob was recorded at; ``proxy.sampling: agent`` lets it differ per row)."""
    sel_next = mask[:, 1:]  # position p predicts token p+1
    targets = input_ids[:, 1:][sel_next]
    logits = scored_logits(model, input_ids, attention_mask, sel_next)
    logits = logits.float()
    if isinstance(temperature, torch.Tensor):
        temps = temperature.to(logits.device)[:, 1:][sel_next].float()
        if bool((temps != 1.0).any()):
            logits = logits / temps.clamp_min(1e-6).unsqueeze(-1)
    elif temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            probs = torch.softmax(logits, dim=-1)
            entropy = lse - (probs * logits).sum(-1)
    return logp, entropy


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
        memory.tune_allocator()  # freed step memory must leave the process: see memory.py
        self.cfg = actor
        self.model_cfg = model_cfg or ModelConfig()
        self.temperature = float(actor.temperature or temperature or 1.0)
        self.seed = seed
        self.dist: DistContext = SINGLE
        if actor.strategy == "fsdp":
            self.dist = init_distributed(self.model_cfg.device)
            self.device = self.dist.device
        else:
            self.device = resolve_device(self.model_cfg.device)
        self.dtype = resolve_dtype(self.model_cfg.dtype, self.device)
        # FSDP keeps fp32 master weights and computes in bf16 on GPU (mixed precision).
        self.mixed_precision = actor.strategy == "fsdp" and self.dtype != torch.float32
        self.model_path = model_path
        self.model: Any = self._load(model_path, trainable=True)
        self.tree_unsupported = tree_supported(self.model)
        if actor.tree_training == "on" and self.tree_unsupported:
            raise ConfigError(
                f"actor.tree_training=on, but {self.tree_unsupported}; set it to auto or off"
            )
        self.ref_model = None
        if actor.kl_coef > 0:
            self.ref_model = self._load(model_path, trainable=False)
        params = [p for p in self.model.parameters() if p.requires_grad]
        kwargs: dict[str, Any] = {}
        if actor.strategy == "single" and self.device.type in ("cpu", "cuda"):
            kwargs["fused"] = True
        try:
            self.optimizer = torch.optim.AdamW(
                params,
                lr=actor.lr,
                betas=(actor.adam_betas[0], actor.adam_betas[1]),
                weight_decay=actor.weight_decay,
                **kwargs,
            )
        except (RuntimeError, TypeError):  # fused unsupported for this device/dtype
            self.optimizer = torch.optim.AdamW(
                params,
                lr=actor.lr,
                betas=(actor.adam_betas[0], actor.adam_betas[1]),
                weight_decay=actor.weight_decay,
            )
        self.update_count = 0
        self._warned_temp = False

    def _load(self, model_path: str, *, trainable: bool) -> torch.nn.Module:
        """Load the model; wrap it with LoRA adapters and FSDP2 as the config says."""
        from transformers import AutoModelForCausalLM

        load_dtype = torch.float32 if self.mixed_precision else self.dtype
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=load_dtype)
        model.config.use_cache = False
        if trainable and self.cfg.lora is not None:
            model = apply_lora(model, self.cfg.lora)
        if not self.cfg.fsdp_cpu_offload or self.cfg.strategy != "fsdp":
            model = model.to(self.device)
        if trainable:
            if self.model_cfg.gradient_checkpointing:
                _enable_checkpointing(model)
            model.train()
        else:
            model.eval().requires_grad_(False)
        if self.cfg.strategy == "fsdp":
            shard_model(
                model,
                mixed_precision=self.mixed_precision,
                cpu_offload=self.cfg.fsdp_cpu_offload,
            )
            install_scored_forward(model)
        return model

    # -- logprobs ---------------------------------------------------------------------------

    @torch.no_grad()
    def compute_logprobs(
        self, batch: dict[str, torch.Tensor], model: Any | None = None
    ) -> torch.Tensor:
        """Recompute logprobs [B, L] of the scored tokens at the sampling temperature (0
        elsewhere), in token-bounded micro-batches."""
        model = model or self.model
        input_ids = batch["input_ids"].to(self.device)
        attn = batch["attention_mask"].to(self.device).bool()
        mask = scored_mask(batch).to(self.device)
        lengths = _row_lengths(attn)
        temps = self.row_temperatures(batch)
        out = torch.zeros(input_ids.shape, dtype=torch.float32, device=self.device)
        rows = list(range(len(lengths)))
        groups, tree, _ = self.rank_micro_batches(batch["input_ids"], lengths, rows)
        for mb in groups:
            if mb is None:  # this rank has no rows left: keep the collectives in step
                token_logprobs(
                    model, input_ids[:1, :2], attn[:1, :2], _first_token_mask(2).to(self.device)
                )
                continue
            idx = torch.tensor(mb, device=self.device)
            width = max(lengths[r] for r in mb)
            m = mask[idx, :width]
            if not m.any() and not self.dist.distributed:
                continue
            t_one = _single_temperature(temps, mb, mask, self.temperature)
            if tree and t_one is not None:
                lp, _ = self._tree_logprobs(model, input_ids, mask, lengths, mb, temperature=t_one)
            else:  # flat, or a tree group whose rows were sampled at different temperatures
                t = temps[idx.cpu(), :width] if isinstance(temps, torch.Tensor) else temps
                lp, _ = token_logprobs(model, input_ids[idx, :width], attn[idx, :width], m, t)
            sub = torch.zeros(m.shape, dtype=torch.float32, device=self.device)
            sub[m] = lp.float()
            out[idx, :width] = sub
        out = all_reduce_tensor(out, self.dist)  # each row was scored on exactly one rank
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

    def rank_micro_batches(
        self, input_ids: torch.Tensor, lengths: list[int], rows: list[int]
    ) -> tuple[list[list[int] | None], bool, int]:
        """This rank's micro-batches of ``rows``, whether they are tree-packed, and the tokens
        all ranks compute (trie nodes when packed).

        One process: :meth:`plan_micro_batches` of all rows. Sharded: the rows are split across
        ranks by token count (``split_rows``, as for flat micro-batches) and each rank packs its
        own share; every rank plans every share (all hold the whole batch), so they agree on the
        packing decision and pad to the same number of passes with ``None`` (FSDP's collectives
        run once per pass). The loss normalisation does not depend on the packing.
        """
        if not self.dist.distributed:
            plan = self.plan_micro_batches(input_ids, lengths, rows)
            return list(plan.groups), plan.tree, plan.computed_tokens
        shares = split_rows(rows, lengths, self.dist.world_size)
        plans = [self.plan_micro_batches(input_ids, lengths, s) if s else None for s in shares]
        # one decision for all ranks: pack when every rank with rows would
        tree = all(p.tree for p in plans if p is not None)
        if not tree:
            mbs = padded_micro_batches(rows, lengths, self.cfg.micro_batch_tokens, self.dist)
            return mbs, False, sum(lengths[r] for r in rows)
        n = max(len(p.groups) if p else 0 for p in plans)
        mine = plans[self.dist.rank]
        groups: list[list[int] | None] = list(mine.groups) if mine else []
        computed = sum(p.computed_tokens for p in plans if p is not None)
        return groups + [None] * (n - len(groups)), True, computed

    def _tree_logprobs(
        self,
        model: Any,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        lengths: list[int],
        rows: list[int],
        *,
        temperature: float | None = None,
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
            self.temperature if temperature is None else temperature,
            plain_head=_plain_head(model),
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
        )

    def row_temperatures(self, batch: dict[str, Any]) -> torch.Tensor | float:
        """The temperature to recompute each token's logprob at.

        Rows exported by the proxy say what their logprobs were sampled at (``temperatures``,
        [B, L]; see ``proxy.sampling``): recomputing at any other temperature would give a wrong
        PPO ratio, so the rows win. Rows without it use ``actor.temperature`` (default:
        ``gconfig.temperature``).
        """
        temps = batch.get("temperatures")
        if not isinstance(temps, torch.Tensor):
            return self.temperature
        temps = temps.float().cpu()
        mask = scored_mask(batch)
        scored = temps[mask.bool()] if mask.any() else temps.flatten()[:0]
        if scored.numel() and bool((scored != self.temperature).any()) and not self._warned_temp:
            self._warned_temp = True
            logger.warning(
                "some rows were sampled at temperature(s) %s, not the trainer's %s: their "
                "logprobs are recomputed at their own temperature (proxy.sampling=agent)",
                sorted({round(float(x), 4) for x in scored.unique()[:8]}),
                self.temperature,
            )
        return temps

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
            temps=self.row_temperatures(batch),
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
        if self.dist.distributed:
            stats["dist/world_size"] = float(self.dist.world_size)
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
        local_rows = 0  # rows this rank trained on (all of them on one rank)
        for _ in range(a.ppo_epochs):
            perm = torch.randperm(n_rows, generator=gen).tolist()
            n_mb = min(a.ppo_n_minibatches, n_rows)
            for mb_rows in (perm[i::n_mb] for i in range(n_mb)):
                mb_tokens = int(pb.mask[mb_rows].sum())
                if mb_tokens == 0:
                    continue
                self.optimizer.zero_grad(set_to_none=True)
                mb_loss = 0.0
                # Each rank takes its token-balanced share of the minibatch; the loss is divided
                # by the minibatch's global token count and multiplied by the world size because
                # FSDP averages gradients over ranks: the reduced gradient is the 1-rank one.
                scale = self.dist.world_size / mb_tokens
                micros, tree, computed = self.rank_micro_batches(pb.input_ids, pb.lengths, mb_rows)
                packed_tokens += computed
                tree_used = tree_used or tree
                for i, micro in enumerate(micros):
                    _set_gradient_sync(self.model, i == len(micros) - 1)
                    if micro is None:  # padding: same passes on every rank, zero gradient
                        loss_sum, _ = self._micro_loss(pb, mb_rows[:1], force=True)
                        (loss_sum * 0.0).backward()
                        continue
                    loss_sum, diag = self._micro_loss(
                        pb, micro, tree=tree, force=self.dist.distributed
                    )
                    local_rows += len(micro)
                    (loss_sum * scale).backward()
                    mb_loss += float(loss_sum.detach()) / mb_tokens
                    for k, v in diag.items():
                        sums[k] = sums.get(k, 0.0) + v
                mb_loss = all_reduce_sums({"loss": mb_loss}, self.dist)["loss"]
                gnorm = torch.nn.utils.clip_grad_norm_(
                    [p for p in self.model.parameters() if p.requires_grad], a.max_grad_norm
                )
                gnorm_f = to_local_float(gnorm)
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
        if self.dist.distributed:
            keys = ("n", "clipped", "approx_kl", "ratio", "entropy", "ref_kl", "behav_imp_weight")
            present = {k: sums.get(k, 0.0) for k in keys}
            reduced = all_reduce_sums(present, self.dist)
            sums = {k: v for k, v in reduced.items() if k in sums or k in ("n",) or v != 0.0}
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
        if self.dist.distributed:
            stats["dist/rank0_rows"] = float(local_rows)  # rank 0 logs: its share of the rows
        if "ref_kl" in sums:
            stats["actor/ref_kl"] = sums["ref_kl"] / denom
        if "behav_imp_weight" in sums:
            stats["actor/behav_imp_weight"] = sums["behav_imp_weight"] / denom
        return stats

    def _micro_loss(
        self, pb: PreparedBatch, rows: list[int], *, tree: bool = False, force: bool = False
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Summed token loss of ``rows``. ``force``: run the model even when no token is scored
        (a sharded model's collectives need the same passes on every rank)."""
        a = self.cfg
        width = max(pb.lengths[r] for r in rows)
        idx = torch.tensor(rows)
        m = pb.mask[idx, :width]
        if not m.any():
            if not force:
                return torch.zeros((), requires_grad=True), {}
            m = _first_token_mask(width).expand(len(rows), -1)
            logp, _ = token_logprobs(
                self.model,
                pb.input_ids[idx, :width].to(self.device),
                pb.attention_mask[idx, :width].to(self.device),
                m.to(self.device),
                self.temperature,
            )
            return logp.sum() * 0.0, {}
        dev = self.device
        t_one = _single_temperature(pb.temps, rows, pb.mask, self.temperature)
        if tree and t_one is not None:
            logp, ent = self._tree_logprobs(
                self.model,
                pb.input_ids,
                pb.mask,
                pb.lengths,
                rows,
                temperature=t_one,
                with_entropy=True,
                entropy_grad=a.entropy_coef != 0,
            )
        else:
            logp, ent = token_logprobs(
                self.model,
                pb.input_ids[idx, :width].to(dev),
                pb.attention_mask[idx, :width].to(dev),
                m.to(dev),
                pb.temps[idx, :width] if isinstance(pb.temps, torch.Tensor) else pb.temps,
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
        """A detached CPU copy of the full weights (the engine must never alias the tensors the
        optimiser keeps changing). Collective under FSDP: every rank calls it, rank 0 gets the
        weights, the others an empty dict. With LoRA: the merged weights (base + adapter)."""
        if self.cfg.lora is not None:
            return merged_lora_state_dict(self.model, self.dist)
        return full_state_dict(self.model)

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The trainable (LoRA adapter) weights only, full on rank 0 (collective under FSDP)."""
        return full_state_dict(self.model, trainable_only=True)

    def export_hf(self, folder: Path) -> int:
        """Write the full model (LoRA merged in) as an HF folder; with LoRA also the adapter
        alone under ``folder/adapter``. Collective under FSDP; rank 0 writes. Returns the bytes
        written on rank 0 (0 elsewhere)."""
        sd = self.state_dict_for_engine()
        adapter = self.adapter_state_dict() if self.cfg.lora is not None else None
        if not self.dist.is_main:
            return 0
        folder = Path(folder)
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        base.save_pretrained(str(folder), state_dict=sd, safe_serialization=True)
        if adapter is not None:
            self.save_adapter(folder / "adapter", adapter)
        return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())

    def save_adapter(self, folder: Path, adapter: dict[str, torch.Tensor] | None = None) -> int:
        """Write the LoRA adapter (peft layout: adapter_model.safetensors + adapter_config.json)
        and return its size in bytes. Collective under FSDP when ``adapter`` is not given."""
        from areal_env.engine.lora import save_adapter_folder

        if adapter is None:
            adapter = self.adapter_state_dict()
        if not self.dist.is_main:
            return 0
        pcfg = self.model.peft_config["default"].to_dict()
        pcfg["base_model_name_or_path"] = self.model_path
        return save_adapter_folder(folder, adapter, pcfg)


def _enable_checkpointing(model: Any) -> None:
    """Activation (gradient) checkpointing, non-reentrant, across transformers versions."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _set_gradient_sync(model: Any, sync: bool) -> None:
    """Under FSDP reduce gradients only after the last micro-batch of a minibatch."""
    fn = getattr(model, "set_requires_gradient_sync", None)
    if fn is not None:
        fn(sync)


def _first_token_mask(width: int) -> torch.Tensor:
    """A [1, width] mask scoring only position 1: a minimal pass for padding micro-batches."""
    m = torch.zeros(1, width, dtype=torch.bool)
    m[0, min(1, width - 1)] = True
    return m


def apply_lora(model: Any, lora: LoraConfig) -> torch.nn.Module:
    """Wrap ``model`` with ``peft`` LoRA adapters; only the adapters stay trainable."""
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
    except ImportError as e:  # pragma: no cover - peft is a dependency
        raise RuntimeError("actor.lora needs the `peft` package: pip install peft") from e
    cfg = PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    wrapped = get_peft_model(model, cfg)
    n_train = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    n_all = sum(p.numel() for p in wrapped.parameters())
    logger.info(
        "LoRA: %d of %d parameters trainable (%.2f%%)", n_train, n_all, 100 * n_train / n_all
    )
    return wrapped


def merged_lora_state_dict(model: Any, ctx: DistContext) -> dict[str, torch.Tensor]:
    """Base weights with the adapters merged in, under the base model's own names (what a
    server without LoRA support loads). Collective under FSDP; rank 0 gets the weights."""
    full = full_state_dict(model)
    if not full:
        return {}
    from areal_env.engine.lora import merge_lora_weights

    return merge_lora_weights(full, model.peft_config["default"])


def _single_temperature(
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
