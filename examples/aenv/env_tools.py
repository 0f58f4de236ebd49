"""The example environment: calculator tools and a reward for arithmetic word problems.

Served by the aenvironment server (``python -m aenv.main examples/aenv/env_tools.py --host
127.0.0.50 --port 8081``). The tools are stateless, so one server can serve many concurrent
episodes. The problems (``make_dataset.py``) mix the four operations and need one to three
calls; the reward pays only for a right answer given in plain text (see ``reward``).
"""

from __future__ import annotations

import math
import re
from typing import Any

from aenv import register_reward, register_tool

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _fmt(x: float) -> str:
    """Integers without a trailing ``.0`` so the model can copy the result verbatim."""
    return str(int(x)) if float(x).is_integer() else f"{x:.6g}"


@register_tool
def add(a: float, b: float) -> str:
    """Add two numbers and return the sum."""
    return _fmt(a + b)


@register_tool
def subtract(a: float, b: float) -> str:
    """Subtract b from a and return the difference."""
    return _fmt(a - b)


@register_tool
def multiply(a: float, b: float) -> str:
    """Multiply two numbers and return the product."""
    return _fmt(a * b)


@register_tool
def divide(a: float, b: float) -> str:
    """Divide a by b and return the quotient."""
    if b == 0:
        raise ValueError("division by zero")
    return _fmt(a / b)


_MARKUP = re.compile(r"</?\s*tool_(?:call|response)|<\|im_(?:start|end)\|>")


def last_number(text: str | None) -> float | None:
    """The last number written in ``text`` (how the final answer is read), or None."""
    if not text:
        return None
    found = _NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


def plain_answer(text: str | None) -> bool:
    """Whether ``text`` is a plain-text answer: no tool-call or tool-result markup in it.

    A model that copies ``<tool_response>\\nN\\n</tool_response>`` (or writes a call it never
    makes) has not answered; such text does not pay, even when N is right.
    """
    return bool(text and text.strip()) and _MARKUP.search(text) is None


CALL_CREDIT = 0.25
"""What a right tool call earns (a right answer earns 1.0): paid to the completion that made the
call, so a right first step of a two-step problem is learned before the whole chain is."""


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def right_step(call: dict, step: list) -> bool:
    """Whether ``call`` (``{"name", "arguments", "is_error"}``) is the solution step ``step``
    (``[tool, a, b, result]``); ``add`` and ``multiply`` take their operands in either order."""
    name, a, b = step[0], float(step[1]), float(step[2])
    args = call.get("arguments")
    if call.get("is_error") or call.get("name") != name or not isinstance(args, dict):
        return False
    x, y = _number(args.get("a")), _number(args.get("b"))
    if x is None or y is None:
        return False
    if (x, y) == (a, b):
        return True
    return name in ("add", "multiply") and (x, y) == (b, a)


def call_credits(calls: list, steps: list) -> list[float]:
    """``CALL_CREDIT`` for each call that makes the next step of the solution, else 0: the
    steps must come in order (a call that repeats a done step, or jumps ahead, earns nothing),
    and a wrong call in between does not stop a later right one from earning."""
    credits, done = [], 0
    for call in calls:
        if done < len(steps) and isinstance(call, dict) and right_step(call, steps[done]):
            credits.append(CALL_CREDIT)
            done += 1
        else:
            credits.append(0.0)
    return credits


def answer_in_reach(credits: list[float], steps: list) -> bool:
    """Whether a right answer could follow the tool results the agent got: no call was made
    (it may compute the answer itself), or its latest call was a right step of the solution
    (the answer, or the next call, is one copy away).

    After a wrong call (wrong tool or numbers, an error, a call the solution did not need) the
    reply reports a wrong result, and no reply the model can give there would be right: its
    completion is left out of the loss (``answer_in_reach: false``). Blamed, the faithful copy
    of a wrong result was pushed down in every episode whose call was wrong, most episodes of
    the first steps, and a run unlearned answering with the result (docs/training.md, "Credit
    per tool call")."""
    if not credits or not steps:
        return True
    return credits[-1] > 0


@register_reward
def reward(
    final_answer: str = "",
    task: dict | None = None,
    tool_calls: list | None = None,
    **_: Any,
) -> dict:
    """1.0 for a right plain answer, else 0.0; and ``call_rewards``: ``CALL_CREDIT`` for each
    tool call that is a right step of the solution (``task["steps"]``), paid to that call.

    The final answer is the agent's last reply (a reply without tool calls). It pays when it is
    plain text (no tool markup, see ``plain_answer``) and every number in it is the expected
    answer ("1509", "The total is 1509.").
    A right tool result that the agent does not turn into an answer, a number of the wrong
    operation, or a copied tool response score 0 for the episode; the right call itself still
    earns its credit (``call_credits``), so training can tell its turn from the answer's. A
    right answer after a call the solution did not need (one made once every step was done)
    does not pay either.

    ``task`` is the dataset item (it carries ``answer``); ``tool_calls`` lists the agent's calls
    as ``{"name", "arguments", "is_error", "result"}`` (reported, not scored).
    """
    task = task or {}
    expected = float(task.get("answer", "nan"))
    calls = [c for c in (tool_calls or []) if isinstance(c, dict)]
    ok_calls = [c for c in calls if not c.get("is_error", False)]
    plain = plain_answer(final_answer)
    numbers = [float(x) for x in _NUMBER.findall((final_answer or "").replace(",", ""))]
    got = numbers[-1] if plain and numbers else None
    # Every number in the answer must be the answer ("The answer is not 698" or "12 + 15 = 27"
    # is not a plain answer, even when its last number is right).
    correct = bool(plain and numbers) and all(
        math.isclose(x, expected, rel_tol=1e-6, abs_tol=1e-6) for x in numbers
    )
    steps = task.get("steps") if isinstance(task.get("steps"), list) else []
    credits = call_credits(tool_calls or [], steps)
    # A call after the solution's last step is wasted: the answer after it does not pay. (A
    # second call that returned the same number, then the right answer, taught the model to
    # call again where it should answer; docs/training.md, "Credit per tool call".)
    wasted = 0
    if steps and credits.count(CALL_CREDIT) == len(steps):
        last_step = max(i for i, c in enumerate(credits) if c)
        wasted = len(credits) - 1 - last_step
    correct = correct and wasted == 0
    return {
        "reward": 1.0 if correct else 0.0,
        "call_rewards": credits,
        "answer_in_reach": answer_in_reach(credits, steps),
        "wasted_calls": wasted,
        "correct": correct,
        "plain": plain,
        "parsed": got,
        "tool_calls": len(calls),
        "ok_tool_calls": len(ok_calls),
    }
