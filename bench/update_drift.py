"""How far does one PPO update move the tokens the policy was sure of, against the ones it chose?

The demo's instability is not the tool choice moving: it is tokens that made no choice (a JSON
brace the model gives 99 %) falling by 15-25 nats in one update, which breaks the calls. This
bench measures that on a real batch, the same for every variant:

1. ``--capture FILE``: runs the demo's first step (``examples/aenv``, the committed config, no
   evaluation) and saves the batch the trainer received (or ``--batch FILE`` reuses one);
2. for the baseline (the demo's ``actor`` section) and each ``--variant`` (dotted ``actor``
   overrides, e.g. ``high_entropy_token_share=0.2``): a fresh actor, the batch's logprobs
   before, one ``update``, the logprobs after.

Per variant (one JSON line): ``sure_fall_max`` (the largest fall, nats, of a token sampled with
probability >= 0.9: no choice was made there), ``sure_falls_gt3`` (how many fell by more than 3
nats), ``fork_rise_max`` (the largest rise of a token sampled with probability < 0.5: a choice),
``mean_abs_change``, the update's ``approx_kl`` and ``log_ratio_max``, and the five largest moves
with their text. The last line compares each variant with the baseline of the same run:
``{"variants": {name: {"sure_fall_vs_base", "fork_rise_vs_base"}}}`` (falls and rises as ratios).

    .venv/bin/python bench/update_drift.py --capture /tmp/batch.pt --variant high_entropy_token_share=0.2
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "examples" / "aenv"

CAPTURE = """
import sys, torch
sys.path.insert(0, {demo!r})
import train_aenv
from areal_env.trainer import actor as actor_module
def update(self, batch, *, step=None):
    torch.save(dict(batch), {out!r})
    raise SystemExit(0)
actor_module.PPOActor.update = update
train_aenv.main(["--fresh", "--steps", "1", "fileroot=" + {root!r}, "trial_name=drift",
                 "trainer.eval_before_training=false", "seed=" + str({seed})])
"""


def capture(out: Path, seed: int) -> None:
    """The batch of the demo's first step (a subprocess: the demo's servers come and go)."""
    root = str(out.parent / "drift-run")
    code = CAPTURE.format(demo=str(DEMO), out=str(out), root=root, seed=seed)
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
    if not out.is_file():
        raise SystemExit(f"the demo's first step saved no batch to {out}")


def demo_actor_config(overrides: list[str]) -> tuple[Any, float, str]:
    from areal_env.api.config import ExperimentConfig, load_config

    cfg = load_config(
        ExperimentConfig, str(DEMO / "config.yaml"), [f"actor.{o}" for o in overrides]
    )
    return cfg.actor, float(cfg.gconfig.temperature), cfg.model.path


def run_variant(name: str, overrides: list[str], batch: dict[str, torch.Tensor], tok: Any):
    from areal_env.api.config import ModelConfig
    from areal_env.engine.models import resolve_model_path
    from areal_env.trainer.actor import PPOActor
    from areal_env.trainer.actor_math import scored_mask

    actor_cfg, temperature, model = demo_actor_config(overrides)
    torch.manual_seed(0)
    actor = PPOActor(
        str(resolve_model_path(model)),
        actor_cfg,
        ModelConfig(gradient_checkpointing=True),
        temperature=temperature,
    )
    mask = scored_mask(batch)
    before = actor.compute_logprobs(batch)
    t0 = time.perf_counter()
    stats = actor.update(batch, step=1)
    update_s = time.perf_counter() - t0
    after = actor.compute_logprobs(batch)
    change = (after - before).masked_fill(~mask, 0.0)
    sampled = batch["logprobs"].float()
    sure = mask & (sampled >= math.log(0.9))
    fork = mask & (sampled < math.log(0.5))
    ids = batch["input_ids"]
    width = ids.shape[1]
    moves = []
    for flat in change.abs().flatten().argsort(descending=True)[:5].tolist():
        r, p = divmod(flat, width)
        context = tok.decode(ids[r, max(0, p - 8) : p].tolist())[-30:]
        moves.append(
            {
                "change": round(float(change[r, p]), 2),
                "sampled_logp": round(float(sampled[r, p]), 2),
                "context": context,
                "token": tok.decode([int(ids[r, p])]),
            }
        )
    return {
        "variant": name,
        "overrides": overrides,
        "sure_tokens": int(sure.sum()),
        "fork_tokens": int(fork.sum()),
        "sure_fall_max": round(float(-change[sure].min()), 2) if sure.any() else 0.0,
        "sure_falls_gt3": int((change[sure] < -3).sum()),
        "fork_rise_max": round(float(change[fork].max()), 2) if fork.any() else 0.0,
        "mean_abs_change": round(float(change[mask].abs().mean()), 4),
        "approx_kl": round(stats.get("actor/approx_kl", 0.0), 4),
        "log_ratio_max": round(stats.get("actor/log_ratio_max", 0.0), 2),
        "pg_token_share": stats.get("actor/pg_token_share"),
        "update_s": round(update_s, 1),
        "largest_moves": moves,
    }


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--capture", type=Path, help="run the demo's first step, save its batch here")
    src.add_argument("--batch", type=Path, help="a batch saved by --capture")
    ap.add_argument("--seed", type=int, default=2, help="the captured run's seed")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="comma-separated actor overrides, e.g. lr=2e-5 or high_entropy_token_share=0.2",
    )
    args = ap.parse_args()
    path = args.batch
    if args.capture is not None:
        capture(args.capture, args.seed)
        path = args.capture
    batch = torch.load(path)
    from tokenizers import Tokenizer

    from areal_env.engine.models import resolve_model_path

    _, _, model = demo_actor_config([])
    tok = Tokenizer.from_file(str(resolve_model_path(model) / "tokenizer.json"))
    results = [run_variant("base", [], batch, tok)]
    print(json.dumps(results[0]), flush=True)
    for spec in args.variant:
        overrides = [o.strip() for o in spec.split(",") if o.strip()]
        results.append(run_variant(spec, overrides, batch, tok))
        print(json.dumps(results[-1]), flush=True)
    base = results[0]

    def ratio(a: float, b: float) -> float | None:
        return round(a / b, 3) if b else None

    summary = {
        "batch": str(path),
        "base": {k: base[k] for k in ("sure_fall_max", "sure_falls_gt3", "fork_rise_max")},
        "variants": {
            r["variant"]: {
                "sure_fall_vs_base": ratio(r["sure_fall_max"], base["sure_fall_max"]),
                "fork_rise_vs_base": ratio(r["fork_rise_max"], base["fork_rise_max"]),
                "sure_falls_gt3": r["sure_falls_gt3"],
            }
            for r in results[1:]
        },
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
