"""PPO update throughput vs TRL's GRPOTrainer optimisation step, same model/batch/lengths/run.

Both sides get the same fixed synthetic batch (default 8 rows × 256 tokens: 64 prompt + 192
completion tokens, two groups of four with 0/1 rewards) on the same model (the default SmolLM2-135M
unless ``--model``), fp32, gradient checkpointing on, one optimiser step per iteration, no
reference model/KL. What is timed:

- ours: ``PPOActor.update(batch)`` — advantages, micro-batched forward/backward, grad clipping,
  AdamW step (``ppo_n_minibatches=1``, so one optimiser step like TRL's);
- TRL: ``GRPOTrainer.compute_loss`` on a prepared batch (prompt/completion ids+masks,
  advantages) + ``accelerator.backward`` + grad clipping + optimiser step — its training step
  without generation (``training_step`` would trigger generation through ``_prepare_inputs``).

After a warm-up step of each on a 2-row slice, timed iterations alternate between the two so
both see the same machine load; the median iteration time counts.

The agent case (``--case agent``) looks like agent RL on the demo's task: 4 problems x 8 samples,
a shared ~500-token system prompt with the tool schemas, 2-3 turns per episode (model output,
tool result, model output ...) in one row per episode, loss on the model's turns only. The same
batch runs through our update with tree training on (``tree``), with it off (``flat``: padded
row micro-batches) and through TRL's step (its prompt/completion layout, the later turns in the
completion with their loss mask). Throughput counts logical tokens (the rows' lengths), so packing
shows as a speed-up. Each side's peak resident memory is measured too (``/proc`` high-water mark,
reset before each side).

``--case checkpointing`` runs the agent batch through tree updates with all, half and none of
the model's layers checkpointed (``model.checkpointed_layer_share``), alternating: each one's
median update time and peak memory, and ``ckpt_half_vs_all`` / ``ckpt_none_vs_all`` speed-ups.

``--case reference`` times the KL reference's logprob forward on the agent batch three ways,
alternating: fp32 with the dense tree mask (how it ran before the reference got the tree
kernels), fp32 with the kernels, bf16 with the kernels (``actor.ref_dtype: bfloat16``); it
prints ``ref_tree_fp32_vs_dense``, ``ref_tree_bf16_vs_dense``, ``ref_bf16_vs_fp32`` and how far
bf16's logprobs are from fp32's on the batch's random tokens and on text the model sampled.

``--case dtype`` runs the demo's update (``examples/aenv/config_chains.yaml``'s actor: two
minibatches, a bf16 KL reference, all layers checkpointed) on the agent batch in fp32 and under
bf16 autocast over fp32 master weights (``model.dtype: bfloat16``), alternating: ``bf16_vs_fp32``
(median update times), and which bf16 units the CPU has (``cpu_amx_bf16``, ``cpu_avx512_bf16``).

``--case attention`` times the tree attention kernel alone (one layer's forward and backward in
the model's head layout) on the packed minibatches of the demo actor (``--problems 8 --samples
4``: the groups dealt to two minibatches, as ``ppo_n_minibatches=2`` deals them), alternating:
the trunk/segment kernel (a segment per row), its per-task layout of until 2026-11-29 (a copy
kept here as the baseline) and sdpa with the dense ancestor mask: ``segments_vs_tasks``,
``segments_vs_dense``, the scores each computes (``scores_vs_tasks``, ``scores_vs_dense``), and
the same kernels' bf16 forward on the whole batch, as the KL reference runs it
(``reference_segments_vs_tasks``, ``reference_segments_vs_dense``).

``--case allocator --problems 8 --samples 4`` runs the demo actor's update (as ``--case dtype``,
in fp32, with ``--actor-frozen-layers``: 15, make demo's recipe; 0 trains every layer) in child
processes under glibc mmap thresholds of 256 KB (the setting until 2026-11-29),
``memory.MMAP_THRESHOLD_BYTES`` (the default of ``trainer.malloc_mmap_threshold_mb``), 8 MB and
32 MB (make demo's), alternating ``--rounds`` times: each one's median update time, update peak
RSS, page faults and kernel CPU time, and ``<MB>_vs_256k`` (update speed-ups).

``--case minibatches`` runs the demo actor's update with minibatches of whole groups
(``actor.minibatch_by_group``, the default) and of rows dealt at random, alternating: each one's
median update time and computed (trie) tokens, and ``groups_vs_rows``.

``--case kernels`` runs the demo actor's whole update with the tree attention's segment per row
(the library's) and per trunk child (the layout of until 2026-11-29, kept here), alternating on
one actor: ``rows_vs_tasks`` (median update times) and the KL reference's forward within each.

``--case frozen`` runs the demo actor's update with every decoder layer trained and with the
lowest N frozen (``actor.frozen_layers``; ``--frozen-layers 15,20``), alternating:
``frozen_N_vs_all`` (median update times) and the parameters each trains.

``--tokens RUN_DIR [--step N]`` replaces the synthetic agent rows of every agent-shaped case but
``agent`` with the batch a real run trained on at step N (its first recorded step by default),
rebuilt from the run's token records: the demo's real rows are longer (650-940 tokens), their
questions share first words, and a group's samples often share their first turns.

Last line: ``{"tokens_per_s", "trl_tokens_per_s", "vs_trl", ...}`` for the synthetic case and
``{"tree_vs_trl", "tree_vs_flat", "tree_tokens_per_s", "flat_tokens_per_s",
"agent_trl_tokens_per_s", "peak_rss_gb", ...}`` for the agent case (``--case all`` = both).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from areal_env.api.config import ActorConfig, ModelConfig
from areal_env.engine.models import DEFAULT_MODEL, resolve_model_path
from areal_env.trainer import memory
from areal_env.trainer.actor import PPOActor
from areal_env.trainer.actor_lora import enable_checkpointing


def make_batch(rows: int, prompt_len: int, completion_len: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    length = prompt_len + completion_len
    ids = torch.randint(3, min(vocab, 32000), (rows, length), generator=g)
    loss_mask = torch.zeros(rows, length, dtype=torch.int32)
    loss_mask[:, prompt_len:] = 1
    logprobs = torch.where(loss_mask.bool(), -torch.rand(rows, length, generator=g) * 5, 0.0)
    rewards = torch.tensor([float(i % 2) for i in range(rows)])
    return {
        "input_ids": ids,
        "attention_mask": torch.ones(rows, length, dtype=torch.bool),
        "loss_mask": loss_mask,
        "logprobs": logprobs,
        "versions": torch.where(loss_mask.bool(), 0, -1).int(),
        "rewards": rewards,
        "group_ids": torch.arange(rows) // 4,
        "traj_ids": torch.arange(rows),
    }


def empty_batch(
    width: int, rewards: torch.Tensor, group_ids: torch.Tensor
) -> dict[str, torch.Tensor]:
    """A batch of ``len(rewards)`` rows of ``width`` columns, all padding, to be filled in."""
    b = int(rewards.shape[0])
    return {
        "input_ids": torch.zeros(b, width, dtype=torch.long),
        "attention_mask": torch.zeros(b, width, dtype=torch.bool),
        "loss_mask": torch.zeros(b, width, dtype=torch.int32),
        "logprobs": torch.zeros(b, width),
        "versions": torch.full((b, width), -1, dtype=torch.int32),
        "rewards": rewards,
        "group_ids": group_ids,
        "traj_ids": torch.arange(b),
    }


def make_agent_batch(
    vocab: int,
    problems: int = 4,
    samples: int = 8,
    system_len: int = 500,
    task_len: int = 40,
    seed: int = 0,
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Agent-shaped rows (see the module docstring) and each row's prompt length.

    Turn lengths follow the demo's traffic: model turns of 12-40 tokens (a tool call or an
    answer), tool results of 6-16 tokens; 2 or 3 model turns per episode.
    """
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(3, min(vocab, 32000), (n,), generator=g).tolist()

    def between(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    system = rand(system_len)
    rows: list[tuple[list[int], list[int]]] = []
    prompt_lens: list[int] = []
    for _ in range(problems):
        prompt = system + rand(task_len + between(-8, 8))
        for _ in range(samples):
            toks, lm = list(prompt), [0] * len(prompt)
            turns = between(2, 3)
            for t in range(turns):
                out = rand(between(12, 40))
                toks += out
                lm += [1] * len(out)
                if t < turns - 1:
                    tool = rand(between(6, 16))
                    toks += tool
                    lm += [0] * len(tool)
            rows.append((toks, lm))
            prompt_lens.append(len(prompt))
    b, width = len(rows), max(len(t) for t, _ in rows)
    batch = empty_batch(
        width,
        torch.tensor([float((i * 7919) % 3 == 0) for i in range(b)]),
        torch.arange(b) // samples,
    )
    for i, (t, lm) in enumerate(rows):
        n = len(t)
        batch["input_ids"][i, :n] = torch.tensor(t)
        batch["attention_mask"][i, :n] = True
        batch["loss_mask"][i, :n] = torch.tensor(lm, dtype=torch.int32)
    mask = batch["loss_mask"].bool()
    batch["logprobs"] = torch.where(mask, -torch.rand(b, width, generator=g) * 5, 0.0)
    batch["versions"] = torch.where(mask, 0, -1).int()
    return batch, prompt_lens


def recorded_batch(run_dir: str, step: int | None = None) -> dict[str, torch.Tensor]:
    """The batch one step of a real run trained on, rebuilt from its token records
    (``run_dir/tokens``, see docs/viewer.md): the rows' tokens, loss masks, the engine's
    logprobs, rewards and groups. ``step`` None = the run's first recorded step."""
    from areal_env.view.tokens import TokenRecords

    records = TokenRecords(Path(run_dir))
    records.refresh()
    steps = records.steps()
    if not steps:
        raise SystemExit(f"--tokens {run_dir}: no token records there (run_dir/tokens/step-*)")
    step = steps[0] if step is None else step
    if step not in steps:
        raise SystemExit(f"--tokens {run_dir}: no step {step} (recorded: {steps})")
    rows, rewards, groups = [], [], []
    for part in records.parts_of(step):
        for entry in part.sessions:
            for row, meta in zip(records.read_block(part, entry), entry["rows"], strict=True):
                rows.append(row)
                rewards.append(float(meta["reward"]))
                groups.append(int(entry["group"]))
    batch = empty_batch(
        max(len(r.input_ids) for r in rows), torch.tensor(rewards), torch.tensor(groups)
    )
    for i, row in enumerate(rows):
        n = len(row.input_ids)
        scored = torch.from_numpy(row.loss_mask.astype("bool"))
        batch["input_ids"][i, :n] = torch.from_numpy(row.input_ids.astype("int64"))
        batch["attention_mask"][i, :n] = True
        batch["loss_mask"][i, :n] = scored.int()
        batch["logprobs"][i, :n][scored] = torch.from_numpy(row.rollout_logprob.astype("float32"))
        batch["versions"][i, :n][scored] = 0
    return batch


def demo_batch(args, vocab: int) -> dict[str, torch.Tensor]:
    """The batch an agent-shaped case trains on: a recorded step (``--tokens``) or synthetic
    agent rows (``--problems``, ``--samples``, ``--system-len``)."""
    if args.tokens:
        return recorded_batch(args.tokens, args.step)
    return make_agent_batch(vocab, args.problems, args.samples, args.system_len)[0]


def run_minibatch_case(args, model_path: str) -> dict:
    """The demo actor's update with minibatches of whole groups (``actor.minibatch_by_group``,
    the default) and of rows dealt at random, alternating: each one's median update time and
    computed (trie) tokens, and ``groups_vs_rows``."""
    actors = {}
    for by_group in (True, False):
        actor = demo_actor(model_path, args.micro_batch_tokens)
        actor.cfg.minibatch_by_group = by_group
        actors["groups" if by_group else "rows"] = actor
    batch = demo_batch(args, actors["rows"].model.config.vocab_size)
    for actor in actors.values():  # warm-up: allocations, optimiser state
        actor.update(_slice(batch, 4), step=0)
    times: dict[str, list[float]] = {name: [] for name in actors}
    tokens: dict[str, list[float]] = {name: [] for name in actors}
    for it in range(1, args.iters + 1):
        for name, actor in actors.items():
            t0 = time.perf_counter()
            stats = actor.update(batch, step=it)
            times[name].append(time.perf_counter() - t0)
            tokens[name].append(stats["actor/computed_tokens"])
            print(f"iter {it} {name}: {times[name][-1]:.1f} s", file=sys.stderr)
    med = {name: statistics.median(t) for name, t in times.items()}
    return {
        "groups_vs_rows": round(med["rows"] / med["groups"], 3),
        "groups_update_s": round(med["groups"], 2),
        "rows_update_s": round(med["rows"], 2),
        "groups_computed_tokens": statistics.median(tokens["groups"]),
        "rows_computed_tokens": statistics.median(tokens["rows"]),
        "rows": int(batch["input_ids"].shape[0]),
    }


def trl_agent_inputs(batch, prompt_lens: list[int], device):
    """TRL's layout of agent rows: left-padded prompts, right-padded completions (the later turns,
    tool results masked out by the completion mask)."""
    attn = batch["attention_mask"]
    b = attn.shape[0]
    lengths = attn.sum(1).tolist()
    p_w = max(prompt_lens)
    c_w = max(n - p for n, p in zip(lengths, prompt_lens, strict=True))
    prompt_ids = torch.zeros(b, p_w, dtype=torch.long)
    prompt_mask = torch.zeros(b, p_w, dtype=torch.long)
    comp_ids = torch.zeros(b, c_w, dtype=torch.long)
    comp_mask = torch.zeros(b, c_w, dtype=torch.long)
    for i, (n, p) in enumerate(zip(lengths, prompt_lens, strict=True)):
        prompt_ids[i, p_w - p :] = batch["input_ids"][i, :p]
        prompt_mask[i, p_w - p :] = 1
        comp_ids[i, : n - p] = batch["input_ids"][i, p:n]
        comp_mask[i, : n - p] = batch["loss_mask"][i, p:n].long()
    adv = batch["rewards"].clone()
    for gid in batch["group_ids"].unique():
        sel = batch["group_ids"] == gid
        adv[sel] = (adv[sel] - adv[sel].mean()) / (adv[sel].std() + 1e-4)
    return {
        "prompt_ids": prompt_ids.to(device),
        "prompt_mask": prompt_mask.to(device),
        "completion_ids": comp_ids.to(device),
        "completion_mask": comp_mask.to(device),
        "advantages": adv.to(device),
        "num_items_in_batch": comp_mask.sum().to(device),
    }


def _slice(batch: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    return {k: v[:rows] for k, v in batch.items()}


def run_agent_case(args, model_path: str, grad_ckpt: bool) -> dict:
    """Tree vs flat vs TRL on one agent-shaped batch (see the module docstring)."""
    actor = PPOActor(
        model_path,
        ActorConfig(ppo_n_minibatches=1, lr=1e-5, micro_batch_tokens=args.micro_batch_tokens),
        ModelConfig(gradient_checkpointing=grad_ckpt),
    )
    vocab = actor.model.config.vocab_size
    batch, prompt_lens = make_agent_batch(vocab, args.problems, args.samples, args.system_len)
    lengths = batch["attention_mask"].sum(1).tolist()
    logical = int(sum(lengths))
    plan = actor.plan_micro_batches(batch["input_ids"], lengths, list(range(len(lengths))))
    print(
        f"agent batch: {len(lengths)} rows, {logical} tokens, trie {plan.computed_tokens} nodes "
        f"in {len(plan.groups)} packed micro-batches",
        file=sys.stderr,
    )
    try:
        trainer = build_trl(model_path, len(lengths), max(lengths), grad_ckpt)
        trl_in = trl_agent_inputs(batch, prompt_lens, trainer.model.device)
        trl_error = None
    except Exception as e:  # report why, still measure ours
        trainer, trl_in, trl_error = None, None, f"{type(e).__name__}: {e}"
        print(f"TRL unavailable: {trl_error}", file=sys.stderr)

    # warm-up of each side on a slice of one group (allocations, optimiser state)
    warm = _slice(batch, min(4, args.samples))
    for mode in ("on", "off"):
        actor.cfg.tree_training = mode
        actor.update(warm, step=0)
    if trainer is not None:
        trl_step(trainer, trl_agent_inputs(warm, prompt_lens[: len(warm["rewards"])], "cpu"))

    times: dict[str, list[float]] = {"tree": [], "flat": [], "trl": []}
    peaks: dict[str, float] = {}
    for it in range(1, args.iters + 1):
        for side in ("tree", "flat", "trl"):
            if side == "trl" and trainer is None:
                continue
            memory.reset_peak()
            t0 = time.perf_counter()
            if side == "trl":
                trl_step(trainer, trl_in)
            else:
                actor.cfg.tree_training = "on" if side == "tree" else "off"
                stats = actor.update(batch, step=it)
                assert stats["actor/update_skipped"] == 0.0
                assert stats["actor/tree_packed"] == float(side == "tree")
            dt = time.perf_counter() - t0
            times[side].append(dt)
            peaks[side] = max(peaks.get(side, 0.0), memory.peak_rss_gb())
            print(
                f"iter {it} {side}: {dt:.1f} s ({logical / dt:.0f} logical tok/s, "
                f"peak {peaks[side]:.2f} GB)",
                file=sys.stderr,
            )

    def tps(side: str) -> float | None:
        return logical / statistics.median(times[side]) if times[side] else None

    tree, flat, trl = tps("tree"), tps("flat"), tps("trl")
    assert tree is not None and flat is not None
    out = {
        "tree_vs_trl": round(tree / trl, 3) if trl else None,
        "tree_vs_flat": round(tree / flat, 3),
        "tree_tokens_per_s": round(tree, 1),
        "flat_tokens_per_s": round(flat, 1),
        "agent_trl_tokens_per_s": round(trl, 1) if trl else None,
        "agent_rows": len(lengths),
        "agent_logical_tokens": logical,
        "agent_trie_tokens": plan.computed_tokens,
        "tree_peak_rss_gb": round(peaks["tree"], 2),
        "flat_peak_rss_gb": round(peaks["flat"], 2),
        "trl_peak_rss_gb": round(peaks["trl"], 2) if "trl" in peaks else None,
    }
    if trl_error:
        out["agent_trl_error"] = trl_error
    del actor, trainer
    return out


def run_checkpointing_case(args, model_path: str) -> dict:
    """The agent batch through tree updates with all, half and none of the layers checkpointed
    (``model.checkpointed_layer_share`` 1, 0.5, 0), alternating on one model: median update
    time and peak memory of each, and the speed-ups against all layers checkpointed."""
    actor = PPOActor(
        model_path,
        ActorConfig(ppo_n_minibatches=1, lr=1e-5, micro_batch_tokens=args.micro_batch_tokens),
        ModelConfig(gradient_checkpointing=True),
    )
    actor.cfg.tree_training = "on"
    vocab = actor.model.config.vocab_size
    batch = demo_batch(args, vocab)
    lengths = batch["attention_mask"].sum(1).tolist()
    logical = int(sum(lengths))

    def use(share: float) -> None:
        if share > 0:
            enable_checkpointing(actor.model, share)
        else:
            actor.model.gradient_checkpointing_disable()

    shares = (1.0, 0.5, 0.0)
    for share in shares:  # warm-up: allocations, optimiser state
        use(share)
        actor.update(_slice(batch, min(4, args.samples)), step=0)
    times: dict[float, list[float]] = {s: [] for s in shares}
    peaks: dict[float, float] = {}
    for it in range(1, args.iters + 1):
        for share in shares:  # alternate, so each sees the same machine load
            use(share)
            memory.reset_peak()
            t0 = time.perf_counter()
            stats = actor.update(batch, step=it)
            dt = time.perf_counter() - t0
            assert stats["actor/update_skipped"] == 0.0
            times[share].append(dt)
            peaks[share] = max(peaks.get(share, 0.0), memory.peak_rss_gb())
            print(
                f"iter {it} share {share}: {dt:.1f} s ({logical / dt:.0f} logical tok/s, "
                f"peak {peaks[share]:.2f} GB)",
                file=sys.stderr,
            )
    med = {s: statistics.median(t) for s, t in times.items()}
    return {
        "ckpt_half_vs_all": round(med[1.0] / med[0.5], 3),
        "ckpt_none_vs_all": round(med[1.0] / med[0.0], 3),
        "ckpt_all_update_s": round(med[1.0], 2),
        "ckpt_half_update_s": round(med[0.5], 2),
        "ckpt_none_update_s": round(med[0.0], 2),
        "ckpt_all_peak_rss_gb": round(peaks[1.0], 2),
        "ckpt_half_peak_rss_gb": round(peaks[0.5], 2),
        "ckpt_none_peak_rss_gb": round(peaks[0.0], 2),
        "ckpt_logical_tokens": logical,
    }


def run_dtype_case(args, model_path: str) -> dict:
    """The demo's update (``examples/aenv/config_chains.yaml``'s actor: two minibatches, a bf16
    KL reference, tree training, all layers checkpointed) on the agent batch, in fp32 and under
    bf16 autocast over fp32 master weights (``model.dtype: bfloat16``), alternating: each one's
    median update time, and ``bf16_vs_fp32``. bf16 products run faster than fp32 ones on a CPU
    with AMX (``amx_bf16`` in /proc/cpuinfo: a 2-core Xeon, 10.7x on the demo's MLP product) and
    on one with AVX-512 bf16 dot products alone (``avx512_bf16``: a 2-core AMD EPYC, 2.8x); the
    update gained 1.31-1.35x on both, as its attention and element-wise kernels do not."""
    actors = {
        name: demo_actor(model_path, args.micro_batch_tokens, name)
        for name in ("float32", "bfloat16")
    }
    vocab = actors["float32"].model.config.vocab_size
    batch = demo_batch(args, vocab)
    lengths = batch["attention_mask"].sum(1).tolist()
    plan = actors["float32"].plan_micro_batches(
        batch["input_ids"], lengths, list(range(len(lengths)))
    )
    for actor in actors.values():  # warm-up: allocations, optimiser state
        actor.update(_slice(batch, min(4, args.samples)), step=0)
    times: dict[str, list[float]] = {name: [] for name in actors}
    for it in range(1, args.iters + 1):
        for name, actor in actors.items():  # alternate: both see the same machine load
            t0 = time.perf_counter()
            stats = actor.update(batch, step=it)
            dt = time.perf_counter() - t0
            assert stats["actor/update_skipped"] == 0.0
            times[name].append(dt)
            print(f"iter {it} {name}: {dt:.1f} s", file=sys.stderr)
    med = {name: statistics.median(t) for name, t in times.items()}
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text(encoding="utf-8").split() if cpuinfo.exists() else []
    return {
        "bf16_vs_fp32": round(med["float32"] / med["bfloat16"], 3),
        "fp32_update_s": round(med["float32"], 2),
        "bf16_update_s": round(med["bfloat16"], 2),
        "trie_tokens": plan.computed_tokens,
        "cpu_amx_bf16": "amx_bf16" in flags,
        "cpu_avx512_bf16": "avx512_bf16" in flags,
    }


@dataclass
class TaskSegments:
    """The segment layout of until 2026-11-29 (the baseline of ``--case attention``): after the
    trunk, one segment per child of the trunk (the nodes below it: one or more tasks' rows),
    each attending to the whole trunk and, under its tree mask ``own`` [W, W], to itself."""

    trunk: int
    sizes: tuple[int, ...]
    bias: list[torch.Tensor]  # per segment: [1, 1, W, trunk + W] additive

    def to(self, device) -> TaskSegments:
        return TaskSegments(self.trunk, self.sizes, [b.to(device) for b in self.bias])


def task_segment_layout(tree) -> TaskSegments:
    """``TaskSegments`` of a packed trie, built as ``PackedTree.attention_segments`` did."""
    trunk = tree.n_nodes
    for path in tree.paths:  # the prefix every row shares
        off = (path != torch.arange(int(path.numel()))).nonzero()
        trunk = min(trunk, int(off[0]) if off.numel() else int(path.numel()))
    roots: dict[int, list[torch.Tensor]] = {}
    for path in tree.paths:
        if int(path.numel()) > trunk:
            roots.setdefault(int(path[trunk]), []).append(path[trunk:])
    sizes, bias = [], []
    for root in sorted(roots):
        lo, hi = root, int(torch.cat(roots[root]).max()) + 1
        own = torch.zeros((hi - lo, hi - lo), dtype=torch.bool)
        for part in roots[root]:
            qi, ki = torch.tril_indices(part.numel(), part.numel())
            own[(part - lo)[qi], (part - lo)[ki]] = True
        mask = torch.zeros((1, 1, hi - lo, trunk + hi - lo))
        mask[..., trunk:].masked_fill_(~own, torch.finfo(torch.float32).min)
        sizes.append(hi - lo)
        bias.append(mask)
    return TaskSegments(trunk, tuple(sizes), bias)


def task_segment_attention(query, key, value, seg: TaskSegments, scale):
    """The segment kernel as it ran until 2026-11-29: trunk causal, then one sdpa call per
    segment over the trunk's keys and the segment's own, under its tree mask."""
    t = seg.trunk
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sizes = [t, *seg.sizes]
    qs, ks, vs = query.split(sizes, dim=2), key.split(sizes, dim=2), value.split(sizes, dim=2)
    parts = [sdpa(qs[0], ks[0], vs[0], is_causal=True, scale=scale, enable_gqa=True)] if t else []
    for q, k, v, bias in zip(qs[1:], ks[1:], vs[1:], seg.bias, strict=True):
        k, v = torch.cat([ks[0], k], dim=2), torch.cat([vs[0], v], dim=2)
        bias = bias.to(q.dtype)
        parts.append(sdpa(q, k, v, attn_mask=bias, scale=scale, enable_gqa=True))
    return torch.cat(parts, dim=2).transpose(1, 2)


def run_attention_case(args, model_path: str) -> dict:
    """The tree attention kernel alone, on the packed minibatches of the demo actor's update
    (the agent batch's groups dealt to ``ppo_n_minibatches=2`` minibatches, as the actor deals
    them): one layer's forward and backward in the model's head layout, alternating between the
    segment kernel (one row per segment), its per-task layout of until 2026-11-29 and sdpa with
    the dense ancestor mask; then the same three without gradients in bf16 on the whole batch
    (the KL reference's forward)."""
    from transformers import AutoConfig

    from areal_env.trainer.actor_math import minibatch_rows
    from areal_env.trainer.tree import pack_rows
    from areal_env.trainer.tree_attention import segment_tree_attention

    cfg = AutoConfig.from_pretrained(model_path)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = cfg.hidden_size // heads
    batch = demo_batch(args, cfg.vocab_size)
    lengths = batch["attention_mask"].sum(1).tolist()
    rows = [batch["input_ids"][i, :n].tolist() for i, n in enumerate(lengths)]
    minibatches = minibatch_rows(
        2, lengths, batch["group_ids"], torch.Generator().manual_seed(0), by_group=True
    )
    g = torch.Generator().manual_seed(0)

    def inputs_of(trees, dtype, grad):
        out = []
        for tree in trees:
            n = tree.n_nodes
            qkv = [
                torch.randn(1, h, n, head_dim, generator=g).to(dtype).requires_grad_(grad)
                for h in (heads, kv_heads, kv_heads)
            ]
            weight = torch.randn(1, n, heads, head_dim, generator=g).to(dtype)
            # built once per forward and shared by every layer in training: not timed here
            seg = tree.attention_segments()
            extra = {"mask": tree.ancestor_mask()[None, None], "tasks": task_segment_layout(tree)}
            if dtype != torch.float32:
                extra["tasks"].bias = [b.to(dtype) for b in extra["tasks"].bias]
            out.append((seg, extra, qkv, weight))
        return out

    train_trees = [pack_rows([rows[i] for i in sorted(mb)]) for mb in minibatches]
    cases = {
        "train": inputs_of(train_trees, torch.float32, True),
        "reference": inputs_of([pack_rows(rows)], torch.bfloat16, False),
    }
    scale = head_dim**-0.5

    def segments(seg, extra, qkv):
        return segment_tree_attention(*qkv, seg, scale)

    def tasks(seg, extra, qkv):
        return task_segment_attention(*qkv, extra["tasks"], scale)

    def dense(seg, extra, qkv):
        q, k, v = qkv
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=extra["mask"], scale=scale, enable_gqa=True
        ).transpose(1, 2)

    kernels = {"segments": segments, "tasks": tasks, "dense": dense}
    with torch.no_grad():  # the three compute the same attention
        for seg, extra, qkv, _ in cases["train"]:
            ref = dense(seg, extra, qkv)
            for fn in (segments, tasks):
                assert (fn(seg, extra, qkv) - ref).abs().max() < 1e-4
    medians: dict[str, dict[str, float]] = {}
    for case, inputs in cases.items():
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for it in range(args.iters + 1):  # the first round warms up
            for name, fn in kernels.items():
                t0 = time.perf_counter()
                for seg, extra, qkv, weight in inputs:
                    if case == "train":
                        (fn(seg, extra, qkv) * weight).sum().backward()
                    else:
                        with torch.no_grad():
                            fn(seg, extra, qkv)
                if it:
                    times[name].append(time.perf_counter() - t0)
        medians[case] = {name: statistics.median(ts) for name, ts in times.items()}
    scores = task_scores = 0
    for seg, extra, _, _ in cases["train"]:
        t = seg.trunk
        scores += t * (t + 1) // 2 + sum(
            w * int(k.numel()) for w, k in zip(seg.sizes, seg.keys, strict=True)
        )
        task_scores += t * (t + 1) // 2 + sum(w * (t + w) for w in extra["tasks"].sizes)
    nodes = [tree.n_nodes for tree in train_trees]
    train, ref = medians["train"], medians["reference"]
    return {
        "segments_vs_tasks": round(train["tasks"] / train["segments"], 3),
        "segments_vs_dense": round(train["dense"] / train["segments"], 3),
        "segments_ms": round(1000 * train["segments"], 1),
        "tasks_ms": round(1000 * train["tasks"], 1),
        "dense_ms": round(1000 * train["dense"], 1),
        "reference_segments_vs_tasks": round(ref["tasks"] / ref["segments"], 3),
        "reference_segments_vs_dense": round(ref["dense"] / ref["segments"], 3),
        "minibatch_nodes": nodes,
        "scores_vs_dense": round(scores / sum(n * n for n in nodes), 3),
        "scores_vs_tasks": round(scores / task_scores, 3),
    }


#: glibc mmap thresholds ``--case allocator`` compares: 256 KB (the setting until 2026-11-29),
#: the default one (``memory.MMAP_THRESHOLD_BYTES``), 8 MB and 32 MB (make demo's recipe).
ALLOCATOR_THRESHOLDS = (256 * 1024, memory.MMAP_THRESHOLD_BYTES, 8 * 2**20, 32 * 2**20)


def demo_actor(
    model_path: str, micro_batch_tokens: int, dtype: str = "float32", frozen_layers: int = 0
) -> PPOActor:
    """The actor of ``examples/aenv/config_chains.yaml`` (two minibatches, a bf16 KL reference,
    all layers checkpointed), computing in ``dtype``, training above ``frozen_layers``."""
    actor_cfg = ActorConfig(
        ppo_n_minibatches=2,
        lr=5e-5,
        kl_coef=0.04,
        kl_estimator="k2",
        ref_dtype="bfloat16",
        micro_batch_tokens=micro_batch_tokens,
        frozen_layers=frozen_layers,
    )
    return PPOActor(model_path, actor_cfg, ModelConfig(gradient_checkpointing=True, dtype=dtype))


def run_kernels_case(args, model_path: str) -> dict:
    """The demo actor's whole update with the tree attention's segment per row (the library's)
    and per trunk child (the layout of until 2026-11-29, ``task_segment_layout``), alternating
    on one actor: each one's median update time, the KL reference's forward within it, and
    ``rows_vs_tasks``."""
    from areal_env.trainer import tree, tree_attention

    actor = demo_actor(model_path, args.micro_batch_tokens)
    batch = demo_batch(args, actor.model.config.vocab_size)
    per_row = (tree.PackedTree.attention_segments, tree_attention.segment_tree_attention)
    per_task = (task_segment_layout, task_segment_attention)

    def use(kernel) -> None:
        tree.PackedTree.attention_segments = kernel[0]  # type: ignore[method-assign]
        tree_attention.segment_tree_attention = kernel[1]

    times: dict[str, list[float]] = {"rows": [], "tasks": []}
    reference: dict[str, list[float]] = {"rows": [], "tasks": []}
    try:
        actor.update(_slice(batch, 4), step=0)  # warm-up: allocations, optimiser state
        for it in range(1, args.iters + 1):
            for name in ("rows", "tasks") if it % 2 else ("tasks", "rows"):
                use(per_row if name == "rows" else per_task)
                t0 = time.perf_counter()
                stats = actor.update(batch, step=it)
                times[name].append(time.perf_counter() - t0)
                reference[name].append(stats["time/recompute_s"])
                print(f"iter {it} {name}: {times[name][-1]:.1f} s", file=sys.stderr)
    finally:
        use(per_row)
    med = {name: statistics.median(t) for name, t in times.items()}
    return {
        "rows_vs_tasks": round(med["tasks"] / med["rows"], 3),
        "rows_update_s": round(med["rows"], 2),
        "tasks_update_s": round(med["tasks"], 2),
        "rows_reference_s": round(statistics.median(reference["rows"]), 2),
        "tasks_reference_s": round(statistics.median(reference["tasks"]), 2),
    }


def run_frozen_case(args, model_path: str) -> dict:
    """The demo actor's update with every layer trained and with the lowest N frozen
    (``actor.frozen_layers``, each N of ``--frozen-layers``), alternating: each one's median
    update time, the parameters it trains, and ``frozen_N_vs_all``."""
    counts = [0, *(int(n) for n in args.frozen_layers.split(","))]
    actors = {n: demo_actor(model_path, args.micro_batch_tokens, frozen_layers=n) for n in counts}
    batch = demo_batch(args, actors[0].model.config.vocab_size)
    for actor in actors.values():  # warm-up: allocations, optimiser state
        actor.update(_slice(batch, 4), step=0)
    times: dict[int, list[float]] = {n: [] for n in counts}
    for it in range(1, args.iters + 1):
        order = counts if it % 2 else counts[::-1]
        for n in order:
            t0 = time.perf_counter()
            actors[n].update(batch, step=it)
            times[n].append(time.perf_counter() - t0)
            print(f"iter {it} frozen {n}: {times[n][-1]:.1f} s", file=sys.stderr)
    med = {n: statistics.median(t) for n, t in times.items()}
    result: dict = {"all_update_s": round(med[0], 2)}
    for n in counts[1:]:
        trained = sum(p.numel() for p in actors[n].model.parameters() if p.requires_grad)
        result[f"frozen_{n}_vs_all"] = round(med[0] / med[n], 3)
        result[f"frozen_{n}_update_s"] = round(med[n], 2)
        result[f"frozen_{n}_trained_params_m"] = round(trained / 1e6, 1)
    return result


def run_allocator_child(args, model_path: str) -> dict:
    """One process of ``--case allocator``: the demo actor's updates on the agent batch under the
    mmap threshold its environment sets; the update time, its peak RSS, and this process's page
    faults and kernel CPU time over the timed updates."""
    import resource

    actor = demo_actor(model_path, args.micro_batch_tokens, frozen_layers=args.actor_frozen_layers)
    batch = demo_batch(args, actor.model.config.vocab_size)
    actor.update(_slice(batch, min(4, args.samples)), step=0)  # warm-up: optimiser state
    memory.release_free_memory()
    before = resource.getrusage(resource.RUSAGE_SELF)
    times, peaks = [], []
    for it in range(1, args.iters + 1):
        memory.reset_peak()
        t0 = time.perf_counter()
        actor.update(batch, step=it)
        times.append(time.perf_counter() - t0)
        peaks.append(memory.peak_rss_gb())
        memory.release_free_memory()  # as the trainer does between steps
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "update_s": statistics.median(times),
        "update_peak_rss_gb": max(peaks),
        "page_faults": after.ru_minflt - before.ru_minflt,
        "kernel_cpu_s": after.ru_stime - before.ru_stime,
        "user_cpu_s": after.ru_utime - before.ru_utime,
    }


def run_allocator_case(args, model_path: str) -> dict:
    """The demo actor's update under each mmap threshold of ``ALLOCATOR_THRESHOLDS``, each in a
    process of its own (``mallopt`` settings are per process), alternating rounds: below the
    threshold glibc reuses freed heap memory, above it every block is mmap'ed and page-faulted
    in again at its next allocation. Prints each one's median update time, peak RSS, page faults
    and kernel CPU time, and the update's speed-up against 256 KB (``<MB>_vs_256k``)."""
    import os
    import subprocess

    runs: dict[int, list[dict]] = {t: [] for t in ALLOCATOR_THRESHOLDS}
    rounds = max(1, args.rounds)
    for r in range(rounds):
        for threshold in ALLOCATOR_THRESHOLDS:
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(threshold)}
            cmd = [
                sys.executable,
                __file__,
                "--case=allocator-child",
                f"--model={args.model}",
                f"--iters={args.iters}",
                f"--problems={args.problems}",
                f"--samples={args.samples}",
                f"--system-len={args.system_len}",
                f"--micro-batch-tokens={args.micro_batch_tokens}",
                f"--actor-frozen-layers={args.actor_frozen_layers}",
                *([f"--tokens={args.tokens}"] if args.tokens else []),
                *([f"--step={args.step}"] if args.step is not None else []),
            ]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            child = json.loads(out.stdout.strip().splitlines()[-1])
            runs[threshold].append(child)
            print(f"round {r + 1} threshold {threshold}: {child}", file=sys.stderr)
    result: dict = {}
    base = statistics.median(c["update_s"] for c in runs[ALLOCATOR_THRESHOLDS[0]])
    for threshold, children in runs.items():
        name = f"{threshold // 1024}k" if threshold < 2**20 else f"{threshold // 2**20}m"
        update_s = statistics.median(c["update_s"] for c in children)
        result[f"update_s_{name}"] = round(update_s, 2)
        result[f"update_peak_rss_gb_{name}"] = round(
            max(c["update_peak_rss_gb"] for c in children), 2
        )
        result[f"page_faults_{name}"] = int(statistics.median(c["page_faults"] for c in children))
        result[f"kernel_cpu_s_{name}"] = round(
            statistics.median(c["kernel_cpu_s"] for c in children), 1
        )
        if threshold != ALLOCATOR_THRESHOLDS[0]:
            result[f"{name}_vs_256k"] = round(base / update_s, 3)
    return result


def run_reference_case(args, model_path: str) -> dict:
    """The KL reference's forward on the agent batch (``actor.kl_coef > 0`` runs it every step):
    as it ran before the reference got the tree kernels (fp32, dense [N, N] tree mask), with the
    kernels in fp32 (``actor.ref_dtype: auto`` on the CPU) and in bf16 (``ref_dtype: bfloat16``),
    alternating; median seconds of each and the speed-ups against the dense fp32 forward. Also
    how far the bf16 logprobs are from fp32's, on the batch's random tokens and on text the model
    sampled itself at the demo's T=0.5 (what a reference really scores)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    temperature = 0.5
    actors = {
        name: PPOActor(
            model_path,
            ActorConfig(kl_coef=0.04, ref_dtype=dtype, micro_batch_tokens=args.micro_batch_tokens),
            ModelConfig(gradient_checkpointing=True),
            temperature=temperature,
        )
        for name, dtype in (("fp32", "auto"), ("bf16", "bfloat16"))
    }
    dense = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    dense.requires_grad_(False)
    assert dense.config._attn_implementation == "sdpa"  # no tree kernels: the dense mask
    vocab = dense.config.vocab_size
    batch = demo_batch(args, vocab)
    lengths = batch["attention_mask"].sum(1).tolist()
    ways = {
        "dense_fp32": (actors["fp32"], dense),
        "tree_fp32": (actors["fp32"], actors["fp32"].ref_model),
        "tree_bf16": (actors["bf16"], actors["bf16"].ref_model),
    }
    times: dict[str, list[float]] = {w: [] for w in ways}
    out: dict[str, torch.Tensor] = {}
    for it in range(args.iters + 1):  # the first round warms up
        for way, (actor, model) in ways.items():
            t0 = time.perf_counter()
            out[way] = actor.compute_logprobs(batch, model)
            dt = time.perf_counter() - t0
            if it:
                times[way].append(dt)
                print(f"iter {it} {way}: {dt:.2f} s", file=sys.stderr)
    mask = batch["loss_mask"].bool()
    tree_vs_dense = (out["tree_fp32"] - out["dense_fp32"])[mask].abs().max()
    random_gap = (out["tree_bf16"] - out["tree_fp32"])[mask].abs()

    # text the model wrote: 16 replies of 80 tokens sampled at T=0.5 by the fp32 reference
    tok = AutoTokenizer.from_pretrained(model_path)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(16):
        chat = [{"role": "user", "content": f"Ana has {120 + 37 * i} pens and buys {15 + i} more."}]
        text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        prompt = tok(text)["input_ids"]
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(80):
                logits = dense(torch.tensor([ids])).logits[0, -1].float() / temperature
                ids.append(int(torch.multinomial(logits.softmax(-1), 1, generator=gen)))
        rows.append((prompt, ids))
    width = max(len(ids) for _, ids in rows)
    text_batch = {
        "input_ids": torch.zeros(len(rows), width, dtype=torch.long),
        "attention_mask": torch.zeros(len(rows), width, dtype=torch.bool),
        "loss_mask": torch.zeros(len(rows), width, dtype=torch.int32),
    }
    for i, (prompt, ids) in enumerate(rows):
        text_batch["input_ids"][i, : len(ids)] = torch.tensor(ids)
        text_batch["attention_mask"][i, : len(ids)] = True
        text_batch["loss_mask"][i, len(prompt) : len(ids)] = 1
    text_mask = text_batch["loss_mask"].bool()
    fp32 = actors["fp32"].compute_logprobs(text_batch, actors["fp32"].ref_model)
    bf16 = actors["bf16"].compute_logprobs(text_batch, actors["bf16"].ref_model)
    text_gap = (bf16 - fp32)[text_mask].abs()
    med = {w: statistics.median(t) for w, t in times.items()}
    return {
        "ref_tree_fp32_vs_dense": round(med["dense_fp32"] / med["tree_fp32"], 3),
        "ref_tree_bf16_vs_dense": round(med["dense_fp32"] / med["tree_bf16"], 3),
        "ref_bf16_vs_fp32": round(med["tree_fp32"] / med["tree_bf16"], 3),
        "ref_dense_fp32_s": round(med["dense_fp32"], 2),
        "ref_tree_fp32_s": round(med["tree_fp32"], 2),
        "ref_tree_bf16_s": round(med["tree_bf16"], 2),
        "ref_tree_vs_dense_max_abs_diff": float(tree_vs_dense),
        "ref_bf16_gap_random_mean": round(float(random_gap.mean()), 4),
        "ref_bf16_gap_random_max": round(float(random_gap.max()), 3),
        "ref_bf16_gap_text_mean": round(float(text_gap.mean()), 4),
        "ref_bf16_gap_text_p99": round(float(text_gap.quantile(0.99)), 3),
        "ref_bf16_gap_text_max": round(float(text_gap.max()), 3),
        "ref_text_tokens": int(text_mask.sum()),
        "ref_batch_tokens": int(sum(lengths)),
    }


def build_trl(
    model_path: str,
    rows: int,
    completion_len: int,
    grad_ckpt: bool,
    *,
    bf16: bool = False,
    use_cpu: bool | None = None,
    lr: float = 1e-5,
):
    """TRL's GRPOTrainer on an fp32 model; ``bf16``: TRL's mixed precision (bf16 autocast over
    the fp32 weights, as ``GRPOConfig(bf16=True)`` trains)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    args = GRPOConfig(
        output_dir="/tmp/areal_env_bench_trl",
        per_device_train_batch_size=rows,
        num_generations=min(4, rows),
        max_completion_length=completion_len,
        learning_rate=lr,
        beta=0.0,
        loss_type="bnpo",  # token mean over the batch: the same aggregation as ours
        gradient_checkpointing=grad_ckpt,
        bf16=bf16,
        fp16=False,
        use_cpu=not torch.cuda.is_available() if use_cpu is None else use_cpu,
        report_to=[],
        logging_steps=1000,
        save_strategy="no",
        max_grad_norm=1.0,
    )
    ds = Dataset.from_list([{"prompt": f"question {i}"} for i in range(rows)])
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=ds,
        processing_class=tok,
    )
    trainer.create_optimizer()
    # Trainer.train() would switch checkpointing on; we bypass it, so do it the same way as ours.
    if grad_ckpt and not getattr(trainer.model, "is_gradient_checkpointing", False):
        enable_checkpointing(trainer.model)
    trainer.model.config.use_cache = False
    # set by Trainer's training loop, which we bypass (one step, no gradient accumulation)
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def trl_inputs(batch, prompt_len: int, device):
    ids, mask = batch["input_ids"], batch["attention_mask"].long()
    adv = batch["rewards"].clone()
    for g in batch["group_ids"].unique():  # GRPO group normalisation, as TRL would have done
        sel = batch["group_ids"] == g
        adv[sel] = (adv[sel] - adv[sel].mean()) / (adv[sel].std() + 1e-4)
    completion_mask = mask[:, prompt_len:]
    return {
        "prompt_ids": ids[:, :prompt_len].to(device),
        "prompt_mask": mask[:, :prompt_len].to(device),
        "completion_ids": ids[:, prompt_len:].to(device),
        "completion_mask": completion_mask.to(device),
        "advantages": adv.to(device),
        "num_items_in_batch": completion_mask.sum().to(device),
    }


def trl_step(trainer, inputs) -> None:
    model = trainer.model
    model.train()
    loss = trainer.compute_loss(model, inputs)
    trainer.accelerator.backward(loss)
    torch.nn.utils.clip_grad_norm_(model.parameters(), trainer.args.max_grad_norm)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--completion-len", type=int, default=192)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--no-grad-ckpt", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--case",
        choices=[
            "synthetic",
            "agent",
            "checkpointing",
            "reference",
            "dtype",
            "attention",
            "allocator",
            "allocator-child",
            "minibatches",
            "kernels",
            "frozen",
            "all",
        ],
        default="all",
    )
    ap.add_argument("--problems", type=int, default=4, help="agent case: GRPO groups")
    ap.add_argument("--samples", type=int, default=8, help="agent case: samples per problem")
    ap.add_argument("--system-len", type=int, default=500, help="agent case: shared prompt")
    ap.add_argument("--micro-batch-tokens", type=int, default=4096, help="agent case: ours")
    ap.add_argument("--rounds", type=int, default=2, help="allocator case: alternating rounds")
    ap.add_argument(
        "--tokens",
        default=None,
        help="agent-shaped cases but agent: a run folder whose recorded batch (run_dir/tokens) "
        "replaces the synthetic rows",
    )
    ap.add_argument("--step", type=int, default=None, help="--tokens: the recorded step")
    ap.add_argument(
        "--frozen-layers", default="15,20", help="frozen case: the frozen layer counts to compare"
    )
    ap.add_argument(
        "--actor-frozen-layers",
        type=int,
        default=15,
        help="allocator case: the actor's frozen layers (15: make demo's recipe)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    grad_ckpt = not args.no_grad_ckpt
    model_path = str(resolve_model_path(args.model))
    result: dict = {}
    if args.case in ("synthetic", "all"):
        result.update(run_synthetic_case(args, model_path, grad_ckpt))
    if args.case in ("agent", "all"):
        result.update(run_agent_case(args, model_path, grad_ckpt))
    if args.case == "checkpointing":
        result.update(run_checkpointing_case(args, model_path))
    if args.case == "reference":
        result.update(run_reference_case(args, model_path))
    if args.case == "dtype":
        result.update(run_dtype_case(args, model_path))
    if args.case == "attention":
        result.update(run_attention_case(args, model_path))
    if args.case == "allocator":
        result.update(run_allocator_case(args, model_path))
    if args.case == "minibatches":
        result.update(run_minibatch_case(args, model_path))
    if args.case == "kernels":
        result.update(run_kernels_case(args, model_path))
    if args.case == "frozen":
        result.update(run_frozen_case(args, model_path))
    if args.case == "allocator-child":
        print(json.dumps(run_allocator_child(args, model_path)))
        return 0
    result["peak_rss_gb"] = round(memory.process_peak_rss_gb(), 2)
    result["threads"] = torch.get_num_threads()
    print(json.dumps(result))
    return 0


def run_synthetic_case(args, model_path: str, grad_ckpt: bool) -> dict:
    """Fixed synthetic rows (prompt + completion), ours vs TRL (see the module docstring)."""
    actor = PPOActor(
        model_path,
        ActorConfig(ppo_n_minibatches=1, micro_batch_tokens=1 << 20, lr=1e-5),
        ModelConfig(gradient_checkpointing=grad_ckpt),
    )
    vocab = actor.model.config.vocab_size
    batch = make_batch(args.rows, args.prompt_len, args.completion_len, vocab)
    tokens = args.rows * (args.prompt_len + args.completion_len)
    try:
        trainer = build_trl(model_path, args.rows, args.completion_len, grad_ckpt)
        inputs = trl_inputs(batch, args.prompt_len, trainer.model.device)
        trl_error = None
    except Exception as e:  # report why, still measure ours
        trainer, inputs, trl_error = None, None, f"{type(e).__name__}: {e}"
        print(f"TRL unavailable: {trl_error}", file=sys.stderr)

    ours_t: list[float] = []
    trl_t: list[float] = []
    # Warm-up: one step of each on a 2-row slice (allocations, optimiser state, kernels), so the
    # timed iterations measure steady state without paying for a full-size extra step.
    warm = make_batch(2, args.prompt_len, args.completion_len, vocab)
    actor.update(warm, step=0)
    if trainer is not None:
        trl_step(trainer, trl_inputs(warm, args.prompt_len, trainer.model.device))
    for it in range(1, args.iters + 1):  # alternate, so both see the same machine load
        t0 = time.perf_counter()
        stats = actor.update(batch, step=it)
        dt = time.perf_counter() - t0
        assert stats["actor/update_skipped"] == 0.0
        ours_t.append(dt)
        print(f"iter {it} ours: {dt:.2f} s ({tokens / dt:.0f} tok/s)", file=sys.stderr)
        if trainer is not None:
            t0 = time.perf_counter()
            trl_step(trainer, inputs)
            dt = time.perf_counter() - t0
            trl_t.append(dt)
            print(f"iter {it} trl:  {dt:.2f} s ({tokens / dt:.0f} tok/s)", file=sys.stderr)

    ours = tokens / statistics.median(ours_t)
    result = {
        "tokens_per_s": round(ours, 1),
        "trl_tokens_per_s": round(tokens / statistics.median(trl_t), 1) if trl_t else None,
        "vs_trl": round(ours / (tokens / statistics.median(trl_t)), 3) if trl_t else None,
        "rows": args.rows,
        "seq_len": args.prompt_len + args.completion_len,
        "gradient_checkpointing": grad_ckpt,
        "trl_gradient_checkpointing": bool(
            trainer is not None and getattr(trainer.model, "is_gradient_checkpointing", False)
        ),
    }
    if trl_error:
        result["trl_error"] = trl_error
    return result


if __name__ == "__main__":
    sys.exit(main())
