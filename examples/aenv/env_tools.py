"""The example environment: calculator tools and a reward for arithmetic word problems.

Served by the aenvironment server (``python -m aenv.main examples/aenv/env_tools.py --host
127.0.0.50 --port 8081``). The tools are stateless, so one server can serve many concurrent
episodes. The reward checks the final number in the agent's answer against the expected one,
with a little partial credit for a correct tool call so that a weak model gets a learning signal.
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


def last_number(text: str | None) -> float | None:
    """The last number written in ``text`` (how the final answer is read), or None."""
    if not text:
        return None
    found = _NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


@register_reward
def reward(
    final_answer: str = "",
    task: dict | None = None,
    tool_calls: list | None = None,
    **_: Any,
) -> dict:
    """Graded so that a weak model gets a signal at every step towards the right answer.

    1.0: the last number in the final answer is the expected answer;
    0.5: not that, but a tool call returned the expected answer (right tool, right arguments);
    0.1: not that, but at least one tool call succeeded (a well-formed call);
    0.0: otherwise.

    ``task`` is the dataset item (it carries ``answer``); ``tool_calls`` lists the agent's calls
    as ``{"name", "arguments", "is_error", "result"}``.
    """
    task = task or {}
    expected = float(task.get("answer", "nan"))
    calls = [c for c in (tool_calls or []) if isinstance(c, dict)]
    ok_calls = [c for c in calls if not c.get("is_error", False)]

    def matches(value: float | None) -> bool:
        return value is not None and math.isclose(value, expected, rel_tol=1e-6, abs_tol=1e-6)

    got = last_number(final_answer)
    if matches(got):
        score = 1.0
    elif any(matches(last_number(str(c.get("result", "")))) for c in ok_calls):
        score = 0.5
    elif ok_calls:
        score = 0.1
    else:
        score = 0.0
    return {"reward": score, "correct": matches(got), "parsed": got}
