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
Last line: ``{"tokens_per_s": ..., "trl_tokens_per_s": ..., "vs_trl": ...}`` (tokens = rows × length).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
import warnings

import torch

from areal_env.api.config import ActorConfig, ModelConfig
from areal_env.engine.models import DEFAULT_MODEL, resolve_model_path
from areal_env.trainer.actor import PPOActor, _enable_checkpointing


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


def build_trl(model_path: str, rows: int, completion_len: int, grad_ckpt: bool):
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
        learning_rate=1e-5,
        beta=0.0,
        loss_type="bnpo",  # token mean over the batch: the same aggregation as ours
        gradient_checkpointing=grad_ckpt,
        bf16=False,
        fp16=False,
        use_cpu=not torch.cuda.is_available(),
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
        _enable_checkpointing(trainer.model)
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
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    grad_ckpt = not args.no_grad_ckpt
    model_path = str(resolve_model_path(args.model))
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
        "threads": torch.get_num_threads(),
    }
    if trl_error:
        result["trl_error"] = trl_error
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
