"""Fault injection for the hardening tests: ``AREAL_ENV_FAULT`` (issue 15).

A crash at the worst moment of a step cannot be timed from outside the process: the window
between "the rollout's batch is in memory" and "the update starts" lasts microseconds. This hook
lets a test (or an operator rehearsing recovery) make the trainer kill itself exactly there.

``AREAL_ENV_FAULT=kill_before_update``      SIGKILL before the first update of this process;
``AREAL_ENV_FAULT=kill_before_update@N``    SIGKILL before the update of step ``N`` (1-based,
                                           the step the batch is for).

The variable is read once, when the trainer is built; unset (the normal case) the check is one
``is None`` test per step. A SIGKILL leaves nothing behind on purpose: no checkpoint, no metric
line, no dump of the doomed step; recovery must cope with exactly that. Unset the variable
before resuming, or the resumed run dies at the same step again.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass

logger = logging.getLogger(__name__)

ENV_VAR = "AREAL_ENV_FAULT"
KILL_BEFORE_UPDATE = "kill_before_update"


@dataclass(frozen=True)
class FaultPlan:
    """Where to die: before the update of ``step`` (``None``: the first step this process runs)."""

    kind: str
    step: int | None = None

    def should_kill_before_update(self, step: int) -> bool:
        return self.kind == KILL_BEFORE_UPDATE and (self.step is None or self.step == step)


def fault_from_env(environ: dict[str, str] | None = None) -> FaultPlan | None:
    """The plan in ``$AREAL_ENV_FAULT``; ``None`` when unset. A value that names no known fault
    raises at start-up (a typo must not silently run an unfaulted rehearsal)."""
    raw = (environ if environ is not None else os.environ).get(ENV_VAR, "").strip()
    if not raw:
        return None
    kind, _, at = raw.partition("@")
    if kind != KILL_BEFORE_UPDATE:
        raise ValueError(
            f"{ENV_VAR}={raw!r}: unknown fault {kind!r}; use {KILL_BEFORE_UPDATE!r} or "
            f"'{KILL_BEFORE_UPDATE}@N' (N = the 1-based step), or unset it"
        )
    if not at:
        return FaultPlan(kind)
    if not at.isdigit() or int(at) < 1:
        raise ValueError(
            f"{ENV_VAR}={raw!r}: the step after '@' must be a positive integer, "
            f"e.g. {KILL_BEFORE_UPDATE}@2"
        )
    return FaultPlan(kind, int(at))


def kill_now(reason: str) -> None:
    """SIGKILL this process (no cleanup handlers, no flushing: a real crash)."""
    logger.error("fault injection (%s): %s; sending SIGKILL to self", ENV_VAR, reason)
    for h in logging.getLogger().handlers:  # the test reads this line; the kill flushes nothing
        h.flush()
    os.kill(os.getpid(), signal.SIGKILL)
