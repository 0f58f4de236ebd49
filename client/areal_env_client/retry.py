"""When and how long to retry what the training service answers, for ``AgentSession`` and
``AgentRunner`` alike.

The service says "not now" in three ways: it is busy (429: a key quota, or the trainer has
enough rollouts in flight for its staleness bound), it is stopping or restarting (503 with
``Retry-After``, or the connection is refused while it is down), or a session it held is gone
(410, e.g. lost in a restart). A ``RetryBudget`` belongs to one sample: it decides whether the
next failure is retried, how long to sleep first, and keeps the counts apart: ``waits`` (times
the service said "not now" before a session opened) are not attempts.

Two clocks, both run only while the sample has no session because of a failure: ``busy`` (429)
against ``patience``, ``down`` (everything else worth retrying) against ``retry_for``. Time in a
concurrency queue or in a running episode never counts, so an outage late in a long run is
retried as readily as an early one.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import httpx

TRANSIENT_STATUS = frozenset({410, 429, 502, 503, 504})
"""HTTP statuses worth retrying with a new session (410: the session was lost, e.g. in a
restart; capacity, quota, shutdown, backend loss)."""

START_RETRY_STATUS = frozenset({429, 502, 503, 504})
"""Answers to ``POST /rl/v1/sessions`` that opened no session: asking again is always safe."""


def status_of(exc: BaseException) -> int | None:
    """The HTTP status carried by ``exc`` (ours, httpx's, the openai / anthropic SDKs')."""
    status = getattr(exc, "status_code", None)
    if status is None:
        status = getattr(getattr(exc, "response", None), "status_code", None)
    return status if isinstance(status, int) else None


def retry_after_of(exc: BaseException) -> float | None:
    """Seconds the service asked to wait (``Retry-After``), if it said."""
    value = getattr(exc, "retry_after", None)
    if value is None:
        headers = getattr(getattr(exc, "response", None), "headers", None)
        raw = headers.get("retry-after") if headers is not None else None
        try:
            value = float(raw) if raw is not None else None
        except ValueError:
            value = None
    return value


def is_transient(exc: BaseException) -> bool:
    """Connection failures and 410/429/502/503/504 answers (from httpx, openai, anthropic, us)."""
    if isinstance(exc, (httpx.TransportError, asyncio.TimeoutError, ConnectionError)):
        return True
    if status_of(exc) in TRANSIENT_STATUS:
        return True
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(
        names & {"APIConnectionError", "APITimeoutError", "ClientConnectionError", "ClientOSError"}
    )


def is_start_retryable(exc: BaseException) -> bool:
    """A failed ``POST /rl/v1/sessions`` worth asking again: the service was unreachable, busy
    or stopping (no session was opened, or one the service fails when it idles out)."""
    return isinstance(exc, httpx.TransportError) or status_of(exc) in START_RETRY_STATUS


@dataclass
class RetryBudget:
    """The retry policy and bookkeeping of one sample (one ``AgentSession`` or one sample of
    ``AgentRunner``): retry transient failures while the sample has spent less than
    ``retry_for`` seconds without a session because the service was down, and 429 answers
    while it has waited less than ``patience`` seconds on them; at most ``max_retries``
    retries after outages when given. Delays grow from ``backoff`` to ``max_backoff`` seconds
    (with jitter) or follow the service's ``Retry-After``."""

    retry_for: float = 300.0
    patience: float = 3600.0
    max_retries: int | None = None
    backoff: float = 0.5
    max_backoff: float = 10.0
    failures: int = 0
    """Retried failures of the ``down`` kind (outages, lost sessions): ``max_retries`` counts these."""
    waits: int = 0
    """Times the service answered "not now" (429, 503, unreachable) before opening a session."""
    spent: dict[str, float] = field(default_factory=lambda: {"busy": 0.0, "down": 0.0})
    """Seconds spent without a session, per kind, in settled waits."""
    waiting: tuple[str, float] | None = None
    """``(kind, since)``: without a session since a failure of that kind."""
    streak: int = field(default=0, init=False)
    """Failures since the last session opened (the backoff grows with them)."""

    @staticmethod
    def kind(exc: BaseException) -> str:
        """``busy`` (429) or ``down`` (anything else worth retrying)."""
        return "busy" if status_of(exc) == 429 else "down"

    def seconds_spent(self, kind: str, now: float | None = None) -> float:
        """Seconds spent without a session on failures of ``kind``, the current wait included."""
        now = time.monotonic() if now is None else now
        total = self.spent[kind]
        if self.waiting is not None and self.waiting[0] == kind:
            total += now - self.waiting[1]
        return total

    def will_retry(self, exc: BaseException, *, before_session: bool = False) -> bool:
        """Whether ``exc`` is retried: the clock of its kind has time left, and (for a failure
        after a session opened) ``max_retries`` is not used up. ``before_session``: the
        service refused to open a session (only ``is_start_retryable`` failures are retried)."""
        now = time.monotonic()
        if before_session and not is_start_retryable(exc):
            return False
        if status_of(exc) == 429:
            return self.seconds_spent("busy", now) < self.patience
        if not is_transient(exc):
            return False
        if (
            not before_session
            and self.max_retries is not None
            and self.failures + 1 > self.max_retries
        ):
            return False
        return self.seconds_spent("down", now) < self.retry_for

    def failed(self, exc: BaseException, *, before_session: bool = False) -> float:
        """Record a failure that will be retried; returns the seconds to sleep first. The
        sample is without a session from now; ``before_session``: the service refused to open
        one (counted in ``waits``)."""
        now = time.monotonic()
        self._settle(now)
        kind = self.kind(exc)
        if kind == "down" and not before_session:
            self.failures += 1
        if before_session:
            self.waits += 1
        self.waiting = (kind, now)
        self.streak += 1
        delay = min(self.backoff * 2 ** min(self.streak - 1, 10), self.max_backoff)
        delay *= 0.5 + random.random()
        hint = retry_after_of(exc)
        if hint is not None:
            delay = max(delay, min(hint, self.max_backoff * 6))
        return delay

    def got_session(self) -> None:
        """The service opened a session for the sample: the outage (or busy wait) is over."""
        self._settle(time.monotonic())
        self.streak = 0

    def _settle(self, now: float) -> None:
        if self.waiting is not None:
            kind, since = self.waiting
            self.spent[kind] += now - since
            self.waiting = None
