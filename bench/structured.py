"""Constrained decoding's cost on the embedded engine: tokens/s with a grammar against without.

The same prompts run on one ``LocalEngine`` (the default model) at batch 1 and 16, alternating
unconstrained and constrained rounds (``--repeats`` each, medians compared), so load changes on
a shared machine hit both sides. Every completion has exactly ``--new-tokens`` tokens: the
unconstrained rows ignore eos; the constrained rows must write a JSON object whose one string is
longer than that (``minLength``), so the grammar is live at every step and every step computes
and applies a mask over the 49,152-token vocabulary (inside a string nearly every token is
allowed: the widest masks). Target (issue 26): constrained >= 0.8x unconstrained at both sizes.

It also times compiling schemas (cold: a fresh compiler per schema, as a new schema arrives):
a pydantic-shaped strict schema, the structured-output shapes of ``bench/grammar_libraries.py``,
and a tool-call grammar (hermes wrapper around strict arguments).

The last line is one JSON object: ``ratio_b1``, ``ratio_b16``, the tok/s of each side, and the
compile times in ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

from areal_env.api.io import Constraint, GenerationConfig, ModelRequest
from areal_env.engine.grammar import GrammarCompiler
from areal_env.engine.local import LocalEngine
from areal_env.engine.models import DEFAULT_MODEL, resolve_model_path
from areal_env.proxy.tool_parsers import get_tool_parser

TOPICS = ["the sea", "a red fox", "rain", "the moon", "bread", "a train", "snow", "music"]


def _prompts(tok, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"Write a few lines about {TOPICS[i % len(TOPICS)]}."}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


async def _round(engine: LocalEngine, prompts: list[list[int]], g: GenerationConfig) -> float:
    """Tokens per second of one round (all prompts at once)."""
    t0 = time.perf_counter()
    outs = await asyncio.gather(
        *(engine.agenerate(ModelRequest(p, g.new(seed=i))) for i, p in enumerate(prompts))
    )
    wall = time.perf_counter() - t0
    return sum(len(o.output_tokens) for o in outs) / wall


def _compile_times(engine: LocalEngine) -> dict[str, float]:
    from bench.grammar_libraries import SCHEMAS, TOOL_SCHEMA

    def cold(constraint: Constraint) -> float:
        compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
        compiler.matcher(Constraint("json_schema", "{}"))  # tokenizer set-up, not counted
        t0 = time.perf_counter()
        compiler.matcher(constraint)
        return (time.perf_counter() - t0) * 1e3

    schemas = [s for name, s, _, _ in SCHEMAS if name not in ("unique_items", "if_then_else")]
    times = [cold(Constraint("json_schema", json.dumps(s))) for s in schemas]
    tools = [
        {
            "type": "function",
            "function": {"name": f"tool_{i}", "parameters": TOOL_SCHEMA, "strict": True},
        }
        for i in range(8)
    ]
    grammar = get_tool_parser("hermes").call_grammar(tools)
    assert grammar is not None
    tool_ms = cold(Constraint("grammar", grammar))
    return {
        "compile_ms_median": round(statistics.median(times), 2),
        "compile_ms_max": round(max(times), 2),
        "compile_tool_grammar_8_tools_ms": round(tool_ms, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--sizes", default="1,16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = LocalEngine(
        str(resolve_model_path(DEFAULT_MODEL)), num_threads=args.threads, prefix_cache_mb=0
    )
    engine.initialize()
    schema = {
        "type": "object",
        "properties": {"text": {"type": "string", "minLength": 8 * args.new_tokens}},
        "required": ["text"],
        "additionalProperties": False,
    }
    constraint = Constraint("json_schema", json.dumps(schema))
    plain = GenerationConfig(max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True)
    constrained = GenerationConfig(
        max_new_tokens=args.new_tokens, temperature=1.0, constraint=constraint
    )
    summary: dict[str, float] = {}
    try:
        asyncio.run(_round(engine, _prompts(engine.tokenizer, 2), constrained))  # warm-up
        for size in [int(x) for x in args.sizes.split(",")]:
            prompts = _prompts(engine.tokenizer, size)
            free, bound = [], []
            for _ in range(args.repeats):
                free.append(asyncio.run(_round(engine, prompts, plain)))
                bound.append(asyncio.run(_round(engine, prompts, constrained)))
            f, b = statistics.median(free), statistics.median(bound)
            print(
                f"batch {size:2d}: unconstrained {f:6.1f} tok/s, constrained {b:6.1f} tok/s, "
                f"ratio {b / f:.2f}  (rounds {[round(x, 1) for x in free]} / "
                f"{[round(x, 1) for x in bound]})"
            )
            summary[f"tok_s_b{size}"] = round(f, 2)
            summary[f"tok_s_constrained_b{size}"] = round(b, 2)
            summary[f"ratio_b{size}"] = round(b / f, 3)
        compile_times = _compile_times(engine)
        print("schema compile:", compile_times)
        summary.update(compile_times)
    finally:
        engine.destroy()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
