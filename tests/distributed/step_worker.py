"""One PPO update on a fixed batch, as one process or as a torchrun rank (strategy fsdp).

Used by tests/unit/test_dist_fsdp.py and bench/scale.py. Writes, from rank 0, the full weights
after an SGD step and after a following AdamW step (``--out``), and a JSON line with the step's
statistics and this rank's peak memory. SGD makes the weights a direct image of the gradient
(AdamW's first step is scale-invariant, so it alone would hide a wrong loss normalisation).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch


def fixed_batch(
    vocab: int, n_rows: int = 6, seed: int = 0, shared_prefix: int = 0
) -> dict[str, torch.Tensor]:
    """Right-padded rows of different lengths, answers on the second half, two groups.

    ``shared_prefix``: the rows of a group start with the same that many tokens (a GRPO
    group's prompt), so tree training has prefixes to share."""
    g = torch.Generator().manual_seed(seed)
    lengths = [48 - 6 * i for i in range(n_rows)]
    width = max(lengths)
    ids = torch.zeros(n_rows, width, dtype=torch.long)
    attn = torch.zeros(n_rows, width, dtype=torch.long)
    loss = torch.zeros(n_rows, width, dtype=torch.long)
    logp = torch.zeros(n_rows, width)
    for r, n in enumerate(lengths):
        ids[r, :n] = torch.randint(3, vocab, (n,), generator=g)
        attn[r, :n] = 1
        loss[r, n // 2 : n] = 1
        logp[r, n // 2 : n] = -torch.rand(n - n // 2, generator=g) * 4
    groups = [0, 0, 0, 1, 1, 1][:n_rows]
    for r in range(n_rows):
        first = groups.index(groups[r])
        ids[r, :shared_prefix] = ids[first, :shared_prefix]
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "loss_mask": loss,
        "logprobs": logp,
        "versions": torch.zeros(n_rows, width, dtype=torch.long),
        "rewards": torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 0.2][:n_rows]),
        "group_ids": torch.tensor(groups),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", choices=["single", "fsdp"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default=None, help="folder for the weights (rank 0)")
    ap.add_argument("--micro-batch-tokens", type=int, default=96)
    ap.add_argument("--lora", action="store_true")
    ap.add_argument(
        "--policies",
        action="store_true",
        help="LoRA adapters a and b share the model (two policies): the steps train a only",
    )
    ap.add_argument("--tree", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--shared-prefix", type=int, default=0, help="tokens a group's rows share")
    ap.add_argument("--steps", default="sgd,adamw", help="optimizer per update: sgd | adamw")
    ap.add_argument("--ckpt-root", default=None)
    ap.add_argument("--save-after", type=int, default=None, help="checkpoint after N updates")
    ap.add_argument("--resume", action="store_true", help="restore the latest checkpoint first")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | auto (FSDP: NCCL on CUDA)")
    ap.add_argument("--push-dir", default=None, help="write what a weight push writes, timed")
    args = ap.parse_args(argv)

    from areal_env.api.config import ActorConfig, LoraConfig, ModelConfig
    from areal_env.trainer import checkpoint as ckpt
    from areal_env.trainer.actor import PPOActor
    from areal_env.trainer.dist import storage_ptr

    torch.manual_seed(0)
    actor_cfg = ActorConfig(
        strategy=args.strategy,
        lr=1e-5,
        ppo_n_minibatches=1,
        micro_batch_tokens=args.micro_batch_tokens,
        recompute_logprobs=True,  # exercises the sharded logprob recompute too
        max_grad_norm=1e9,  # no clipping: the step is the raw gradient
        lora=LoraConfig(r=8, alpha=16) if args.lora or args.policies else None,
        tree_training=args.tree,
    )
    model_cfg = ModelConfig(
        path=args.model, device=args.device, dtype="float32", gradient_checkpointing=True
    )
    other = None
    if args.policies:
        assert actor_cfg.lora is not None
        loras = {"a": actor_cfg.lora, "b": actor_cfg.lora}
        actor = PPOActor(args.model, actor_cfg, model_cfg, seed=1, adapter="a", adapters=loras)
        other = PPOActor(args.model, actor_cfg, model_cfg, seed=1, adapter="b", share=actor)
        other_before = other.adapter_state_dict()
        actor.activate()
    else:
        actor = PPOActor(args.model, actor_cfg, model_cfg, seed=1)
    rank = actor.dist.rank
    batch = fixed_batch(actor.model.config.vocab_size, shared_prefix=args.shared_prefix)
    params = [p for p in actor.model.parameters() if p.requires_grad]
    adamw = actor.optimizer
    for group in adamw.param_groups:
        # AdamW's first step is ~lr * sign(g): with eps 1e-8 a gradient element at float-noise
        # level (|g| ~ 1e-8) can flip between two reduction orders and move 2*lr apart.
        group["eps"] = 1e-6
    start = 0
    if args.resume:
        found = ckpt.latest_checkpoint(args.ckpt_root)
        state = ckpt.restore_checkpoint(found, model=actor.model, optimizer=adamw)
        start = int(state["step"])
    results = []
    names = args.steps.split(",")
    for i in range(start, len(names)):
        name = names[i]
        actor.optimizer = torch.optim.SGD(params, lr=1e-2) if name == "sgd" else adamw
        t0 = time.perf_counter()
        stats = actor.update(batch, step=i)
        dt = time.perf_counter() - t0
        lora = args.lora or args.policies
        sd = actor.state_dict_for_engine() if not lora else actor.adapter_state_dict()
        live = {storage_ptr(p) for p in actor.model.parameters()}
        aliased = sorted(k for k, v in sd.items() if storage_ptr(v) in live)
        if rank == 0 and args.out:
            from safetensors.torch import save_file

            Path(args.out).mkdir(parents=True, exist_ok=True)
            save_file(
                {k: v.contiguous() for k, v in sd.items()}, str(Path(args.out) / f"{i}_{name}.st")
            )
        results.append(
            {
                "optimizer": name,
                "loss": stats.get("actor/loss"),
                "grad_norm": stats.get("actor/grad_norm"),
                "scored_tokens": stats.get("actor/scored_tokens"),
                "tree_packed": stats.get("actor/tree_packed"),
                "computed_tokens": stats.get("actor/computed_tokens"),
                "step_s": dt,
                "aliased": aliased,  # pushed tensors that are live parameters (must be none)
            }
        )
        if args.save_after is not None and i + 1 == args.save_after:
            ckpt.save_checkpoint(
                args.ckpt_root,
                i + 1,
                model=actor.model,
                tokenizer=None,
                optimizer=adamw,
                trainer_state={"version": i + 1},
                export_hf=actor.export_hf,
            )
    push = {}
    if args.push_dir:
        t0 = time.perf_counter()
        folder = Path(args.push_dir)
        size = actor.save_adapter(folder) if args.lora else actor.export_hf(folder)
        push = {"push_bytes": size, "push_s": time.perf_counter() - t0, "push_dir": str(folder)}
    other_unchanged = None
    if other is not None:
        after = other.adapter_state_dict()  # collective: every rank
        other_unchanged = rank != 0 or (
            after.keys() == other_before.keys()
            and all(torch.equal(after[k], other_before[k]) for k in after)
        )
    state_bytes = _state_bytes(actor)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    line = {
        "rank": rank,
        "world_size": actor.dist.world_size,
        "steps": results,
        "state_bytes": state_bytes,
        "other_unchanged": other_unchanged,
        "peak_rss_mb": peak_kb / 1024,
        "pid": os.getpid(),
        **push,
    }
    print("RESULT " + json.dumps(line), flush=True)
    from areal_env.trainer.dist import destroy

    destroy()
    return 0


def _state_bytes(actor) -> int:
    """Bytes this rank holds for parameters + gradients' size + optimizer states (local
    shards only): the memory FSDP divides across ranks."""
    total = 0
    for p in actor.model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
        if p.requires_grad:
            total += local.numel() * local.element_size()  # its gradient, same shape
    for st in actor.optimizer.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                loc = v.to_local() if hasattr(v, "to_local") else v
                total += loc.numel() * loc.element_size()
    return total


if __name__ == "__main__":
    sys.exit(main())
