"""``AgentRunner``: run an async agent over a dataset through the training service.

Retries are sized to outlast a service restart: connection failures and 410/502/503/504
answers (410: a session the service lost, e.g. in a restart) are retried in a fresh session of
the same GRPO group with exponential backoff (honouring ``Retry-After``) while the sample has
spent less than ``retry_for`` seconds without a session; "busy" answers (429: a quota, or the
trainer has enough rollouts in flight) for up to ``patience`` seconds of waiting. Only the time
a sample spends failing counts: neither its wait for a concurrency slot nor the episodes it ran,
so an episode cut by a restart late in a long run is retried as readily as an early one.

Exactly once: before a retry, the runner asks the service what became of the failed attempt's
session. One that is ``done`` was stored (e.g. the finalize reached the service but its answer
was lost in a restart): it is counted, not run again, so its group gets no extra member. An
attempt that will not be retried tells the service so, and its group stops waiting for it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from areal_env_client.hooks import SESSION_HEADER
from areal_env_client.session import (
    AgentServiceError,
    AgentSession,
    check_response,
    default_service_url,
)

logger = logging.getLogger(__name__)

TRANSIENT_STATUS = frozenset({410, 429, 502, 503, 504})
"""HTTP statuses worth retrying with a new session (410: the session was lost, e.g. in a
restart; capacity, quota, shutdown, backend loss)."""


def _status_of(exc: BaseException) -> int | None:
    status = getattr(exc, "status_code", None)
    if status is None:
        status = getattr(getattr(exc, "response", None), "status_code", None)
    return status if isinstance(status, int) else None


def _retry_after_of(exc: BaseException) -> float | None:
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
    """Connection failures and 429/502/503/504 answers (from httpx, openai, anthropic, us)."""
    if isinstance(exc, (httpx.TransportError, asyncio.TimeoutError, ConnectionError)):
        return True
    if _status_of(exc) in TRANSIENT_STATUS:
        return True
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(
        names & {"APIConnectionError", "APITimeoutError", "ClientConnectionError", "ClientOSError"}
    )


@dataclass
class AgentResult:
    """What ``AgentRunner.run`` got for one dataset item (``group_size`` samples)."""

    index: int
    item: Any
    rewards: list[float | None] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)
    session_ids: list[str | None] = field(default_factory=list)
    attempts: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(e is None for e in self.errors)

    @property
    def mean_reward(self) -> float | None:
        vals = [r for r in self.rewards if r is not None]
        return sum(vals) / len(vals) if vals else None


AgentFn = Callable[[Any], Awaitable[float | None]]


@dataclass
class _Attempts:
    """Retry bookkeeping of one sample: how long it has been without a session because the
    service was unavailable (``down``) or busy (429), and its failures.

    The clocks run only from a failure until the service gives the sample a session again: a
    sample's time in the concurrency queue and in its episodes never counts, so the budget
    ``retry_for`` measures outages, whenever in a long run they happen.
    """

    retry_for: float
    patience: float
    max_retries: int | None
    failures: int = 0
    spent: dict[str, float] = field(default_factory=lambda: {"busy": 0.0, "down": 0.0})
    waiting: tuple[str, float] | None = None
    """``(kind, since)``: without a session since a failure of that kind."""

    @staticmethod
    def _kind(exc: BaseException) -> str:
        return "busy" if _status_of(exc) == 429 else "down"

    def _spent(self, kind: str, now: float) -> float:
        total = self.spent[kind]
        if self.waiting is not None and self.waiting[0] == kind:
            total += now - self.waiting[1]
        return total

    def will_retry(self, exc: BaseException) -> bool:
        now = time.monotonic()
        if _status_of(exc) == 429:
            return self._spent("busy", now) < self.patience
        if not is_transient(exc):
            return False
        if self.max_retries is not None and self.failures + 1 > self.max_retries:
            return False
        return self._spent("down", now) < self.retry_for

    def failed(self, exc: BaseException) -> None:
        """A failure that will be retried: the sample is without a session from now."""
        now = time.monotonic()
        self._settle_clock(now)
        kind = self._kind(exc)
        if kind == "down":
            self.failures += 1
        self.waiting = (kind, now)

    def got_session(self) -> None:
        """The service opened a session for the sample: the outage (or busy wait) is over."""
        self._settle_clock(time.monotonic())

    def _settle_clock(self, now: float) -> None:
        if self.waiting is not None:
            kind, since = self.waiting
            self.spent[kind] += now - since
            self.waiting = None


@dataclass
class _Episode:
    """One attempt: its session (once the service opened it) and the agent's reward."""

    session_id: str | None = None
    reward: float | None = None


class AgentRunner:
    """Run an async agent over a dataset through the training service.

    Each item runs ``group_size`` times, each run in its own ``AgentSession`` sharing one
    ``group_id`` (one GRPO group, so ``group_size`` should equal the service's
    ``rollout.n_samples``). ``agent_fn(item)`` returns the reward (finalized for it) or None
    (it finalized or rewarded itself: ``current_session()``, the helpers, or raw calls).
    """

    def __init__(
        self,
        service_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 60.0,
        verify: bool | str = True,
    ) -> None:
        self.service_url = (service_url or default_service_url()).rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY", "")
        self.timeout = timeout
        self.verify = verify

    async def run(
        self,
        agent_fn: AgentFn,
        dataset: Iterable[Any],
        *,
        concurrency: int = 8,
        group_size: int = 1,
        max_retries: int | None = None,
        retry_for: float = 300.0,
        progress: bool = True,
        backoff: float = 0.5,
        max_backoff: float = 10.0,
        group_prefix: str | None = None,
        patience: float = 3600.0,
    ) -> list[AgentResult]:
        """Run every item ``group_size`` times; returns one ``AgentResult`` per item.

        Transient failures are retried (in a fresh session of the same group) until the sample
        has spent ``retry_for`` seconds without a session since its first failure (and at most
        ``max_retries`` times when given), 429 answers until it has waited ``patience`` seconds
        on them; time queued for a concurrency slot or running episodes does not count. Delays
        grow from ``backoff`` to ``max_backoff`` seconds, or follow the service's Retry-After.
        An attempt whose session the service reports ``done`` (stored, though its answer was
        lost) is counted, not run again.
        """
        items = list(dataset)
        if concurrency < 1 or group_size < 1 or (max_retries is not None and max_retries < 0):
            raise ValueError("concurrency and group_size must be >= 1, max_retries >= 0")
        prefix = group_prefix or "run-" + secrets.token_hex(4)
        results = [
            AgentResult(
                index=i,
                item=item,
                rewards=[None] * group_size,
                errors=[None] * group_size,
                session_ids=[None] * group_size,
                attempts=[0] * group_size,
            )
            for i, item in enumerate(items)
        ]
        semaphore = asyncio.Semaphore(concurrency)
        bar = _progress(len(items) * group_size, progress)
        async with httpx.AsyncClient(timeout=self.timeout, verify=self.verify) as http:

            async def one(index: int, sample: int) -> None:
                res = results[index]
                group_id = f"{prefix}-{index}"
                state = _Attempts(retry_for, patience, max_retries)
                tries = 0
                async with semaphore:
                    unsettled: _Episode | None = None
                    while True:
                        tries += 1
                        episode: _Episode | None = None
                        try:
                            if unsettled is not None:
                                # The last attempt failed after its session opened: was it
                                # stored anyway (e.g. its finalize's answer was lost)?
                                if await self._stored(http, unsettled.session_id):
                                    episode = unsettled
                                else:
                                    unsettled = None
                            if episode is None:
                                res.attempts[sample] += 1
                                episode = _Episode()
                                await self._episode(
                                    http, agent_fn, res.item, group_id, state, episode
                                )
                            res.rewards[sample] = episode.reward
                            res.session_ids[sample] = episode.session_id
                            res.errors[sample] = None
                            break
                        except Exception as e:  # noqa: BLE001 - reported per item
                            res.errors[sample] = f"{type(e).__name__}: {e}"
                            if not state.will_retry(e):
                                logger.warning("item %d sample %d failed: %s", index, sample, e)
                                break
                            if unsettled is None and episode is not None and episode.session_id:
                                unsettled = episode
                            state.failed(e)
                            step = min(tries - 1, 10)
                            delay = min(backoff * 2**step, max_backoff) * (0.5 + random.random())
                            hint = _retry_after_of(e)
                            if hint is not None:
                                delay = max(delay, min(hint, max_backoff * 6))
                            await asyncio.sleep(delay)
                if bar is not None:
                    bar.update(1)

            try:
                await asyncio.gather(
                    *(one(i, s) for i in range(len(items)) for s in range(group_size))
                )
            finally:
                if bar is not None:
                    bar.close()
        return results

    async def _episode(
        self,
        http: httpx.AsyncClient,
        agent_fn: AgentFn,
        item: Any,
        group_id: str,
        state: _Attempts,
        episode: _Episode,
    ) -> None:
        session = AgentSession(
            self.service_url,
            self.api_key,
            group_id=group_id,
            http_client=http,
            timeout=self.timeout,
            set_env=False,  # concurrent sessions: the header hook names each one
        )
        async with session:
            episode.session_id = session.session_id
            state.got_session()
            try:
                reward = await agent_fn(item)
            except BaseException as e:
                # Tell the service whether this group member will come back.
                session.retry_on_failure = isinstance(e, Exception) and state.will_retry(e)
                raise
            episode.reward = None if reward is None else float(reward)
            if reward is not None and session.finalized is None:
                await session.finalize(float(reward))
            if session.finalized is not None and session.finalized.get("status") == "failed":
                raise AgentServiceError(
                    422, f"session failed: {session.finalized.get('reason', 'unknown')}"
                )

    async def _stored(self, http: httpx.AsyncClient, session_id: str | None) -> bool:
        """Whether the service stored the trajectory of ``session_id`` (its state is ``done``).

        A session still finalizing is asked again after a backoff (a retryable 503); one still
        open, whose attempt failed on this side, is finalized as failed (its group keeps waiting
        for the retry) so it does not hold a slot until it idles out."""
        if session_id is None:
            return False
        headers = {"Authorization": f"Bearer {self.api_key}", SESSION_HEADER: session_id}
        resp = await http.get(f"{self.service_url}/rl/v1/sessions/{session_id}", headers=headers)
        if resp.status_code == 404:
            return False  # unknown here (e.g. the service's store was replaced): run it again
        data = check_response(resp)
        state = data.get("state")
        if state == "finalizing":
            raise AgentServiceError(503, f"session {session_id} is still being finalized", 1.0)
        if state == "open":
            resp = await http.post(
                f"{self.service_url}/rl/v1/finalize", json={"status": "failed"}, headers=headers
            )
            if resp.status_code >= 400 and resp.status_code not in (409, 410):
                check_response(resp)  # raises: asked again after a backoff
        return state == "done"

    def run_sync(
        self, agent_fn: AgentFn, dataset: Iterable[Any], **kwargs: Any
    ) -> list[AgentResult]:
        """``run`` for scripts without an event loop."""
        return asyncio.run(self.run(agent_fn, dataset, **kwargs))


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional on the client side
        return None
    return tqdm(total=total, desc="agent sessions", unit="session")
