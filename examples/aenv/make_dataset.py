"""Generate the example task's problems: ``train.jsonl``, the held-out ``valid.jsonl`` and a
second held-out set in phrasings training never uses, ``valid_new_phrasing.jsonl``.

    python examples/aenv/make_dataset.py            # writes them next to this file

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

ANSWER_TOOL = "answer"  # the agent's answer tool (config.yaml: workflow_kwargs.answer_tool)

Step = tuple[str, int, int, int]  # tool, a, b, result: one call of a right solution
Problem = tuple[str, int, str, list[Step]]  # question, answer, kind, the calls of a solution


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
        return q, a + b, "add", [("add", a, b, a + b)]
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
        return q, a - b, "subtract", [("subtract", a, b, a - b)]
    if op == "multiply":
        a, b = r.randint(12, 89), r.randint(12, 49)
        q = r.choice(
            [
                f"There are {a} bags with {b} {thing} in each bag. How many {thing} in all?",
                f"What is {a} times {b}?",
                f"{who} buys {a} packs of {b} {thing}. How many {thing} does {who} get?",
            ]
        )
        return q, a * b, "multiply", [("multiply", a, b, a * b)]
    b, c = r.randint(3, 19), r.randint(12, 99)
    a = b * c
    q = r.choice(
        [
            f"{who} shares {a} {thing} equally among {b} friends. How many does each friend get?",
            f"What is {a} divided by {b}?",
            f"{a} {thing} are packed into {b} equal boxes. How many {thing} go in each box?",
        ]
    )
    return q, c, "divide", [("divide", a, b, c)]


def _two_step(r: random.Random) -> Problem:
    who, thing = r.choice(NAMES), r.choice(THINGS)
    kind = r.choice(["mul_add", "mul_sub", "add_mul"])
    if kind == "mul_add":
        a, b, c = r.randint(12, 49), r.randint(12, 39), r.randint(101, 499)
        q = (
            f"{who} has {a} boxes of {b} {thing} and {c} loose {thing}. "
            f"How many {thing} does {who} have?"
        )
        return q, a * b + c, kind, [("multiply", a, b, a * b), ("add", a * b, c, a * b + c)]
    if kind == "mul_sub":
        a, b = r.randint(15, 49), r.randint(15, 39)
        c = r.randint(101, a * b - 50)
        q = f"{who} buys {a} packs of {b} {thing} and uses {c} of them. How many are left?"
        return q, a * b - c, kind, [("multiply", a, b, a * b), ("subtract", a * b, c, a * b - c)]
    a, b, c = r.randint(12, 59), r.randint(12, 59), r.randint(3, 9)
    q = (
        f"A class has {a} boys and {b} girls. Each child gets {c} {thing}. "
        f"How many {thing} are needed?"
    )
    return q, (a + b) * c, kind, [("add", a, b, a + b), ("multiply", a + b, c, (a + b) * c)]


def _three_step(r: random.Random) -> Problem:
    who, thing = r.choice(NAMES), r.choice(THINGS)
    a, b = r.randint(12, 39), r.randint(12, 29)
    c, d = r.randint(3, 9), r.randint(21, 99)
    q = (
        f"{who} buys {a} packs of {b} {thing} and {c} more packs of {b}, then gives away {d}. "
        f"How many {thing} does {who} have left?"
    )
    steps = [
        ("add", a, c, a + c),
        ("multiply", a + c, b, (a + c) * b),
        ("subtract", (a + c) * b, d, (a + c) * b - d),
    ]
    return q, (a + c) * b - d, "add_mul_sub", steps


#: (generator, weight): most problems need one call, some two, a few three.
MIX: list[tuple[Callable[[random.Random], Problem], float]] = [
    (_one_step, 0.7),
    (_two_step, 0.22),
    (_three_step, 0.08),
]


# --------------------------------------------------------------------------------------------
# New phrasings: a second held-out set whose names, objects and sentence structures the
# training templates above never use (same kinds, same number ranges). A gain that only fits
# the training templates shows up as a gap between the two held-out sets.
# --------------------------------------------------------------------------------------------

NEW_NAMES = ["Priya", "Omar", "Lucia", "Kenji", "Fatima", "Noah", "Elena", "Tariq", "Greta"]
NEW_THINGS = ["tickets", "bottles", "crayons", "eggs", "bricks", "stickers", "seeds", "nails"]


def _new_one_step(r: random.Random) -> Problem:
    who, thing = r.choice(NEW_NAMES), r.choice(NEW_THINGS)
    op = r.choice(["add", "subtract", "multiply", "divide"])
    if op == "add":
        a, b = r.randint(120, 899), r.randint(120, 899)
        q = r.choice(
            [
                f"Add {a} and {b}.",
                f"On the first trip {who} carried {a} {thing}, on the second {b}. "
                f"What was carried altogether?",
                f"A farm collected {a} {thing} in the morning and another {b} in the afternoon. "
                f"Find the day's total.",
            ]
        )
        return q, a + b, "add", [("add", a, b, a + b)]
    if op == "subtract":
        a = r.randint(400, 999)
        b = r.randint(101, a - 50)
        q = r.choice(
            [
                f"Take {b} away from {a}.",
                f"A warehouse stocked {a} {thing} and shipped {b} of them. "
                f"How many remain in the warehouse?",
                f"{who} needs {a} {thing} and already owns {b}. How many more does {who} need?",
            ]
        )
        return q, a - b, "subtract", [("subtract", a, b, a - b)]
    if op == "multiply":
        a, b = r.randint(12, 89), r.randint(12, 49)
        q = r.choice(
            [
                f"Compute the product of {a} and {b}.",
                f"Each of {a} crates holds {b} {thing}. Find the number of {thing} in the crates.",
                f"{who} stacks {b} {thing} on every one of {a} shelves. "
                f"How many {thing} sit on the shelves?",
            ]
        )
        return q, a * b, "multiply", [("multiply", a, b, a * b)]
    b, c = r.randint(3, 19), r.randint(12, 99)
    a = b * c
    q = r.choice(
        [
            f"Split {a} into {b} equal parts. How big is each part?",
            f"{who} puts {a} {thing} into rows of the same length, {b} rows in all. "
            f"How long is one row?",
            f"A prize of {a} {thing} is divided evenly between {b} teams. What does one team get?",
        ]
    )
    return q, c, "divide", [("divide", a, b, c)]


def _new_two_step(r: random.Random) -> Problem:
    who, thing = r.choice(NEW_NAMES), r.choice(NEW_THINGS)
    kind = r.choice(["mul_add", "mul_sub", "add_mul"])
    if kind == "mul_add":
        a, b, c = r.randint(12, 49), r.randint(12, 39), r.randint(101, 499)
        q = (
            f"A store receives {a} cartons holding {b} {thing} apiece, plus {c} single {thing}. "
            f"What is the store's count of {thing} now?"
        )
        return q, a * b + c, kind, [("multiply", a, b, a * b), ("add", a * b, c, a * b + c)]
    if kind == "mul_sub":
        a, b = r.randint(15, 49), r.randint(15, 39)
        c = r.randint(101, a * b - 50)
        q = (
            f"{who} fills {a} trays with {b} {thing} each, then {c} {thing} break. "
            f"How many {thing} are still whole?"
        )
        return q, a * b - c, kind, [("multiply", a, b, a * b), ("subtract", a * b, c, a * b - c)]
    a, b, c = r.randint(12, 59), r.randint(12, 59), r.randint(3, 9)
    q = (
        f"Team red has {a} players and team blue has {b}. Every player receives {c} {thing}. "
        f"Work out how many {thing} are handed out."
    )
    return q, (a + b) * c, kind, [("add", a, b, a + b), ("multiply", a + b, c, (a + b) * c)]


def _new_three_step(r: random.Random) -> Problem:
    who, thing = r.choice(NEW_NAMES), r.choice(NEW_THINGS)
    a, b = r.randint(12, 39), r.randint(12, 29)
    c, d = r.randint(3, 9), r.randint(21, 99)
    q = (
        f"{who} orders {a} cases of {b} {thing}, later orders {c} further cases of the same "
        f"size, and returns {d} {thing}. How many {thing} does {who} keep?"
    )
    steps = [
        ("add", a, c, a + c),
        ("multiply", a + c, b, (a + c) * b),
        ("subtract", (a + c) * b, d, (a + c) * b - d),
    ]
    return q, (a + c) * b - d, "add_mul_sub", steps


#: Extra training problems that need two or three calls, in the same templates and proportions
#: as MIX's (22 : 8). ``train_chains.jsonl`` is the training set plus these: half of it is
#: multi-call (52 %, from 27 %). With 27 %, answering right after the first result paid so often
#: that greedy decoding never made a second call (docs/training.md, "Learning to chain calls").
CHAIN_MIX: list[tuple[Callable[[random.Random], Problem], float]] = [
    (_two_step, 0.22),
    (_three_step, 0.08),
]
CHAIN_EXTRA = 276

NEW_MIX: list[tuple[Callable[[random.Random], Problem], float]] = [
    (_new_one_step, 0.7),
    (_new_two_step, 0.22),
    (_new_three_step, 0.08),
]


def generate(
    n: int,
    seed: int,
    prefix: str,
    exclude: set[str] | None = None,
    mix: list[tuple[Callable[[random.Random], Problem], float]] = MIX,
) -> list[dict]:
    r = random.Random(seed)
    gens, weights = zip(*mix, strict=True)
    out: list[dict] = []
    seen = set(exclude or ())
    while len(out) < n:
        q, answer, kind, steps = r.choices(gens, weights)[0](r)
        if q in seen:
            continue
        seen.add(q)
        out.append(
            {
                "task_id": f"{prefix}-{len(out):03d}",
                "question": q,
                "answer": answer,
                "kind": kind,
                "calls": len(steps),
                # the calls of a right solution (tool, a, b, result): what a checker of
                # intermediate calls can verify (see env_tools.reward)
                "steps": [list(x) for x in steps],
                # the same solution as tool calls, ending with the call of the agent's answer
                # tool (config.yaml: workflow_kwargs.answer_tool): what a guided episode
                # follows (rollout.guide_key / guided_samples, docs/training.md)
                "reference": [
                    *({"name": tool, "arguments": {"a": a, "b": b}} for tool, a, b, _ in steps),
                    {"name": ANSWER_TOOL, "arguments": {"answer": str(answer)}},
                ],
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=int, default=512, help="training problems")
    ap.add_argument(
        "--chain-extra",
        type=int,
        default=CHAIN_EXTRA,
        help="extra two- and three-call training problems appended to the training set",
    )
    ap.add_argument("--valid", type=int, default=64, help="problems per held-out set")
    ap.add_argument("--out", default=str(HERE), help="output folder")
    args = ap.parse_args(argv)
    valid = generate(args.valid, seed=20261124, prefix="valid")
    train = generate(args.train, seed=7, prefix="train", exclude={v["question"] for v in valid})
    chains = train + generate(
        args.chain_extra,
        seed=8,
        prefix="chain",
        exclude={x["question"] for x in (*valid, *train)},
        mix=CHAIN_MIX,
    )
    new = generate(args.valid, seed=20261127, prefix="new", mix=NEW_MIX)
    out = Path(args.out)
    files = (
        ("train.jsonl", train),
        ("train_chains.jsonl", chains),  # config_chains.yaml's: half of it multi-call
        ("valid.jsonl", valid),
        ("valid_new_phrasing.jsonl", new),
    )
    for name, rows in files:
        (out / name).write_text("".join(json.dumps(x) + "\n" for x in rows))
        print(f"wrote {len(rows)} problems to {out / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
