"""Generate the example task's problems: ``train.jsonl`` and the held-out ``valid.jsonl``.

    python examples/aenv/make_dataset.py            # writes both next to this file

Arithmetic word problems that mix the four operations and need one to three tool calls
(``add``/``subtract``/``multiply``/``divide`` of ``env_tools.py``). The texts never name a tool:
choosing the tool, filling in its arguments and composing results is what the agent learns. The
numbers are large enough that SmolLM2-135M rarely gets them right without a tool. Training and
held-out problems come from disjoint random streams, and no held-out question text appears in the
training set. Deterministic (fixed seeds): the committed files are what this script writes.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent

NAMES = ["Tom", "Ana", "Lee", "Mia", "Sam", "Ivy", "Raj", "Zoe", "Ben", "Kim", "Eli", "Ada"]
THINGS = ["apples", "coins", "stamps", "books", "shells", "cards", "pens", "marbles", "beads"]

Problem = tuple[str, int, str, int]  # question, answer, kind, calls needed


def _one_step(r: random.Random) -> Problem:
    """One call: the operation is said in words, not named as a tool."""
    who, thing = r.choice(NAMES), r.choice(THINGS)
    op = r.choice(["add", "subtract", "multiply", "divide"])
    if op == "add":
        a, b = r.randint(120, 899), r.randint(120, 899)
        q = r.choice(
            [
                f"{who} has {a} {thing} and gets {b} more. How many {thing} does {who} have now?",
                f"What is {a} plus {b}?",
                f"A shop sold {a} {thing} on Monday and {b} on Tuesday. How many in total?",
            ]
        )
        return q, a + b, "add", 1
    if op == "subtract":
        a = r.randint(400, 999)
        b = r.randint(101, a - 50)
        q = r.choice(
            [
                f"{who} had {a} {thing} and gave away {b}. How many {thing} are left?",
                f"What is {a} minus {b}?",
                f"A box held {a} {thing}; {b} were taken out. How many are still in the box?",
            ]
        )
        return q, a - b, "subtract", 1
    if op == "multiply":
        a, b = r.randint(12, 89), r.randint(12, 49)
        q = r.choice(
            [
                f"There are {a} bags with {b} {thing} in each bag. How many {thing} in all?",
                f"What is {a} times {b}?",
                f"{who} buys {a} packs of {b} {thing}. How many {thing} does {who} get?",
            ]
        )
        return q, a * b, "multiply", 1
    b, c = r.randint(3, 19), r.randint(12, 99)
    a = b * c
    q = r.choice(
        [
            f"{who} shares {a} {thing} equally among {b} friends. How many does each friend get?",
            f"What is {a} divided by {b}?",
            f"{a} {thing} are packed into {b} equal boxes. How many {thing} go in each box?",
        ]
    )
    return q, c, "divide", 1


def _two_step(r: random.Random) -> Problem:
    who, thing = r.choice(NAMES), r.choice(THINGS)
    kind = r.choice(["mul_add", "mul_sub", "add_mul"])
    if kind == "mul_add":
        a, b, c = r.randint(12, 49), r.randint(12, 39), r.randint(101, 499)
        q = (
            f"{who} has {a} boxes of {b} {thing} and {c} loose {thing}. "
            f"How many {thing} does {who} have?"
        )
        return q, a * b + c, kind, 2
    if kind == "mul_sub":
        a, b = r.randint(15, 49), r.randint(15, 39)
        c = r.randint(101, a * b - 50)
        q = f"{who} buys {a} packs of {b} {thing} and uses {c} of them. How many are left?"
        return q, a * b - c, kind, 2
    a, b, c = r.randint(12, 59), r.randint(12, 59), r.randint(3, 9)
    q = (
        f"A class has {a} boys and {b} girls. Each child gets {c} {thing}. "
        f"How many {thing} are needed?"
    )
    return q, (a + b) * c, kind, 2


def _three_step(r: random.Random) -> Problem:
    who, thing = r.choice(NAMES), r.choice(THINGS)
    a, b = r.randint(12, 39), r.randint(12, 29)
    c, d = r.randint(3, 9), r.randint(21, 99)
    q = (
        f"{who} buys {a} packs of {b} {thing} and {c} more packs of {b}, then gives away {d}. "
        f"How many {thing} does {who} have left?"
    )
    return q, (a + c) * b - d, "add_mul_sub", 3


#: (generator, weight): most problems need one call, some two, a few three.
MIX: list[tuple[Callable[[random.Random], Problem], float]] = [
    (_one_step, 0.7),
    (_two_step, 0.22),
    (_three_step, 0.08),
]


def generate(n: int, seed: int, prefix: str, exclude: set[str] | None = None) -> list[dict]:
    r = random.Random(seed)
    gens, weights = zip(*MIX, strict=True)
    out: list[dict] = []
    seen = set(exclude or ())
    while len(out) < n:
        q, answer, kind, calls = r.choices(gens, weights)[0](r)
        if q in seen:
            continue
        seen.add(q)
        out.append(
            {
                "task_id": f"{prefix}-{len(out):03d}",
                "question": q,
                "answer": answer,
                "kind": kind,
                "calls": calls,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=int, default=512, help="training problems")
    ap.add_argument("--valid", type=int, default=64, help="held-out problems")
    ap.add_argument("--out", default=str(HERE), help="output folder")
    args = ap.parse_args(argv)
    valid = generate(args.valid, seed=20261124, prefix="valid")
    train = generate(args.train, seed=7, prefix="train", exclude={v["question"] for v in valid})
    out = Path(args.out)
    for name, rows in (("train.jsonl", train), ("valid.jsonl", valid)):
        (out / name).write_text("".join(json.dumps(x) + "\n" for x in rows))
        print(f"wrote {len(rows)} problems to {out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
