"""A test environment that counts tool invocations, to prove what was (not) retried.

Loaded by ``python -m aenv.main`` in the adapter tests; not a test module itself.
"""

from __future__ import annotations

import time
from collections import Counter

from aenv import register_function, register_reward, register_tool

CALLS: Counter[str] = Counter()


@register_tool
def bump(step: int = 1) -> str:
    """Count a call and return the running total."""
    CALLS["bump"] += step
    return str(CALLS["bump"])


@register_tool
def fail(message: str = "boom") -> str:
    """Count a call and raise (a tool error result)."""
    CALLS["fail"] += 1
    raise RuntimeError(message)


@register_tool
def slow(seconds: float = 1.0) -> str:
    """Count a call, then sleep (blocking the server, like a slow tool would)."""
    CALLS["slow"] += 1
    time.sleep(seconds)
    return "done"


@register_function
def calls() -> dict:
    """How often each tool ran on this server process."""
    return dict(CALLS)


@register_reward
def reward(value: float = 0.0, **_: object) -> float:
    """Echo ``value`` back, to test reward plumbing with a bare number."""
    if value < 0:
        raise ValueError("negative reward requested")
    return value
