"""``AgentRunner``: run an async agent over a dataset through the training service.

Retries are sized to outlast a service restart (``retry.RetryBudget``, one per sample):
connection failures and 410/502/503/504 answers (410: a session the service lost, e.g. in a
restart; 503: the service is stopping) are retried in a fresh session of the same GRPO group
with exponential backoff (honouring ``Retry-After``) while the sample has spent less than
``retry_for`` seconds without a session; "busy" answers (429: a quota, or the trainer has enough
rollouts in flight) for up to ``patience`` seconds of waiting. Only the time a sample spends
failing counts: neither its wait for a concurrency slot nor the episodes it ran, so an episode
cut by a restart late in a long run is retried as readily as an early one.

Exactly once: before a retry, the runner asks the service what became of the failed attempt's
session. One that is ``done`` was stored (e.g. the finalize reached the service but its answer
was lost in a restart): it is counted, not run again, so its group gets no extra member. An
attempt that will not be retried tells the service so, and its group stops waiting for it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from areal_env_client.hooks import SESSION_HEADER
from areal_env_client.retry import RetryBudget
from areal_env_client.session import (
    AgentServiceError,
    AgentSession,
    check_response,
    default_service_url,
)

logger = logging.getLogger(__name__)


@dataclass
class AgentResult:
    """What ``AgentRunner.run`` got for one dataset item (``group_size`` samples)."""

    index: int
    item: Any
    rewards: list[float | None] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)
    session_ids: list[str | None] = field(default_factory=list)
    attempts: list[int] = field(default_factory=list)
    """Per sample: episodes run (sessions the service opened), the successful one included."""
    waits: list[int] = field(default_factory=list)
    """Per sample: times the service said "not now" (busy 429, stopping 503, unreachable)
    before it opened a session; not attempts."""

    @property
    def ok(self) -> bool:
        return all(e is None for e in self.errors)

    @property
    def mean_reward(self) -> float | None:
        vals = [r for r in self.rewards if r is not None]
        return sum(vals) / len(vals) if vals else None


AgentFn = Callable[[Any], Awaitable[float | None]]


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
        has spent ``retry_for`` seconds without a session since its first failure (and, when
        given, at most ``max_retries`` times after an episode failed), 429 answers until it has
        waited ``patience`` seconds on them; time queued for a concurrency slot or running
        episodes does not count (a ``RetryBudget`` per sample). Delays grow from ``backoff`` to
        ``max_backoff`` seconds, or follow the service's Retry-After. ``attempts`` counts the
        episodes run, ``waits`` the service's "not now" answers before a session opened. An
        attempt whose session the service reports ``done`` (stored, though its answer was lost)
        is counted, not run again.
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
                waits=[0] * group_size,
            )
            for i, item in enumerate(items)
        ]
        semaphore = asyncio.Semaphore(concurrency)
        bar = _progress(len(items) * group_size, progress)
        async with httpx.AsyncClient(timeout=self.timeout, verify=self.verify) as http:

            async def one(index: int, sample: int) -> None:
                res = results[index]
                budget = RetryBudget(
                    retry_for=retry_for,
                    patience=patience,
                    max_retries=max_retries,
                    backoff=backoff,
                    max_backoff=max_backoff,
                )
                async with semaphore:
                    await self._sample(http, agent_fn, res, sample, f"{prefix}-{index}", budget)
                res.waits[sample] = budget.waits
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

    async def _sample(
        self,
        http: httpx.AsyncClient,
        agent_fn: AgentFn,
        res: AgentResult,
        sample: int,
        group_id: str,
        budget: RetryBudget,
    ) -> None:
        """One sample of ``res.item``: episodes until one is stored or the budget gives up."""
        unsettled: _Episode | None = None
        while True:
            episode: _Episode | None = None
            try:
                if unsettled is not None:
                    # The last attempt failed after its session opened: was it stored anyway
                    # (e.g. its finalize's answer was lost)?
                    if await self._stored(http, unsettled.session_id):
                        episode = unsettled
                    else:
                        unsettled = None
                if episode is None:
                    episode = _Episode()
                    try:
                        await self._episode(http, agent_fn, res.item, group_id, budget, episode)
                    finally:
                        if episode.session_id is not None:
                            res.attempts[sample] += 1
                res.rewards[sample] = episode.reward
                res.session_ids[sample] = episode.session_id
                res.errors[sample] = None
                return
            except Exception as e:  # noqa: BLE001 - reported per item
                res.errors[sample] = f"{type(e).__name__}: {e}"
                # A start that failed has already waited within the budget (AgentSession).
                at_start = episode is not None and episode.session_id is None
                if not budget.will_retry(e, before_session=at_start):
                    logger.warning("item %d sample %d failed: %s", res.index, sample, e)
                    return
                if unsettled is None and episode is not None and episode.session_id:
                    unsettled = episode
                await asyncio.sleep(budget.failed(e))

    async def _episode(
        self,
        http: httpx.AsyncClient,
        agent_fn: AgentFn,
        item: Any,
        group_id: str,
        budget: RetryBudget,
        episode: _Episode,
    ) -> None:
        session = AgentSession(
            self.service_url,
            self.api_key,
            group_id=group_id,
            http_client=http,
            timeout=self.timeout,
            set_env=False,  # concurrent sessions: the header hook names each one
            retry=budget,  # the start waits out a busy or restarting service on this budget
        )
        async with session:
            episode.session_id = session.session_id
            try:
                reward = await agent_fn(item)
            except BaseException as e:
                # Tell the service whether this group member will come back.
                session.retry_on_failure = isinstance(e, Exception) and budget.will_retry(e)
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
