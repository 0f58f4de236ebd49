"""Throughput of LocalEngine's continuous batching vs one-by-one ``model.generate``.

The same requests (chat prompts of different lengths, sampling at T=1, ``ignore_eos`` so every
completion has exactly ``--new-tokens`` tokens) run twice in the same process on the same model
object and the same torch threads: all at once through ``LocalEngine`` (8 and then 32 concurrent
requests), and one after another with transformers' ``model.generate``. Baseline and engine runs
are interleaved so that load changes on a shared machine hit both sides.

The prefix case (``--case prefix``) is the demo's agent traffic: 4 problems x 8 samples behind
one shared ~500-token system prompt with tool schemas, short outputs (``--prefix-new-tokens``,
default 20), two turns (the second turn's prompt is the first turn plus its output plus a tool
result). The same engine runs it with the prefix cache off and on (emptied before each run,
alternating, ``--prefix-repeats`` times); ``prefix_cache_speedup`` = rollout wall time without /
with (median), and ``rollout_tok_s_off`` / ``rollout_tok_s_on`` the output tokens per second.

The shared-prefix case (``--case shared``) runs the same agent traffic with the prefix cache on,
the system prompt held once for all running rows (``engine.share_prefixes``, on) and a copy of
it in every row (off), alternating, ``--prefix-repeats`` times each; ``shared_prefix_speedup`` =
rollout wall time off / on (median). Greedy outputs are compared between the two sides: they
must agree (``shared_prefix_same_outputs``).

The joining case (``--case joining``) runs agent episodes whose turns come back at different
times (three turns, 10-26 new tokens a turn, 20-60 ms "tool calls" between them), so next turns
join a batch that holds the system prompt once. Their prefill reads that prefix from the batch
(``read``) or copies it into every joining row as it did until 2026-11-29 (``copied``),
alternating; ``joining_read_vs_copied`` = wall time copied / read (median), greedy outputs
compared (``joining_same_outputs``).

The linear case (``--case linear``) runs the shared-prefix case's traffic with the linear
layers' fp32 products through oneDNN (``engine.cpu_linear: onednn``, the default) and through
PyTorch's default kernel, switched on the same model, alternating; ``onednn_vs_default`` = wall
time default / oneDNN (median), greedy outputs compared (``linear_same_outputs``).

The last line of output is one JSON object, e.g.
``{"speedup_8": 3.4, "speedup_32": 7.9, "tok_s_32": 95.0, "prefix_cache_speedup": 2.6, ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

from areal_env.api.io import GenerationConfig, ModelRequest
from areal_env.engine.local import LocalEngine
from areal_env.engine.models import DEFAULT_MODEL, resolve_model_path

TOPICS = [
    "the sea",
    "a small red fox who lives at the edge of a forest",
    "rain",
    "why the sky looks blue during the day and orange at sunset",
    "bread",
    "a robot that learns to paint, told from the point of view of its first canvas",
    "mountains",
    "the history of the bicycle and how it changed cities",
]


def build_prompts(tokenizer, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        text = f"Write a short story about {TOPICS[i % len(TOPICS)]}." + " Be vivid." * (i % 5)
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        prompts.append(list(ids))
    return prompts


async def engine_run(engine: LocalEngine, prompts: list[list[int]], new_tokens: int) -> float:
    g = dict(max_new_tokens=new_tokens, ignore_eos=True, temperature=1.0, top_k=0, top_p=1.0)
    reqs = [ModelRequest(p, GenerationConfig(seed=i, **g)) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    resps = await asyncio.gather(*(engine.agenerate(r) for r in reqs))
    elapsed = time.perf_counter() - t0
    assert all(len(r.output_tokens) == new_tokens for r in resps), "unequal lengths"
    return elapsed


def hf_one_by_one(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> list[float]:
    times = []
    for i, p in enumerate(prompts):
        ids = torch.tensor([p], device=model.device)
        torch.manual_seed(i)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=pad_id,
            )
        times.append(time.perf_counter() - t0)
        assert out.shape[1] - ids.shape[1] == new_tokens, "unequal lengths"
    return times


TOOLS = [
    ("add", "Add two numbers and return the sum.", ["a", "b"]),
    ("subtract", "Subtract the second number from the first.", ["a", "b"]),
    ("multiply", "Multiply two numbers and return the product.", ["a", "b"]),
    ("divide", "Divide the first number by the second; errors on division by zero.", ["a", "b"]),
    ("power", "Raise the base to the exponent.", ["base", "exponent"]),
    ("sqrt", "Square root of a non-negative number.", ["x"]),
    ("modulo", "Remainder of the first number divided by the second.", ["a", "b"]),
]


def agent_system_prompt(target_tokens: int, tokenizer) -> str:
    """A system prompt with JSON tool schemas, as the proxy renders them, of about
    ``target_tokens`` tokens."""
    schemas = []
    for name, desc, params in TOOLS:
        props = {p: {"type": "number", "description": f"the {p} operand"} for p in params}
        schemas.append(
            json.dumps(
                {
                    "type": "function",
                    "function": {
                        "name": name,
                        "description": desc,
                        "parameters": {"type": "object", "properties": props, "required": params},
                    },
                }
            )
        )
    text = (
        "You are a careful assistant that solves arithmetic problems with tools.\n"
        "# Tools\nYou may call one or more functions to assist with the user query.\n"
        "<tools>\n" + "\n".join(schemas) + "\n</tools>\n"
        'For each call, return <tool_call>[{"name": ..., "arguments": {...}}]</tool_call>.'
    )
    while len(tokenizer(text)["input_ids"]) < target_tokens:
        text += " Always check the tool result before answering, and answer with a number."
    return text


def agent_prompts(tokenizer, system_tokens: int, problems: int, samples: int) -> list[list[int]]:
    system = agent_system_prompt(system_tokens, tokenizer)
    out = []
    for p in range(problems):
        task = f"Problem {p}: a shop sells {p + 3} boxes of {7 * p + 5} apples; how many apples?"
        ids = tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": task}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        out += [list(ids)] * samples
    return out


async def agent_rollout(
    engine: LocalEngine, prompts, new_tokens: int, tool_ids, greedy: bool = False
) -> list[list[int]]:
    """Two turns per episode, all episodes concurrent; returns each episode's output tokens."""
    g: dict = dict(max_new_tokens=new_tokens, ignore_eos=True)
    g.update(greedy=True) if greedy else g.update(temperature=1.0, top_k=0, top_p=1.0)

    async def episode(i: int, prompt: list[int]) -> list[int]:
        r1 = await engine.agenerate(ModelRequest(prompt, GenerationConfig(seed=i, **g)))
        turn2 = prompt + r1.output_tokens + tool_ids
        r2 = await engine.agenerate(ModelRequest(turn2, GenerationConfig(seed=1000 + i, **g)))
        return r1.output_tokens + r2.output_tokens

    return list(await asyncio.gather(*(episode(i, p) for i, p in enumerate(prompts))))


def tool_result_ids(tok) -> list[int]:
    return tok(
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )["input_ids"]


def prefix_case(engine: LocalEngine, args) -> dict[str, float]:
    tok = engine.tokenizer
    prompts = agent_prompts(tok, args.system_tokens, 4, 8)
    tool_ids = tool_result_ids(tok)
    print(
        f"prefix case: {len(prompts)} episodes x 2 turns, prompts of {len(prompts[0])}-"
        f"{max(map(len, prompts))} tokens, {args.prefix_new_tokens} new tokens per turn",
        flush=True,
    )
    walls: dict[str, list[float]] = {"off": [], "on": []}
    tokens = 0
    for rep in range(args.prefix_repeats):
        for side in ("off", "on") if rep % 2 == 0 else ("on", "off"):
            engine.set_prefix_cache_mb(args.prefix_cache_mb if side == "on" else 0)
            before = engine.stats()
            t0 = time.perf_counter()
            outs = asyncio.run(agent_rollout(engine, prompts, args.prefix_new_tokens, tool_ids))
            tokens = sum(map(len, outs))
            wall = time.perf_counter() - t0
            after = engine.stats()
            walls[side].append(wall)
            print(
                f"rep {rep} cache {side:3s}: {wall:6.2f}s ({tokens / wall:6.1f} tok/s), prefill "
                f"{int(after['prefill_tokens'] - before['prefill_tokens'])} tokens, reused "
                f"{int(after['prefix_cache_hit_tokens'] - before['prefix_cache_hit_tokens'])}",
                flush=True,
            )
    off, on = statistics.median(walls["off"]), statistics.median(walls["on"])
    engine.set_prefix_cache_mb(args.prefix_cache_mb)
    return {
        "prefix_cache_speedup": round(off / on, 2),
        "rollout_tok_s_off": round(tokens / off, 1),
        "rollout_tok_s_on": round(tokens / on, 1),
        "prefix_prompt_tokens": len(prompts[0]),
    }


def alternate_sides(
    engine: LocalEngine,
    args,
    sides: tuple[str, str],
    use: Callable[[str], None],
    describe: Callable[[dict, dict], str],
) -> tuple[dict[str, list[list[int]]], dict[str, float], int]:
    """The demo's traffic (8 problems x 4 samples, two turns, prefix cache on) under two engine
    settings: ``use(side)`` switches to one. A greedy rollout per side first (it also warms both
    up), then ``--prefix-repeats`` timed sampled rollouts per side, alternating, each printed with
    ``describe(stats_before, stats_after)``. Returns the greedy outputs per side, the median wall
    time per side and the output tokens of a rollout."""
    tok = engine.tokenizer
    prompts = agent_prompts(tok, args.system_tokens, 8, 4)
    tool_ids = tool_result_ids(tok)
    engine.set_prefix_cache_mb(args.prefix_cache_mb)
    print(
        f"{' vs '.join(sides)}: {len(prompts)} episodes x 2 turns, prompts of {len(prompts[0])}-"
        f"{max(map(len, prompts))} tokens, {args.prefix_new_tokens} new tokens per turn",
        flush=True,
    )
    greedy: dict[str, list[list[int]]] = {}
    for side in sides:
        use(side)
        greedy[side] = asyncio.run(
            agent_rollout(engine, prompts, args.prefix_new_tokens, tool_ids, greedy=True)
        )
    walls: dict[str, list[float]] = {side: [] for side in sides}
    tokens = 0
    for rep in range(args.prefix_repeats):
        for side in sides if rep % 2 == 0 else sides[::-1]:
            use(side)
            before = engine.stats()
            t0 = time.perf_counter()
            outs = asyncio.run(agent_rollout(engine, prompts, args.prefix_new_tokens, tool_ids))
            wall = time.perf_counter() - t0
            tokens = sum(map(len, outs))
            walls[side].append(wall)
            print(
                f"rep {rep} {side:7s}: {wall:6.2f}s ({tokens / wall:6.1f} tok/s), "
                f"{describe(before, engine.stats())}",
                flush=True,
            )
    return greedy, {side: statistics.median(w) for side, w in walls.items()}, tokens


def shared_prefix_case(engine: LocalEngine, args) -> dict[str, float | bool]:
    """The system prompt held once for the batch (on) or copied into every row (off)."""

    def use(side: str) -> None:
        engine.worker.share_prefixes = side == "on"

    def describe(before: dict, after: dict) -> str:
        shared = after["shared_prefix_steps"] - before["shared_prefix_steps"]
        steps = after["decode_steps"] - before["decode_steps"]
        return f"{int(shared)} of {int(steps)} decode steps read the prefix once"

    greedy, wall, tokens = alternate_sides(engine, args, ("off", "on"), use, describe)
    engine.worker.share_prefixes = True
    return {
        "shared_prefix_speedup": round(wall["off"] / wall["on"], 2),
        "shared_tok_s_off": round(tokens / wall["off"], 1),
        "shared_tok_s_on": round(tokens / wall["on"], 1),
        "shared_prefix_same_outputs": greedy["on"] == greedy["off"],
    }


def linear_case(engine: LocalEngine, args) -> dict[str, float | bool]:
    """The linear layers' fp32 products through oneDNN (``onednn``) or PyTorch's default kernel
    (``default``), switched on the same model; the prefix cache is emptied before every timed
    rollout, so each one prefills the same prompts."""
    from areal_env.engine.cpu_linear import set_onednn_linears

    def use(side: str) -> None:
        with engine.worker.at_step_boundary():
            set_onednn_linears(engine.worker.model, side == "onednn")
        engine.set_prefix_cache_mb(0)
        engine.set_prefix_cache_mb(args.prefix_cache_mb)

    def describe(before: dict, after: dict) -> str:
        return f"{int(after['decode_steps'] - before['decode_steps'])} decode steps"

    greedy, wall, tokens = alternate_sides(engine, args, ("default", "onednn"), use, describe)
    use("onednn")
    return {
        "onednn_vs_default": round(wall["default"] / wall["onednn"], 2),
        "linear_tok_s_default": round(tokens / wall["default"], 1),
        "linear_tok_s_onednn": round(tokens / wall["onednn"], 1),
        "linear_same_outputs": greedy["onednn"] == greedy["default"],
    }


async def staggered_rollout(
    engine: LocalEngine, prompts, tool_ids, turns: int = 3, greedy: bool = False
) -> list[list[int]]:
    """Agent episodes whose turns come back at different times, as the demo's do: episode
    ``i`` writes 10 + 4 * (i % 5) tokens a turn and waits 20-60 ms on its "tool" between
    turns, so next turns join a batch that is still decoding."""
    g: dict = dict(ignore_eos=True)
    g.update(greedy=True) if greedy else g.update(temperature=1.0, top_k=0, top_p=1.0)

    async def episode(i: int, prompt: list[int]) -> list[int]:
        out: list[int] = []
        for t in range(turns):
            cfg = GenerationConfig(seed=1000 * t + i, max_new_tokens=10 + 4 * (i % 5), **g)
            r = await engine.agenerate(ModelRequest(prompt, cfg))
            out += r.output_tokens
            prompt = prompt + r.output_tokens + tool_ids
            await asyncio.sleep(0.02 * (1 + i % 3))
        return out

    return list(await asyncio.gather(*(episode(i, p) for i, p in enumerate(prompts))))


def joining_case(engine: LocalEngine, args) -> dict[str, float | bool]:
    """Next turns joining a batch that holds the system prompt once: their prefill reads the
    prefix from the batch (``read``) or copies it into every joining row, as it did until
    2026-11-29 (``copied``: the worker is told no prefix is joinable), alternating
    ``--prefix-repeats`` times each on the staggered traffic of :func:`staggered_rollout` (8
    problems x 4 samples, three turns); greedy outputs compared."""
    tok = engine.tokenizer
    prompts = agent_prompts(tok, args.system_tokens, 8, 4)
    tool_ids = tool_result_ids(tok)
    engine.set_prefix_cache_mb(args.prefix_cache_mb)
    worker = engine.worker
    joinable = worker._joinable_shared_prefix

    def use(side: str) -> None:
        worker._joinable_shared_prefix = (  # type: ignore[method-assign]
            joinable if side == "read" else (lambda admit, cached: None)
        )

    greedy: dict[str, list[list[int]]] = {}
    walls: dict[str, list[float]] = {"copied": [], "read": []}
    read_tokens: dict[str, float] = {"copied": 0.0, "read": 0.0}
    try:
        for side in ("copied", "read"):  # also warms both paths up
            use(side)
            greedy[side] = asyncio.run(staggered_rollout(engine, prompts, tool_ids, greedy=True))
        for rep in range(args.prefix_repeats):
            for side in ("copied", "read") if rep % 2 == 0 else ("read", "copied"):
                use(side)
                before = engine.stats()["shared_prefix_prefill_row_tokens"]
                t0 = time.perf_counter()
                asyncio.run(staggered_rollout(engine, prompts, tool_ids))
                walls[side].append(time.perf_counter() - t0)
                read_tokens[side] += engine.stats()["shared_prefix_prefill_row_tokens"] - before
                print(f"rep {rep} {side:6s}: {walls[side][-1]:6.2f}s", flush=True)
    finally:
        use("read")
    copied, read = statistics.median(walls["copied"]), statistics.median(walls["read"])
    return {
        "joining_read_vs_copied": round(copied / read, 3),
        "joining_copied_s": round(copied, 2),
        "joining_read_s": round(read, 2),
        "joining_prefix_tokens_read_once": read_tokens["read"],
        "joining_same_outputs": greedy["read"] == greedy["copied"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="model name or HF folder")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument(
        "--baseline-requests",
        type=int,
        default=None,
        help="time only this many one-by-one requests per size and scale up (default: all)",
    )
    ap.add_argument("--quick", action="store_true", help="smoke test: 8 new tokens, 4 baseline")
    ap.add_argument(
        "--case",
        choices=["batching", "prefix", "shared", "joining", "linear", "all"],
        default="all",
    )
    ap.add_argument(
        "--system-tokens",
        type=int,
        default=500,
        help="prefix case: least tokens of the shared system prompt",
    )
    ap.add_argument("--prefix-new-tokens", type=int, default=20)
    ap.add_argument("--prefix-repeats", type=int, default=2)
    ap.add_argument("--prefix-cache-mb", type=float, default=256)
    args = ap.parse_args(argv)
    if args.quick:
        args.new_tokens = 8
        args.baseline_requests = args.baseline_requests or 4

    if args.threads:
        torch.set_num_threads(args.threads)  # this thread runs the one-by-one baseline
    engine = LocalEngine(
        str(resolve_model_path(args.model)), max_batch_size=32, num_threads=args.threads
    )
    engine.initialize()
    try:
        model, tok = engine.model, engine.tokenizer
        prompts = build_prompts(tok, 32)
        pad_id = engine.eos_token_ids[0]
        print(
            f"model {os.path.basename(engine.model_path)}, {torch.get_num_threads()} torch threads, "
            f"{args.new_tokens} new tokens per request, prompt lengths "
            f"{min(map(len, prompts))}-{max(map(len, prompts))}",
            flush=True,
        )
        # warm-up both paths (allocator, oneDNN kernels)
        asyncio.run(engine_run(engine, prompts[:2], 4))
        hf_one_by_one(model, prompts[:1], 4, pad_id)

        result: dict[str, float] = {}
        if args.case in ("prefix", "all"):
            result.update(prefix_case(engine, args))
        if args.case in ("shared", "all"):
            result.update(shared_prefix_case(engine, args))
        if args.case in ("joining", "all"):
            result.update(joining_case(engine, args))
        if args.case in ("linear", "all"):
            result.update(linear_case(engine, args))
        done_baseline: list[float] = []
        for n in (8, 32) if args.case in ("batching", "all") else ():
            load = os.getloadavg()[0]
            t_engine = asyncio.run(engine_run(engine, prompts[:n], args.new_tokens))
            todo = prompts[len(done_baseline) : n]
            if args.baseline_requests is not None:
                todo = todo[: max(0, args.baseline_requests - len(done_baseline))]
            if todo:
                done_baseline += hf_one_by_one(model, todo, args.new_tokens, pad_id)
            measured = done_baseline[:n]
            t_base = sum(measured) / len(measured) * n  # scaled up when only a subset was timed
            tokens = n * args.new_tokens
            speedup = t_base / t_engine
            print(
                f"n={n:2d}: LocalEngine {t_engine:7.2f}s ({tokens / t_engine:6.1f} tok/s) | "
                f"one-by-one generate {t_base:7.2f}s ({tokens / t_base:5.1f} tok/s, "
                f"{len(measured)} timed) | speedup {speedup:.2f}x | load avg {load:.1f}",
                flush=True,
            )
            result[f"speedup_{n}"] = round(speedup, 2)
            result[f"tok_s_{n}"] = round(tokens / t_engine, 1)
        if done_baseline:
            result["baseline_tok_s"] = round(
                len(done_baseline) * args.new_tokens / sum(done_baseline), 1
            )
        stats = engine.stats()
        print(
            f"engine stats: {int(stats['decode_steps'])} decode steps, mean batch "
            f"{stats['mean_batch_size']:.1f}, max batch {int(stats['max_batch_size_seen'])}",
            flush=True,
        )
    finally:
        engine.destroy()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
