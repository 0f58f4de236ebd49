"""``RolloutExecutor``: runs episodes with bounded concurrency and bounded staleness.

Two ways to use it:

* ``await executor.rollout_batch(items, trainer_version=v)`` — run these items now (each item is
  one group of ``n_samples`` episodes when the workflow is grouped) and return the
  :class:`~areal_env.api.source.RolloutBatch`. This is the synchronous mode used with
  ``rollout.max_head_offpolicyness = 0``.
* ``executor.submit(item)`` / ``executor.feed(iterable)`` + ``await executor.next_batch(
  trainer_version=v)`` — background prefetch: rollouts of the next batches start while the
  trainer trains, as far as the staleness bound allows.

Staleness bound (k = ``rollout.max_head_offpolicyness``, B = ``rollout.batch_size``): a group
starts only when the engine's weights are at most k versions behind the trainer version, and
(in prefetch mode) only while ``accepted + running`` groups stay below
``(version - version_at_start + k + 1) * B``. So every consumed group was started on weights at
most k versions older than the trainer that consumes it.

Concurrency: ``rollout.max_concurrent_rollouts`` counts episodes (agent runs); a group of n
occupies n of them (at least one group always runs).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from areal_env.api.config import RolloutConfig
from areal_env.api.engine import InferenceEngine
from areal_env.api.episode import Episode
from areal_env.api.source import RolloutBatch
from areal_env.api.workflow import RolloutWorkflow
from areal_env.http.client import default_ssl_context
from areal_env.workflow.batch import rollout_stats
from areal_env.workflow.grouped import run_member

logger = logging.getLogger(__name__)

_NOTHING = object()


@dataclass
class GroupResult:
    """One item's outcome: the episodes it ran (its group: the accepted ones)."""

    item: Any
    episodes: list[Episode] = field(default_factory=list)
    start_version: int | None = None
    trainer_version: int = 0
    wall_time: float = 0.0

    @property
    def accepted(self) -> list[Episode]:
        return [e for e in self.episodes if e.accepted and e.rows]


class StalenessDeadlock(RuntimeError):
    """next_batch cannot make progress: the staleness bound is full and the version did not move."""


class RolloutExecutor:
    """Runs a RolloutWorkflow over dataset items and assembles training batches."""

    def __init__(
        self,
        engine: InferenceEngine | None,
        workflow: RolloutWorkflow,
        rollout: RolloutConfig,
        *,
        proxy_base_url: str | None = None,
        admin_key: str | None = None,
        show_progress: bool = True,
    ) -> None:
        self.engine = engine
        self.workflow = workflow
        self.rollout = rollout
        self.proxy_base_url = proxy_base_url.rstrip("/") if proxy_base_url else None
        self.admin_key = admin_key
        self.show_progress = show_progress
        self.group_size = int(workflow.n_samples)
        self.sessions_per_group = int(workflow.sessions_per_episode)
        self.uses_proxy = bool(self.proxy_base_url and self.admin_key and self.sessions_per_group)
        self.max_running_groups = max(1, rollout.max_concurrent_rollouts // max(1, self.group_size))
        self._version = self._engine_version() or 0
        self.last_batch: RolloutBatch | None = None
        """The batch handed out last."""
        # prefetch state
        self._pending: collections.deque[Any] = collections.deque()
        self._feed: Iterator[Any] | None = None
        self._ready: collections.deque[GroupResult] = collections.deque()
        self._rejected: list[GroupResult] = []
        self._running = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._accepted_total = 0
        self._skipped_steps = 0
        self._v0: int | None = None
        self._wake: asyncio.Event | None = None
        self._progress: asyncio.Event | None = None
        self._dispatcher: asyncio.Task[None] | None = None
        self._grant_client: Any = None
        self.peak_running_groups = 0

    # -- versions ----------------------------------------------------------------------------

    def set_version(self, version: int) -> None:
        """The trainer's version (number of policy updates); wakes the prefetcher."""
        self._version = int(version)
        if self._wake is not None:
            self._wake.set()

    def get_version(self) -> int:
        return self._version

    def skip_step(self) -> None:
        """The trainer consumed a batch without updating (every advantage was 0): the version
        stays, but the step is over, so one more batch may start. Without this, skipped
        updates filled the staleness bound and ``next_batch`` raised ``StalenessDeadlock``
        once ``max_head_offpolicyness + 1`` of them had happened. Groups started now run on
        the same weights as before, so none is staler for it."""
        self._skipped_steps += 1
        if self._wake is not None:
            self._wake.set()

    def _engine_version(self) -> int | None:
        if self.engine is None:
            return None
        try:
            return int(self.engine.get_version())
        except Exception:
            return None

    def _weights_fresh(self, trainer_version: int) -> bool:
        v = self._engine_version()
        return v is None or v >= trainer_version - self.rollout.max_head_offpolicyness

    async def _wait_fresh_weights(self, trainer_version: int) -> None:
        deadline = time.monotonic() + self.rollout.episode_timeout
        while not self._weights_fresh(trainer_version):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"engine weights (version {self._engine_version()}) stayed more than "
                    f"{self.rollout.max_head_offpolicyness} versions behind trainer version "
                    f"{trainer_version}"
                )
            await asyncio.sleep(0.02)

    # -- one group -----------------------------------------------------------------------------

    async def _grant(self) -> None:
        if not self.uses_proxy or self.proxy_base_url is None or self.admin_key is None:
            return
        from areal_env.proxy.client import grant_capacity

        if self._grant_client is None or self._grant_client.is_closed:
            import httpx

            self._grant_client = httpx.AsyncClient(timeout=60.0, verify=default_ssl_context())
        try:
            await grant_capacity(
                self.proxy_base_url,
                self.admin_key,
                self.sessions_per_group,
                http_client=self._grant_client,
            )
        except Exception as e:  # sessions will be refused (429) and rejected; keep training
            logger.warning("grant_capacity(%d) failed: %s", self.sessions_per_group, e)

    async def _run_group(self, item: Any, trainer_version: int) -> GroupResult:
        t0 = time.monotonic()
        start_version = self._engine_version()
        episodes = await run_member(self.workflow, self.engine, item, None)
        for e in episodes:
            if e.start_version is None:
                e.start_version = start_version
        return GroupResult(item, episodes, start_version, trainer_version, time.monotonic() - t0)

    def _progress_bar(self, total: int, desc: str) -> Any:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, unit="ep", leave=False, disable=not self.show_progress)

    # -- synchronous mode ------------------------------------------------------------------------

    async def rollout_batch(
        self, items: list[dict[str, Any]], *, trainer_version: int
    ) -> RolloutBatch:
        """Run every item once (bounded concurrency) and return their episodes."""
        if self._dispatcher is not None:
            raise RuntimeError("rollout_batch cannot be mixed with submit/next_batch prefetching")
        self.set_version(trainer_version)
        t0 = time.monotonic()
        sem = asyncio.Semaphore(self.max_running_groups)
        running = 0
        bar = self._progress_bar(len(items) * self.group_size, f"rollout v{trainer_version}")
        accepted = rejected = 0

        async def one(item: Any) -> GroupResult:
            nonlocal running, accepted, rejected
            async with sem:
                await self._wait_fresh_weights(trainer_version)
                await self._grant()
                running += 1
                self.peak_running_groups = max(self.peak_running_groups, running)
                try:
                    g = await self._run_group(item, trainer_version)
                finally:
                    running -= 1
            n_ok = sum(e.accepted for e in g.episodes)
            accepted += n_ok
            rejected += len(g.episodes) - n_ok
            bar.update(len(g.episodes))
            bar.set_postfix(accepted=accepted, rejected=rejected, refresh=False)
            return g

        try:
            results = await asyncio.gather(*(one(it) for it in items))
        finally:
            bar.close()
        return self._assemble(list(results), trainer_version, time.monotonic() - t0)

    # -- prefetch mode -------------------------------------------------------------------------

    def submit(self, item: Any) -> None:
        """Queue one item; it starts in the background as soon as the bounds allow."""
        self._pending.append(item)
        self._ensure_dispatcher()

    def feed(self, items: Iterable[Any]) -> None:
        """Draw items lazily from ``items`` whenever a new group may start (after ``submit``-ed ones)."""
        self._feed = iter(items)
        self._ensure_dispatcher()

    def _ensure_dispatcher(self) -> None:
        if self._dispatcher is None or self._dispatcher.done():
            if self._v0 is None:
                self._v0 = self._version
            self._wake = asyncio.Event()
            self._progress = asyncio.Event()
            self._dispatcher = asyncio.get_running_loop().create_task(self._dispatch())
        assert self._wake is not None
        self._wake.set()

    def capacity(self) -> int:
        """Groups that may still start under the staleness bound (prefetch mode)."""
        v0 = self._v0 if self._v0 is not None else self._version
        steps = self._version - v0 + self._skipped_steps
        limit = (steps + self.rollout.max_head_offpolicyness + 1) * self.rollout.batch_size
        return limit - self._accepted_total - self._running

    def _can_start(self) -> bool:
        return (
            self._running < self.max_running_groups
            and self.capacity() > 0
            and self._weights_fresh(self._version)
        )

    def _next_item(self) -> Any:
        if self._pending:
            return self._pending.popleft()
        if self._feed is not None:
            try:
                return next(self._feed)
            except StopIteration:
                self._feed = None
        return _NOTHING

    def _has_input(self) -> bool:
        return bool(self._pending) or self._feed is not None

    async def _dispatch(self) -> None:
        assert self._wake is not None
        while True:
            self._wake.clear()
            while self._has_input() and self._can_start():
                item = self._next_item()
                if item is _NOTHING:
                    assert self._progress is not None
                    self._progress.set()  # the input ran out: next_batch may be waiting for it
                    break
                self._running += 1
                self.peak_running_groups = max(self.peak_running_groups, self._running)
                await self._grant()
                task = asyncio.get_running_loop().create_task(
                    self._prefetch_one(item, self._version)
                )
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            lagging = self._has_input() and not self._weights_fresh(self._version)
            if lagging:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 0.02)
            else:
                await self._wake.wait()

    async def _prefetch_one(self, item: Any, trainer_version: int) -> None:
        try:
            g = await self._run_group(item, trainer_version)
        except asyncio.CancelledError:
            self._running -= 1
            raise
        except Exception as e:  # run_member never raises; this is a bug guard
            logger.exception("rollout group failed: %s", e)
            g = GroupResult(item, [], None, trainer_version)
        self._running -= 1
        if g.accepted:
            self._accepted_total += 1
            self._ready.append(g)
        else:
            self._rejected.append(g)
        assert self._wake is not None and self._progress is not None
        self._progress.set()
        self._wake.set()

    async def next_batch(
        self, *, trainer_version: int | None = None, batch_size: int | None = None
    ) -> RolloutBatch:
        """Wait for ``batch_size`` accepted groups (fewer when the input runs out) and return them."""
        if trainer_version is not None:
            self.set_version(trainer_version)
        self._ensure_dispatcher()
        assert self._progress is not None
        bs = batch_size or self.rollout.batch_size
        t0 = time.monotonic()
        bar = self._progress_bar(bs * self.group_size, f"rollout v{self._version}")
        shown = 0
        try:
            while len(self._ready) < bs:
                if not self._has_input() and self._running == 0:
                    break
                if self._running == 0 and self.capacity() <= 0:
                    raise StalenessDeadlock(
                        f"no rollout may start: {self._accepted_total} groups accepted since "
                        f"version {self._v0} fill the staleness bound at version {self._version}; "
                        "call set_version() (or skip_step() when the update was skipped) after "
                        "each training step"
                    )
                self._progress.clear()
                await self._progress.wait()
                n = min(len(self._ready), bs)
                if n > shown:
                    bar.update((n - shown) * self.group_size)
                    shown = n
        finally:
            bar.close()
        taken = [self._ready.popleft() for _ in range(min(bs, len(self._ready)))]
        rejected, self._rejected = self._rejected, []
        return self._assemble(taken + rejected, self._version, time.monotonic() - t0)

    # -- assembling ----------------------------------------------------------------------------

    def _assemble(
        self, groups: list[GroupResult], trainer_version: int, wall_time: float
    ) -> RolloutBatch:
        accepted = [g.accepted for g in groups if g.accepted]
        rejected = [e for g in groups for e in g.episodes if not (e.accepted and e.rows)]
        stats = rollout_stats(
            accepted,
            rejected,
            trainer_version=trainer_version,
            wall_time=wall_time,
            rejected_groups=sum(1 for g in groups if not g.accepted),
        )
        self.last_batch = RolloutBatch(accepted, rejected, stats, trainer_version)
        return self.last_batch

    async def aclose(self) -> None:
        """Cancel background work and close the workflow's resources."""
        tasks = list(self._tasks)
        if self._dispatcher is not None:
            tasks.append(self._dispatcher)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        self._dispatcher = None
        if self._grant_client is not None:
            client, self._grant_client = self._grant_client, None
            with contextlib.suppress(Exception):
                await client.aclose()
        await self.workflow.aclose()
