"""What does SGLang's HTTP protocol cost? SGLangEngine → ``areal-env serve`` vs in-process.

Both sides run the same LocalEngine code on the same model: one side in this process, the other
behind ``areal-env serve`` (launched with the launcher, as in training), reached through
``SGLangEngine``. Each round sends the same ``--requests`` concurrent greedy requests
(``ignore_eos``, so every request makes exactly ``--new-tokens`` tokens) to one side, then the
other; the order alternates for ``--rounds`` rounds after a warm-up, and the ratio is the
median of the per-round ratios (robust to the load of a shared machine). Outputs are checked
token for token. One torch thread per side by default (``--threads``), so the two sides do not
fight over cores.

    .venv/bin/python bench/sglang_protocol_overhead.py [--requests 16] [--new-tokens 32]

Last line: one JSON object, ``{"http_overhead_ratio": ..., ...}`` (target <= 1.10).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_env.api.io import GenerationConfig, ModelRequest  # noqa: E402
from areal_env.engine.launcher import launch_servers  # noqa: E402
from areal_env.engine.local import LocalEngine  # noqa: E402
from areal_env.engine.models import DEFAULT_MODEL, resolve_model_path  # noqa: E402
from areal_env.engine.sglang import SGLangEngine  # noqa: E402

TOPICS = [
    "the sea", "a red fox", "winter mornings", "trains", "bread", "the moon", "a lighthouse",
    "old maps", "honey bees", "rain in the city", "chess", "a small boat", "mountains",
    "libraries", "coffee", "a kite", "volcanoes", "owls", "autumn leaves", "bicycles",
]  # fmt: skip


def make_prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Write a short poem about {TOPICS[i % len(TOPICS)]}."}],
            add_generation_prompt=True,
            tokenize=False,
        )
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


async def run_round(engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list]:
    cfg = GenerationConfig(max_new_tokens=new_tokens, greedy=True, ignore_eos=True)
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(engine.agenerate(ModelRequest(p, cfg)) for p in prompts))
    return time.perf_counter() - t0, outs


def decode_steps(eng) -> int:
    """Decode steps the engine has run (in-process stats, or the server's /get_server_info)."""
    if isinstance(eng, LocalEngine):
        return int(eng.stats()["decode_steps"])
    info = httpx.get(f"http://{eng.addresses[0]}/get_server_info", trust_env=False).json()
    return int(info["engine_stats"]["decode_steps"])


async def bench(args) -> dict:
    model = str(resolve_model_path(args.model))
    local = LocalEngine(model, max_batch_size=args.requests, num_threads=args.threads or None)
    local.initialize()
    serve_args = ["--max-batch-size", str(args.requests), "--log-level", "warning"]
    if args.threads:
        serve_args += ["--num-threads", str(args.threads)]
    group = launch_servers(
        model,
        base_port=0,
        command=[sys.executable, "-m", "areal_env.cli", "serve"],
        extra_args=serve_args,
        startup_timeout=300,
    )
    remote = SGLangEngine(group.addresses)
    remote.initialize()
    try:
        prompts = make_prompts(local.tokenizer, args.requests)
        await run_round(local, prompts, 4)  # warm-up: allocator, connections
        await run_round(remote, prompts, 4)
        local_times, http_times = [], []
        step_counts: list[tuple[int, int]] = []
        match = True
        max_lp_diff = 0.0
        for r in range(args.rounds):
            order = [("local", local), ("http", remote)]
            if r % 2:
                order.reverse()
            results, steps = {}, {}
            for name, eng in order:
                before = decode_steps(eng)
                elapsed, outs = await run_round(eng, prompts, args.new_tokens)
                steps[name] = decode_steps(eng) - before
                (local_times if name == "local" else http_times).append(elapsed)
                results[name] = outs
            step_counts.append((steps["local"], steps["http"]))
            print(
                f"round {r}: local {local_times[-1]:.3f} s ({steps['local']} steps)  "
                f"http {http_times[-1]:.3f} s ({steps['http']} steps)  "
                f"ratio {http_times[-1] / local_times[-1]:.3f}",
                flush=True,
            )
            for a, b in zip(results["local"], results["http"], strict=True):
                match &= a.output_tokens == b.output_tokens
                max_lp_diff = max(
                    [max_lp_diff]
                    + [
                        abs(x - y)
                        for x, y in zip(a.output_logprobs, b.output_logprobs, strict=True)
                    ]
                )
    finally:
        remote.destroy()
        group.stop()
        local.destroy()
    local_s, http_s = statistics.median(local_times), statistics.median(http_times)
    # Paired: each round's two sides ran back to back, so drifting machine load cancels out.
    ratios = [h / loc for h, loc in zip(http_times, local_times, strict=True)]
    tokens = args.requests * args.new_tokens
    return {
        "http_overhead_ratio": round(statistics.median(ratios), 4),
        "round_ratios": [round(r, 3) for r in ratios],
        "local_s": round(local_s, 3),
        "http_s": round(http_s, 3),
        "local_tok_per_s": round(tokens / local_s, 1),
        "http_tok_per_s": round(tokens / http_s, 1),
        "requests": args.requests,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "decode_steps_local_http": step_counts[len(step_counts) // 2],
        "outputs_match": match,
        "max_logprob_diff": max_lp_diff,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads on each side (0 = torch default)"
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    result = asyncio.run(bench(args))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
