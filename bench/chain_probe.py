"""Can a model take the second step of a tool chain? A probe to run before training for depth.

RL can only reinforce what the policy samples. A two-step problem of the demo (``mul_add``:
multiply, then add the loose items) is solved only when, after a right first call, the model
(1) calls again instead of answering, (2) picks the right tool and (3) fills in the right
arguments: the tool result and the number of the question not used yet. This probe puts each
multi-call problem of the held-out sets in that state: the right first call and its result,
spliced as the proxy splices the demo's turns (``second_turn_prompt``: the calculator's tool
schemas, ``AenvAgent``'s system prompt, the first turn's ``required`` line and prefill, the call
ending where its JSON ends; checked against the 512 second-turn prompts that two runs'
evaluations recorded: all the same text, 498 the same tokens, 14 one token apart where the
model had tokenized its own call differently),
and measures on the model:

- ``p_call_again``: the probability that the reply starts with the call tag (``<tool_call>``,
  ``tool_choice: auto``), mean over problems; ``greedy_calls_again``: how many greedy replies do;
- ``p_right_tool``: the probability of the solution's next tool once a call is started, and
  ``greedy_right_tool``;
- ``p_right_arguments``: the probability of the next step's arguments object (both operand
  orders of ``add``/``multiply``) once the right tool is named, and ``greedy_right_arguments``;
- ``p_right_second_step``: the product per problem (mean): how often a sampled reply at T=1 is
  the right second call. With ``choice_exploration`` drawing the tool, a rollout finds it at
  about ``p_call_again`` x 1/4 x ``p_right_arguments``.

    .venv/bin/python bench/chain_probe.py                          # the default model
    .venv/bin/python bench/chain_probe.py --model RUN/checkpoints/step_10/model

The last line is one JSON object with those figures (and the per-problem rows with ``-v``).
Measured: docs/training.md, "Why the demo does not learn to chain tools".
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import statistics
import sys
from pathlib import Path

import torch

from areal_env.engine.models import DEFAULT_MODEL, resolve_model_path
from areal_env.envs.agent import DEFAULT_SYSTEM_PROMPT
from areal_env.proxy.cache import Interaction
from areal_env.proxy.render import ChatRenderer

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "aenv"
SETS = ("valid.jsonl", "valid_new_phrasing.jsonl")


def calculator_tools(path: Path = EXAMPLE / "env_tools.py") -> list[dict]:
    """The OpenAI tool list the agent offers: each ``@register_tool`` function of ``path`` with
    its docstring and number parameters (read from the source: the environment's own
    ``aenv`` package need not be importable here)."""
    tools = []
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        if not any(getattr(d, "id", None) == "register_tool" for d in node.decorator_list):
            continue
        params = [a.arg for a in node.args.args]
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": node.name,
                    "description": ast.get_docstring(node) or "",
                    "parameters": {
                        "properties": {p: {"type": "number"} for p in params},
                        "required": params,
                        "type": "object",
                    },
                },
            }
        )
    return tools


def call_message(step: list, call_id: str) -> dict:
    name, a, b, _ = step
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": json.dumps({"a": a, "b": b})},
            }
        ],
    }


def second_turn_prompt(
    renderer: ChatRenderer,
    tools: list[dict],
    question: str,
    call_text: str,
    call: dict,
    result: str,
) -> list[int]:
    """The token ids of the reply after the first call, as the proxy builds them: the first
    turn's prompt (``required``: the "must call" line and the call's opening prefilled), the
    model's call (``call_text``, what it wrote after the prefill; the reply ends where the call's
    JSON ends), the end of the turn and the tool result, spliced (``render_extension``)."""
    turn1 = [
        {"role": "system", "content": DEFAULT_SYSTEM_PROMPT},
        {"role": "user", "content": question},
    ]
    output_ids = renderer.tokenizer.encode(call_text, add_special_tokens=False)
    parent = Interaction(
        id="probe",
        session_id="probe",
        messages=turn1,
        tools=tools,
        output_message=call,
        prompt_ids=renderer.render_prompt(turn1, tools, "required"),
        output_ids=output_ids,
        output_logprobs=[0.0] * len(output_ids),
        output_versions=[0] * len(output_ids),
        stop_reason="tool_calls",
    )
    tool = {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": result}
    return renderer.render_extension(parent, [tool], tools, "auto")


class Probe:
    """Greedy continuations and teacher-forced logprobs of one model on rendered prompts."""

    def __init__(self, model_path: str, threads: int | None) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if threads:
            torch.set_num_threads(threads)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.renderer = ChatRenderer(self.tokenizer, worked_example=False)

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_new_tokens: int = 24) -> str:
        ids = torch.tensor([prompt])
        out = self.model.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
        )
        return self.tokenizer.decode(out[0, ids.shape[1] :])

    @torch.inference_mode()
    def logprob(self, prompt: list[int], continuation: str) -> float:
        """log P(continuation | prompt): the continuation in its own tokens (how the model writes
        it after that prompt)."""
        full = prompt + self.ids(continuation)
        logits = self.model(torch.tensor([full])).logits[0].float().log_softmax(-1)
        return float(sum(logits[i - 1, full[i]] for i in range(len(prompt), len(full))))


def probe_problem(probe: Probe, tools: list[dict], row: dict) -> dict:
    first, second = row["steps"][0], row["steps"][1]
    opening = probe.renderer.prefill_text(tools, "required")  # '<tool_call>[{"name": "'
    call_tag = opening.split("[")[0].split("{")[0] or opening  # '<tool_call>'
    # The first call as the model writes it after the prefill (stopped where its JSON ends).
    first_text = f'{first[0]}", "arguments": {{"a": {first[1]}, "b": {first[2]}}}}}]'
    prompt = second_turn_prompt(
        probe.renderer,
        tools,
        row["question"],
        first_text,
        call_message(first, "call_1"),
        str(first[3]),
    )
    name, a, b = second[0], second[1], second[2]
    argument_texts = [f'", "arguments": {{"a": {a}, "b": {b}}}']
    if name in ("add", "multiply") and a != b:
        argument_texts.append(f'", "arguments": {{"a": {b}, "b": {a}}}')
    opened = prompt + probe.ids(opening)
    named = opened + probe.ids(name)

    greedy = probe.greedy(prompt)
    greedy_tool = probe.greedy(opened, 6).split('"')[0]
    filled = probe.greedy(named, 24)
    p_call = math.exp(probe.logprob(prompt, call_tag))
    p_tool = math.exp(probe.logprob(opened, name))
    p_args = sum(math.exp(probe.logprob(named, t)) for t in argument_texts)
    return {
        "task_id": row["task_id"],
        "kind": row["kind"],
        "want": f"{name}({a}, {b})",
        "greedy_reply": greedy,
        "greedy_tool": greedy_tool,
        "greedy_arguments": filled,
        "calls_again": greedy.lstrip().startswith(call_tag),
        "right_tool": greedy_tool == name,
        "right_arguments": any(filled.startswith(t) for t in argument_texts),
        "p_call_again": p_call,
        "p_right_tool": p_tool,
        "p_right_arguments": p_args,
        "p_right_second_step": p_call * p_tool * p_args,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="model name, HF folder or checkpoint")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each problem's row")
    ap.add_argument("--limit", type=int, default=None, help="probe only the first N problems")
    args = ap.parse_args(argv)

    probe = Probe(str(resolve_model_path(args.model)), args.threads)
    tools = calculator_tools()
    rows = [
        json.loads(line)
        for name in SETS
        for line in (EXAMPLE / name).read_text().splitlines()
        if line.strip()
    ]
    rows = [r for r in rows if r["calls"] > 1][: args.limit]
    results = []
    for i, row in enumerate(rows, 1):
        results.append(probe_problem(probe, tools, row))
        r = results[-1]
        print(
            f"[{i}/{len(rows)}] {r['kind']:<11} want {r['want']:<22} greedy "
            f"{r['greedy_reply'][:24]!r:<28} tool {r['greedy_tool']!r:<12} "
            f"p(call) {r['p_call_again']:.3f} p(tool) {r['p_right_tool']:.3f} "
            f"p(args) {r['p_right_arguments']:.3f}",
            file=sys.stderr,
            flush=True,
        )

    def mean(key: str) -> float:
        return float(f"{statistics.mean(r[key] for r in results):.3g}")

    summary: dict = {
        "model": args.model,
        "problems": len(results),
        "greedy_calls_again": sum(r["calls_again"] for r in results),
        "greedy_right_tool": sum(r["right_tool"] for r in results),
        "greedy_right_arguments": sum(r["right_arguments"] for r in results),
        "p_call_again": mean("p_call_again"),
        "p_right_tool": mean("p_right_tool"),
        "p_right_arguments": mean("p_right_arguments"),
        "p_right_second_step": mean("p_right_second_step"),
    }
    if args.verbose:
        summary["rows"] = results
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
