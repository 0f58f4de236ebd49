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
    """1.0 for a correct final number; 0.2 for no correct answer but a tool call that succeeded.

    ``task`` is the dataset item (it carries ``answer``); ``tool_calls`` lists the calls the agent
    made as ``{"name", "arguments", "is_error"}``.
    """
    task = task or {}
    expected = float(task.get("answer", "nan"))
    got = last_number(final_answer)
    correct = got is not None and math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-6)
    used_tool = any(not c.get("is_error", False) for c in (tool_calls or []))
    score = 1.0 if correct else (0.2 if used_tool else 0.0)
    return {"reward": score, "correct": correct, "parsed": got}
