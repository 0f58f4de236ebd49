"""Reward for the git-history questions: is the expected answer in the final answer?

1.0: the final answer contains the expected answer (case-insensitive);
0.25: not that, but a git tool's result contained it (the right tool call was made);
0.1: not that, but at least one tool call succeeded (a well-formed call);
0.0: otherwise. Partial credit gives a small model something to learn from.
"""

from __future__ import annotations

from typing import Any


def reward(data: dict[str, Any], final_answer: str, tool_calls: list[dict[str, Any]]) -> float:
    expected = str(data["answer"]).strip().lower()
    if expected in (final_answer or "").lower():
        return 1.0
    ok = [c for c in tool_calls if not c.get("is_error")]
    if any(expected in str(c.get("result", "")).lower() for c in ok):
        return 0.25
    return 0.1 if ok else 0.0
