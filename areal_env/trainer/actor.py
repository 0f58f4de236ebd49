"""The policy being trained: logprob recompute, PPO loss and the optimiser step.

A batch is the executor's right-padded tensor dict: ``input_ids`` [B, L], ``attention_mask``,
``loss_mask``, ``logprobs`` (behaviour logprobs, aligned with the token they score, 0 on the
prompt), ``versions``, ``rewards`` [B], and optionally ``group_ids`` / ``traj_ids`` [B].

Masks come only from ``attention_mask`` / ``loss_mask``, never from pad ids (for SmolLM2 the pad
token is also the eos token, which the model does generate and must be trained on).

The loss math lives in ``actor_math``, the LoRA / checkpointing / FSDP-sync helpers in
``actor_lora``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.profiler import record_function

from areal_env.api.config import ActorConfig, ConfigError, LoraConfig, ModelConfig
from areal_env.engine.models import load_causal_lm
from areal_env.trainer import memory
from areal_env.trainer.actor_lora import (
    apply_lora,
    enable_checkpointing,
    freeze_lowest_layers,
    merged_lora_state_dict,
    set_gradient_sync,
)
from areal_env.trainer.actor_math import (
    MicroBatchPlan,
    PreparedBatch,
    UpdateTally,
    first_token_mask,
    has_plain_head,
    high_entropy_mask,
    install_scored_forward,
    minibatch_rows,
    optimizer_steps_taken,
    ppo_token_loss,
    resolve_device,
    resolve_dtype,
    row_lengths,
    scored_mask,
    single_temperature,
    summarize_update,
    token_logprobs,
    warmup_lr,
)
from areal_env.trainer.advantages import (
    group_advantages,
    shape_rewards,
    token_advantages,
    weight_negatives_by_prob,
)
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
from areal_env.trainer.precision import Precision
from areal_env.trainer.tree import (
    pack_rows,
    packed_size,
    tree_micro_batches,
    tree_supported,
    tree_token_logprobs,
)
from areal_env.trainer.tree_attention import enable_tree_attention, flex_probe, tree_kernel

if TYPE_CHECKING:
    from areal_env.trainer.token_record import UpdateTrace

logger = logging.getLogger(__name__)


class PPOActor:
    """Owns the trainer's copy of the policy (separate from the inference engine's), the
    optimiser and, when ``kl_coef > 0``, a frozen reference copy.

    Several LoRA policies on one base model share one model with a named adapter each (a
    multi-agent run's ``policies:``): the first actor loads it with every adapter in
    ``adapters`` (FSDP shards it once, adapters included), the others pass ``share=`` that
    actor. Each actor trains only its own ``adapter`` (peft's active adapter while it runs; its
    optimiser holds that adapter's parameters alone), so one policy's update leaves every
    other adapter's tensors bitwise as they were.
    """

    def __init__(
        self,
        model_path: str,
        actor: ActorConfig,
        model_cfg: ModelConfig | None = None,
        *,
        temperature: float = 1.0,
        seed: int = 1,
        adapter: str = "default",
        adapters: Mapping[str, LoraConfig] | None = None,
        share: PPOActor | None = None,
        engine_dtype: str | None = None,
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
        # fp32 master weights and optimiser states, compute in model.dtype, weights handed to
        # the engine in engine.dtype (precision.py)
        self.precision = Precision(
            resolve_dtype(self.model_cfg.dtype, self.device),
            self.device,
            strategy=actor.strategy,
            lossy=actor.lossy_low_precision_weights,
            # None: the engine serves in model.dtype (callers pass EngineConfig.served_dtype)
            engine=resolve_dtype(engine_dtype or self.model_cfg.dtype, self.device),
        )
        self.tree_kernel = tree_kernel(actor.tree_attention, self.device)
        self.model_path = model_path
        self.adapter = adapter
        """This actor's LoRA adapter in ``model`` (peft's name; ``default`` for one policy)."""
        if share is not None:
            self.adapters: dict[str, LoraConfig] = dict(share.adapters)
            self.model: Any = share.model
        else:
            self.adapters = dict(adapters or ({adapter: actor.lora} if actor.lora else {}))
            if actor.frozen_layers and len(self.adapters) > 1:
                # peft's set_adapter turns requires_grad back on for the active adapter in
                # every layer, so a shared model cannot keep its lower layers frozen
                raise ConfigError(
                    f"actor.frozen_layers={actor.frozen_layers} needs a model of its own, but "
                    f"{len(self.adapters)} adapter policies share this one; set "
                    "actor.frozen_layers=0"
                )
            self.model = self._load(model_path, trainable=True)
        self.tree_unsupported = tree_supported(self.model)
        if self.tree_kernel == "flex" and actor.tree_training != "off":
            self._check_flex()
        if actor.tree_training == "on" and self.tree_unsupported:
            raise ConfigError(
                f"actor.tree_training=on, but {self.tree_unsupported}; set it to auto or off"
            )
        if actor.tree_training != "off" and not self.tree_unsupported and share is None:
            # tree attention kernels instead of the dense N^2 mask (tree_attention.py); every
            # call without a packed tree runs plain sdpa
            base = getattr(self.model, "get_base_model", None)  # a LoRA (peft) wrapper
            enable_tree_attention(base() if callable(base) else self.model)
        self.ref_model: Any = share.ref_model if share is not None else None
        if actor.kl_coef > 0 and self.ref_model is None:
            self.ref_model = self._load(model_path, trainable=False)
            if actor.tree_training != "off" and not self.tree_unsupported:
                # the reference scores the same packed trees: without the kernels its forward
                # built the dense [N, N] mask and attended over all of it (2x the attention)
                enable_tree_attention(self.ref_model)
        self.activate()
        params = [p for p in self.model.parameters() if p.requires_grad]
        kwargs: dict[str, Any] = {}
        if actor.strategy == "single" and self.device.type in ("cpu", "cuda"):
            kwargs["fused"] = True
        try:
            self.optimizer = torch.optim.AdamW(
                params,
                lr=actor.lr,
                betas=(actor.adam_betas[0], actor.adam_betas[1]),
                eps=actor.adam_eps,
                weight_decay=actor.weight_decay,
                **kwargs,
            )
        except (RuntimeError, TypeError):  # fused unsupported for this device/dtype
            self.optimizer = torch.optim.AdamW(
                params,
                lr=actor.lr,
                betas=(actor.adam_betas[0], actor.adam_betas[1]),
                eps=actor.adam_eps,
                weight_decay=actor.weight_decay,
            )
        self.update_count = 0
        self.training_state_released = False
        """Set by :meth:`release_training_state`: no update may follow."""
        self._warned_temp = False
        self.trace: UpdateTrace | None = None
        """The token record's hook (``rollout.dump_to_file``, rank 0): sees each update's
        prepared batch and every micro-batch's logprobs and clip flags. Never changes them."""

    def _check_flex(self) -> None:
        """Compile and run FlexAttention once for this model's heads; with ``tree_attention:
        auto`` a failure falls back to the sdpa kernels (with a warning), with ``flex`` it is
        an error."""
        cfg = self.model.config
        heads = int(cfg.num_attention_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        why = flex_probe(self.device, heads, kv_heads, head_dim, self.precision.compute)
        if why is None:
            return
        if self.cfg.tree_attention == "flex":
            raise RuntimeError(
                f"actor.tree_attention=flex, but FlexAttention fails on {self.device}: {why}; "
                "set actor.tree_attention=auto or sdpa"
            )
        logger.warning("FlexAttention fails here (%s): tree attention runs on sdpa", why)
        self.tree_kernel = "sdpa"

    def _load(self, model_path: str, *, trainable: bool) -> torch.nn.Module:
        """Load the model; wrap it with LoRA adapters and FSDP2 as the config says."""
        lora = trainable and self.cfg.lora is not None
        # frozen weights need no fp32 master copy: the reference model, and the base under LoRA
        # adapters in one process (FSDP2 shards one dtype per layer: there the base stays fp32)
        frozen = not trainable or (lora and self.cfg.strategy == "single")
        offload = self.cfg.fsdp_cpu_offload and self.cfg.strategy == "fsdp"
        # straight onto the GPU (a 7B model's fp32 copy never passes through host memory)
        where = (
            {"device_map": str(self.device)} if self.device.type == "cuda" and not offload else {}
        )
        dtype = self.precision.load_dtype(frozen=frozen)
        if not trainable and self.cfg.ref_dtype != "auto":
            dtype = resolve_dtype(self.cfg.ref_dtype, self.device)
        model = load_causal_lm(model_path, dtype=dtype, **where)
        model.config.use_cache = False
        if trainable and self.adapters:
            model = apply_lora(model, self.adapters, fp32_adapters=not self.precision.lossy)
        if not offload:
            model = model.to(self.device)
        if trainable:
            if self.model_cfg.gradient_checkpointing:
                enable_checkpointing(model, self.model_cfg.checkpointed_layer_share)
            freeze_lowest_layers(model, self.cfg.frozen_layers)
            model.train()
        else:
            model.eval().requires_grad_(False)
        if self.cfg.strategy == "fsdp":
            shard_model(
                model,
                param_dtype=self.precision.fsdp_param_dtype,
                cpu_offload=self.cfg.fsdp_cpu_offload,
            )
            install_scored_forward(model)
        return model

    @property
    def shares_model(self) -> bool:
        """Other policies' adapters live in this actor's model too."""
        return len(self.adapters) > 1

    def activate(self) -> None:
        """Make this actor's adapter the one that runs and trains (a shared model only)."""
        if self.shares_model:
            self.model.set_adapter(self.adapter)

    def release_training_state(self) -> None:
        """Let go of what only further updates need: the optimiser's moments and the KL
        reference model (the trained weights stay, for evaluation and export).

        Why: the trainer calls it after the run's last update has been checkpointed, before the
        final evaluation, whose KV cache then takes their memory. In the demo (15 frozen
        layers) they are about 0.9 GB, and its final evaluation at 64 episodes at a time peaked
        at 6.37 GB with them kept. :meth:`update` refuses afterwards."""
        self.optimizer.state.clear()  # gradients are already None: every update ends so
        self.ref_model = None
        self.training_state_released = True

    # -- logprobs ---------------------------------------------------------------------------

    @torch.no_grad()
    def compute_logprobs(
        self, batch: dict[str, torch.Tensor], model: Any | None = None
    ) -> torch.Tensor:
        """Recompute logprobs [B, L] of the scored tokens at the sampling temperature (0
        elsewhere), in token-bounded micro-batches."""
        self.activate()
        model = model or self.model
        input_ids = batch["input_ids"].to(self.device)
        attn = batch["attention_mask"].to(self.device).bool()
        mask = scored_mask(batch).to(self.device)
        lengths = row_lengths(attn)
        temps = self.row_temperatures(batch)
        out = torch.zeros(input_ids.shape, dtype=torch.float32, device=self.device)
        rows = list(range(len(lengths)))
        groups, tree, _ = self.rank_micro_batches(batch["input_ids"], lengths, rows)
        for mb in groups:
            if mb is None:  # this rank has no rows left: keep the collectives in step
                with self.precision.context():
                    token_logprobs(
                        model, input_ids[:1, :2], attn[:1, :2], first_token_mask(2).to(self.device)
                    )
                continue
            idx = torch.tensor(mb, device=self.device)
            width = max(lengths[r] for r in mb)
            m = mask[idx, :width]
            if not m.any() and not self.dist.distributed:
                continue
            t_one = single_temperature(temps, mb, mask, self.temperature)
            with self.precision.context():
                if tree and t_one is not None:
                    lp, _ = self._tree_logprobs(model, input_ids, mask, lengths, mb, t_one)
                else:  # flat, or a tree group whose rows were sampled at different temperatures
                    t = temps[idx.cpu(), :width] if isinstance(temps, torch.Tensor) else temps
                    ids, am = input_ids[idx, :width], attn[idx, :width]
                    lp, _ = token_logprobs(
                        model, ids, am, m, t, chunk=self.cfg.logprob_chunk_tokens
                    )
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
        temperature: float,
        *,
        with_entropy: bool = False,
        entropy_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        with record_function("tree/pack"):
            seqs = [input_ids[r, : lengths[r]] for r in rows]
            tree = pack_rows([s.tolist() for s in seqs])
        return tree_token_logprobs(
            model,
            tree,
            [mask[r, : lengths[r]] for r in rows],
            seqs,
            temperature,
            plain_head=has_plain_head(model),
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            kernel=self.tree_kernel,
            chunk=self.cfg.logprob_chunk_tokens,
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

    def prepare(self, batch: dict[str, torch.Tensor], *, score: bool = True) -> PreparedBatch:
        """Advantages, and the logprobs the ratio is taken against (and the reference's).

        ``score=False`` stops after the advantages (``old_logp`` is the behaviour logprobs,
        no reference): :meth:`score` adds the recomputed logprobs later, once it is known that
        the batch will be trained on."""
        a = self.cfg
        batch = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
        mask = scored_mask(batch)
        attn = batch["attention_mask"].bool()
        rewards = shape_rewards(
            batch["rewards"], scaling=a.reward_scaling, bias=a.reward_bias, clip=a.reward_clip
        )
        token_rewards = batch.get("token_rewards")
        token_rewards = (
            shape_rewards(
                token_rewards, scaling=a.reward_scaling, bias=a.reward_bias, clip=a.reward_clip
            )
            if isinstance(token_rewards, torch.Tensor)
            else None
        )
        centred, astats = group_advantages(
            rewards,
            batch.get("group_ids"),
            batch.get("traj_ids"),
            mean_norm=a.group_adv_norm,
            std_norm=a.group_std_norm,
            token_rewards=token_rewards,
        )
        adv = token_advantages(centred, mask, batch_norm=a.batch_adv_norm)
        explored = batch.get("explored")
        n_dropped = 0
        if not a.punish_failed_exploration and isinstance(explored, torch.Tensor):
            drop = explored.bool()[:, None] & (adv < 0)
            n_dropped = int(drop.any(dim=1).sum())
            adv = adv.masked_fill(drop, 0.0)
        behav = batch["logprobs"].float()
        if a.weight_negatives_by_prob:
            adv = weight_negatives_by_prob(adv, behav)
        guided = batch.get("guided")
        imitate = (
            guided.bool() & mask.bool() & (adv > 0)
            if a.guided_nll_coef > 0 and isinstance(guided, torch.Tensor)
            else None
        )
        t0 = time.perf_counter()
        stats: dict[str, float] = {
            "adv/groups": float(astats.n_groups),
            "adv/trajectories": float(astats.n_trajectories),
            "adv/zero_variance_groups": float(astats.zero_variance_groups),
            "adv/shaped_reward_mean": astats.reward_mean,
            "adv/abs_mean": float(adv[mask].abs().mean()) if mask.any() else 0.0,
            "adv/explored_failures_dropped": float(n_dropped),
        }
        if imitate is not None:
            stats["actor/imitated_tokens"] = float(imitate.sum())
        pb = PreparedBatch(
            input_ids=batch["input_ids"].long(),
            attention_mask=attn,
            mask=mask,
            lengths=row_lengths(attn),
            adv=adv,
            behav_logp=behav,
            old_logp=behav,
            ref_logp=None,
            stats=stats,
            temps=self.row_temperatures(batch),
            imitate=imitate,
        )
        stats["time/recompute_s"] = time.perf_counter() - t0
        if score:
            self.score(batch, pb)
            if self.trace is not None:
                self.trace.prepared(batch, pb)
        return pb

    def score(self, batch: dict[str, torch.Tensor], pb: PreparedBatch) -> None:
        """Fill in ``pb``'s recomputed logprobs: the proximal policy's (decoupled loss or
        ``recompute_logprobs``) and the reference's (``kl_coef > 0``)."""
        a = self.cfg
        t0 = time.perf_counter()
        if a.use_decoupled_loss or a.recompute_logprobs:
            pb.old_logp = self.compute_logprobs(batch)
            if pb.mask.any():
                pb.stats["actor/behav_prox_logp_diff"] = float(
                    (pb.old_logp - pb.behav_logp)[pb.mask].abs().mean()
                )
        if self.ref_model is not None:
            pb.ref_logp = self.compute_logprobs(batch, self.ref_model)
        pb.stats["time/recompute_s"] += time.perf_counter() - t0

    # -- update -----------------------------------------------------------------------------

    def update(
        self,
        batch: dict[str, torch.Tensor],
        *,
        step: int | None = None,
        require_signal: bool = False,
    ) -> dict[str, float]:
        """One PPO update (``ppo_epochs`` × ``ppo_n_minibatches`` optimiser steps) on ``batch``.

        A batch whose every advantage is 0 has no policy gradient; it is skipped
        (``actor/update_skipped``), unless a KL or entropy term still has a gradient, and
        ``require_signal`` skips it then too (before any logprob is recomputed): the trainer
        asks for that while it may redraw such a batch (``trainer.redraw_batches_without_signal``).

        Blocking and CPU/GPU heavy: the trainer calls it through ``asyncio.to_thread``.
        """
        if self.training_state_released:
            raise RuntimeError(
                "this actor's optimiser state and KL reference were released after the run's "
                "last step (release_training_state); it cannot update again"
            )
        t_start = time.perf_counter()
        memory.reset_peak()
        self.activate()
        pb = self.prepare(batch, score=False)
        a = self.cfg
        n_tokens = int(pb.mask.sum())
        signal = bool((pb.adv[pb.mask] != 0).any()) if n_tokens else False
        pb.stats["actor/has_signal"] = float(signal)
        regularised = a.kl_coef > 0 or a.entropy_coef > 0
        if n_tokens and (signal or (regularised and not require_signal)):
            self.score(batch, pb)
        if self.trace is not None:
            self.trace.prepared(batch, pb)
        stats = dict(pb.stats)
        stats["actor/scored_tokens"] = float(n_tokens)
        stats["actor/rows"] = float(pb.mask.shape[0])
        if self.dist.distributed:
            stats["dist/world_size"] = float(self.dist.world_size)
        if n_tokens == 0 or (not signal and (require_signal or not regularised)):
            # Every advantage is 0: the PPO gradient is exactly 0, so an optimiser step would only
            # move Adam's moments (or only pull towards the reference). Skip it (and say so).
            stats["actor/update_skipped"] = 1.0
            stats["time/update_s"] = time.perf_counter() - t_start
            stats["mem/update_peak_rss_gb"] = memory.peak_rss_gb()
            return stats
        stats["actor/update_skipped"] = 0.0
        gen = torch.Generator().manual_seed(self.seed * 100_003 + (step or self.update_count))
        group_ids = batch.get("group_ids")
        sums: dict[str, float] = {}
        tally = UpdateTally(t_start=t_start)
        self.model.train()
        for _ in range(a.ppo_epochs):
            minibatches = minibatch_rows(
                a.ppo_n_minibatches,
                pb.lengths,
                group_ids if isinstance(group_ids, torch.Tensor) else None,
                gen,
                by_group=a.minibatch_by_group,
            )
            for mb_rows in minibatches:
                first_mb = not tally.grad_norms and tally.skipped_nonfinite == 0
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
                tally.packed_tokens += computed
                tally.tree_used = tally.tree_used or tree
                for i, micro in enumerate(micros):
                    set_gradient_sync(self.model, i == len(micros) - 1)
                    if micro is None:  # padding: same passes on every rank, zero gradient
                        loss_sum, _ = self._micro_loss(pb, mb_rows[:1], force=True)
                        self.precision.backward(loss_sum * 0.0)
                        continue
                    loss_sum, diag = self._micro_loss(
                        pb, micro, tree=tree, force=self.dist.distributed
                    )
                    tally.local_rows += len(micro)
                    self.precision.backward(loss_sum * scale)
                    mb_loss += float(loss_sum.detach()) / mb_tokens
                    tally.note_micro(diag, first_minibatch=first_mb)
                    for k, v in diag.items():
                        sums[k] = sums.get(k, 0.0) + v
                mb_loss = all_reduce_sums({"loss": mb_loss}, self.dist)["loss"]
                self.precision.unscale(self.optimizer)
                gnorm = torch.nn.utils.clip_grad_norm_(
                    [p for p in self.model.parameters() if p.requires_grad], a.max_grad_norm
                )
                gnorm_f = to_local_float(gnorm)
                if not math.isfinite(gnorm_f):
                    tally.skipped_nonfinite += 1
                    if not self.precision.skip_step():  # (an fp16 overflow lowers the scale)
                        logger.warning("non-finite grad norm (%s): optimiser step skipped", gnorm_f)
                    self.optimizer.zero_grad(set_to_none=True)
                    continue
                if a.lr_warmup_steps > 0:  # otherwise the optimiser's own lr stands
                    lr = warmup_lr(a.lr, optimizer_steps_taken(self.optimizer), a.lr_warmup_steps)
                    for group in self.optimizer.param_groups:
                        group["lr"] = lr
                self.precision.step(self.optimizer)
                tally.grad_norms.append(gnorm_f)
                tally.losses.append(mb_loss)
                tally.trained_tokens += sum(pb.lengths[r] for r in mb_rows)
        self.optimizer.zero_grad(set_to_none=True)
        self.update_count += 1
        lr_now = float(self.optimizer.param_groups[0]["lr"])
        return summarize_update(stats, sums, self.dist, lr=lr_now, tally=tally)

    def _micro_loss(
        self, pb: PreparedBatch, rows: list[int], *, tree: bool = False, force: bool = False
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Summed token loss of ``rows``. ``force``: run the model even when no token is scored
        (a sharded model's collectives need the same passes on every rank)."""
        a = self.cfg
        width = max(pb.lengths[r] for r in rows)
        idx = torch.tensor(rows)
        m = pb.mask[idx, :width]
        dev = self.device
        if not m.any():
            if not force:
                return torch.zeros((), requires_grad=True), {}
            with self.precision.context():
                logp, _ = token_logprobs(
                    self.model,
                    pb.input_ids[idx, :width].to(dev),
                    pb.attention_mask[idx, :width].to(dev),
                    first_token_mask(width).expand(len(rows), -1).to(dev),
                    self.temperature,
                )
            return logp.sum() * 0.0, {}
        t_one = single_temperature(pb.temps, rows, pb.mask, self.temperature)
        with self.precision.context(), record_function("actor/forward"):
            if tree and t_one is not None:
                logp, ent = self._tree_logprobs(
                    self.model,
                    pb.input_ids,
                    pb.mask,
                    pb.lengths,
                    rows,
                    t_one,
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
                    chunk=a.logprob_chunk_tokens,
                )
        sel = m
        old = pb.old_logp[idx, :width][sel].to(dev)
        adv = pb.adv[idx, :width][sel].to(dev)
        kept: torch.Tensor | None = None
        if a.high_entropy_token_share < 1.0 and ent is not None:
            # the threshold is this forward's (a micro-batch; with tree packing usually the whole
            # minibatch): only the forks get the policy gradient, KL and entropy terms stay
            kept = high_entropy_mask(ent, a.high_entropy_token_share)
            adv = adv * kept
        imitated = pb.imitate[idx, :width][sel].to(dev) if pb.imitate is not None else None
        if imitated is not None:  # a demonstration: its NLL below, not the clipped surrogate
            adv = adv.masked_fill(imitated, 0.0)
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
            kl_estimator=a.kl_estimator,
            entropy=ent,
            entropy_coef=a.entropy_coef,
        )
        if imitated is not None:
            loss = loss - a.guided_nll_coef * logp * imitated
        if self.trace is not None:
            self.trace.scored(rows, m, logp, diag["clipped"])
        out = {k: float(v.sum()) for k, v in diag.items()}
        out["log_ratio_max"] = float((logp.detach() - old).abs().max()) if logp.numel() else 0.0
        out["entropy"] = float(ent.detach().sum()) if ent is not None else 0.0
        out["n"] = float(logp.numel())
        if kept is not None:
            out["pg_tokens"] = float(kept.sum())
        return loss.sum(), out

    # -- weights ----------------------------------------------------------------------------

    def state_dict_for_engine(self) -> dict[str, torch.Tensor]:
        """A detached CPU copy of the full weights in the engine's dtype (``engine.dtype``; the
        fp32 master weights stay here), never aliasing the tensors the optimiser keeps changing.
        Collective under FSDP: every rank calls it, rank 0 gets the weights, the others an empty
        dict. With LoRA: the merged weights (base + adapter)."""
        if self.cfg.lora is not None:
            self.activate()
            merged = merged_lora_state_dict(self.model, self.dist, self.adapter)
            return self.precision.for_engine(merged)
        return self.precision.for_engine(full_state_dict(self.model))

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The trainable (LoRA adapter) weights only, full on rank 0 (collective under FSDP)."""
        self.activate()
        return full_state_dict(self.model, trainable_only=True)

    def adapter_config(self) -> dict[str, Any]:
        """This actor's adapter config, as peft writes ``adapter_config.json``."""
        pcfg = self.model.peft_config[self.adapter].to_dict()
        pcfg["base_model_name_or_path"] = self.model_path
        return pcfg

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
        self.precision.mark_folder(folder)
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
        return save_adapter_folder(folder, adapter, self.adapter_config(), self.adapter)
