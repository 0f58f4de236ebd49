"""Several policies in one batch: LoRA adapters mixed per row vs the same rows on one adapter,
and the bytes a policy's weight push moves.

Decode throughput (``LocalEngine``, the default model, ``--rows`` requests of ``--new-tokens``
tokens each, greedy, ``ignore_eos`` so every completion has the same length), in one process
on one model, cases interleaved round by round so that load changes on a shared machine hit
all of them:

- ``one``: every row on one adapter (the baseline of the ratios);
- ``mix2`` / ``mix4``: the same rows cycling over 2 / 4 adapters, in one batch;
- ``subbatch4``: the other way to serve 4 adapters: each adapter's rows decoded as a batch of
  their own, one after another (per-adapter sub-batches);
- ``base``: the rows on the base weights, no adapter (what a merged adapter costs: nothing).

``mix2_vs_one`` / ``mix4_vs_one`` (target >= 0.7) and ``subbatch4_vs_one`` are medians of the
per-round ratios of tokens/s. With ``--peft`` the forward-level comparison that chose the
engine's design runs too: peft's mixed-adapter batches (``adapter_names``) against the engine's
adapter hooks and the plain model, the same decode steps on copies of the model
(``forward_peft_mix4_vs_hooks_mix4``, ``forward_hooks_mix4_vs_base``).

Push sizes: a LoRA policy's push (``r`` and targets of ``--rank`` / the default LoRA config) is
its adapter alone: ``push_bytes_adapter`` (in memory, ``AdapterWeights``) and
``push_bytes_adapter_folder`` (the peft folder written for servers) against
``push_bytes_full_model`` (a full policy's HF folder); with the time to load each into the
engine.

The last line of output is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from areal_env.api.io import GenerationConfig, ModelRequest
from areal_env.engine.adapters import AdapterWeights
from areal_env.engine.local import LocalEngine
from areal_env.engine.lora import save_adapter_folder
from areal_env.engine.models import DEFAULT_MODEL, resolve_model_path

QUESTIONS = [
    "What is 194 plus 668?",
    "Lee has 12 boxes of 24 pens. How many pens does Lee have?",
    "Explain why the sky is blue.",
    "Write a short poem about the sea.",
    "Mia shares 336 coins equally among 4 friends. How many does each get?",
    "Name three rivers in Europe and one fact about each.",
    "What is 438 minus 145?",
    "Describe a robot that learns to paint.",
]
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def random_adapter(model: torch.nn.Module, seed: int, r: int) -> AdapterWeights:
    """A peft-named adapter on every q/k/v/o projection (random, so it changes outputs)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in TARGETS and isinstance(module, torch.nn.Linear):
            key = f"base_model.model.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, module.in_features, generator=g) / 30
            tensors[f"{key}.lora_B.weight"] = torch.randn(module.out_features, r, generator=g) / 30
    return AdapterWeights(tensors, {"r": r, "lora_alpha": 2 * r, "target_modules": list(TARGETS)})


def prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (case {i})"}],
            add_generation_prompt=True,
            tokenize=False,
        )
        out.append(tokenizer.encode(text))
    return out


async def decode(engine: LocalEngine, rows: list[list[int]], adapters: list[str | None], n: int):
    g = GenerationConfig(max_new_tokens=n, greedy=True, ignore_eos=True)
    t0 = time.perf_counter()
    outs = await asyncio.gather(
        *(
            engine.agenerate(ModelRequest(list(p), g, adapter=a))
            for p, a in zip(rows, adapters, strict=True)
        )
    )
    elapsed = time.perf_counter() - t0
    assert all(len(o.output_tokens) == n for o in outs)
    return len(rows) * n / elapsed


async def subbatches(engine: LocalEngine, rows: list[list[int]], k: int, n: int) -> float:
    """Each adapter's rows as a batch of their own, one adapter after another."""
    t0 = time.perf_counter()
    for a in range(k):
        part = [p for i, p in enumerate(rows) if i % k == a]
        await decode(engine, part, [f"a{a}"] * len(part), n)
    return len(rows) * n / (time.perf_counter() - t0)


def forward_level(
    model_path: str, adapters: list[AdapterWeights], rows: int, steps: int, rounds: int
) -> dict[str, float]:
    """peft's mixed-adapter batches vs the engine's hooks vs the plain model: tokens/s of the
    same decode loop (rounds interleaved, medians and the median per-round ratio)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, DynamicCache

    from areal_env.engine.adapters import AdapterSet
    from areal_env.engine.batch_worker import cache_keyword

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = torch.randint(100, 40000, (rows, 64), generator=torch.Generator().manual_seed(0))
    r = int(adapters[0].config["r"])
    pm = get_peft_model(
        copy.deepcopy(base),
        LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(TARGETS)),
        adapter_name="a0",
    )
    for i in range(1, len(adapters)):
        pm.add_adapter(f"a{i}", LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(TARGETS)))
    pm.eval()
    hooked = copy.deepcopy(base).eval()
    aset = AdapterSet(hooked)
    for i, w in enumerate(adapters):
        aset.load(f"a{i}", w.tensors, w.config)
    k = len(adapters)
    names = [f"a{i % k}" for i in range(rows)]
    slots = [aset.slot(n) for n in names]

    kw = cache_keyword(base)

    def run(model, extra) -> float:
        with torch.inference_mode():
            cache = DynamicCache()
            out = model(input_ids=ids, use_cache=True, **{kw: cache}, **extra)
            tok = out.logits[:, -1].argmax(-1)
            t0 = time.perf_counter()
            for _ in range(steps):
                out = model(input_ids=tok[:, None], use_cache=True, **{kw: cache}, **extra)
                tok = out.logits[:, -1].argmax(-1)
            return rows * steps / (time.perf_counter() - t0)

    aset.select(slots, torch.device("cpu"))
    got: dict[str, list[float]] = {"peft_mix4": [], "hooks_mix4": [], "base": []}
    for _ in range(rounds):
        got["peft_mix4"].append(run(pm, {"adapter_names": names}))
        got["hooks_mix4"].append(run(hooked, {}))
        got["base"].append(run(base, {}))
    out = {f"forward_tok_s_{k}": statistics.median(v) for k, v in got.items()}
    for a, b in (("peft_mix4", "hooks_mix4"), ("hooks_mix4", "base"), ("peft_mix4", "base")):
        ratios = [x / y for x, y in zip(got[a], got[b], strict=True)]
        out[f"forward_{a}_vs_{b}"] = statistics.median(ratios)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16, help="concurrent requests")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4, help="interleaved repetitions")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank of the adapters")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--peft", action="store_true", help="also the forward-level peft comparison")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = str(resolve_model_path(DEFAULT_MODEL))
    engine = LocalEngine(
        path, max_batch_size=args.rows, prefix_cache_mb=0, num_threads=args.threads
    )
    engine.initialize()
    adapters = [random_adapter(engine.model, seed=i, r=args.rank) for i in range(4)]
    for i, w in enumerate(adapters):
        engine.load_adapter(f"a{i}", w)
    rows = prompts(engine.tokenizer, args.rows)
    n = args.new_tokens
    cases = {
        "one": lambda: decode(engine, rows, ["a0"] * len(rows), n),
        "mix2": lambda: decode(engine, rows, [f"a{i % 2}" for i in range(len(rows))], n),
        "mix4": lambda: decode(engine, rows, [f"a{i % 4}" for i in range(len(rows))], n),
        "subbatch4": lambda: subbatches(engine, rows, 4, n),
        "base": lambda: decode(engine, rows, [None] * len(rows), n),
    }
    asyncio.run(cases["one"]())  # warm-up
    tok_s: dict[str, list[float]] = {k: [] for k in cases}
    for rnd in range(args.rounds):
        for name, run in cases.items():
            tok_s[name].append(asyncio.run(run()))
        line = ", ".join(f"{k} {v[-1]:.1f}" for k, v in tok_s.items())
        print(f"round {rnd + 1}: tokens/s {line}", flush=True)
    out: dict[str, float] = {f"tok_s_{k}": statistics.median(v) for k, v in tok_s.items()}
    for k in ("mix2", "mix4", "subbatch4", "base"):
        ratios = [x / y for x, y in zip(tok_s[k], tok_s["one"], strict=True)]
        out[f"{k}_vs_one"] = statistics.median(ratios)

    # push sizes and load times: an adapter alone vs a full model
    w = adapters[0]
    out["push_bytes_adapter"] = float(w.nbytes)
    with tempfile.TemporaryDirectory() as tmp:
        out["push_bytes_adapter_folder"] = float(
            save_adapter_folder(Path(tmp) / "a", w.tensors, w.config)
        )
    out["push_bytes_full_model"] = float(
        sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    )
    out["adapter_vs_full_bytes"] = out["push_bytes_adapter"] / out["push_bytes_full_model"]
    t0 = time.perf_counter()
    engine.load_adapter("a0", w)
    out["push_s_adapter"] = time.perf_counter() - t0
    state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    t0 = time.perf_counter()
    engine.update_weights(state)
    out["push_s_full_model"] = time.perf_counter() - t0
    engine.destroy()

    if args.peft:
        out.update(forward_level(path, adapters, args.rows, n, args.rounds))
    for k, v in out.items():
        print(f"{k:28} {v:,.3f}")
    print(json.dumps({k: round(v, 4) for k, v in out.items()}))
    ok = out["mix2_vs_one"] >= 0.7 and out["mix4_vs_one"] >= 0.7
    print(f"target mix2/mix4 vs one >= 0.7: {'met' if ok else 'NOT met'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
