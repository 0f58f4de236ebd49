"""``ExternalTrajectorySource``: training batches filled by trajectories that external agents finish.

The gateway ``put``s each finalized session's exported trajectory here (from its own thread and
event loop), where it becomes an :class:`~areal_env.api.episode.Episode`; the trainer awaits
``next_batch`` (from another loop) and gets a :class:`~areal_env.api.source.RolloutBatch`, as
from the ``RolloutExecutor``, so it takes either as its batch source.

Grouping: sessions carrying the same ``group_id`` form one GRPO group (across clients); a group
is complete once ``n_samples`` successful trajectories arrived (failed sessions do not count, so a
client may retry them). Sessions without a group id are grouped in arrival order. A group that
waits longer than ``group_timeout`` for members is used as it is. Waiting never polls: waiters
sleep on an ``asyncio.Event`` that ``put`` sets thread-safely.

Durability (with a ``store``): ``aput`` writes the trajectory to the store before the gateway
acknowledges it; ``rollout_batch`` marks what it hands out as consumed at that step; ``commit``
(a checkpoint was saved) makes that final; ``load`` (on start) rebuilds the groups from what is
not consumed yet, after handing back what was consumed after the restored checkpoint. So each
acknowledged trajectory is trained exactly once across restarts, SIGKILL included.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import threading
import time
from collections import deque
from typing import Any

from areal_env.api.episode import Episode
from areal_env.api.source import RolloutBatch, SourceClosedError
from areal_env.service.trajectories import (
    TrajectoryGroup,
    external_episode,
    service_stats,
    store_row,
)

logger = logging.getLogger(__name__)


class ExternalTrajectorySource:
    """A thread- and loop-safe queue of finished external trajectories, batched in GRPO groups."""

    def __init__(
        self,
        rollout: Any | None = None,
        *,
        n_samples: int | None = None,
        batch_size: int | None = None,
        max_head_offpolicyness: int | None = None,
        group_timeout: float = 1800.0,
        admission_control: bool = False,
        store: Any | None = None,
        stale_trajectories: str = "train",
    ) -> None:
        if stale_trajectories not in ("train", "drop"):
            raise ValueError(f"stale_trajectories={stale_trajectories!r}: use 'train' or 'drop'")
        self.train_stale = stale_trajectories == "train"
        """Train trajectories past the staleness bound (counted) instead of dropping them."""
        self.n_samples = int(n_samples or getattr(rollout, "n_samples", 1) or 1)
        self.batch_size = int(batch_size or getattr(rollout, "batch_size", 1) or 1)
        if max_head_offpolicyness is None:
            max_head_offpolicyness = getattr(rollout, "max_head_offpolicyness", 0)
        self.max_head_offpolicyness = int(max_head_offpolicyness)
        self.group_timeout = float(group_timeout)
        self._lock = threading.Lock()
        self._open: dict[str, TrajectoryGroup] = {}
        self._auto: TrajectoryGroup | None = None
        self._auto_ids = itertools.count()
        self._auto_tag = secrets.token_hex(3)  # auto-group keys stay unique across restarts
        self.store = store
        self._step = 0
        """The trainer step the next batch is for (``load`` sets where training resumes)."""
        self._stale_on_load = 0
        self.total_reloaded = 0
        self._ready: deque[TrajectoryGroup] = deque()
        self._traj_ids = itertools.count()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._closed = False
        self._version = 0
        self.admission_control = admission_control
        self._admitted = 0
        """Sessions admitted since this source started (reloaded trajectories included)."""
        self._batches_taken = 0
        """Batches handed to the trainer since this source started."""
        self._steps_done = 0
        """Of those, the ones whose training step has finished: the trainer moved the version
        on, or came back for the next batch (its update was skipped). The admission limit
        grows with them, not with versions: see ``_admission_limit``."""
        self._failed_since_batch = 0
        self._invalid_since_batch = 0
        self.total_received = 0
        self.total_failed = 0
        self.last_batch: RolloutBatch | None = None
        """The batch handed out last (what the trainer trained on)."""

    # -- producer side (any thread) --------------------------------------------------------

    def put(self, trajectory: dict[str, Any], group_id: str | None = None) -> None:
        """Add one finished session's export (``{"trajectories": {row_id: row}, ...}``) to
        memory only (``aput`` also makes it durable)."""
        with self._lock:
            if self._closed:
                raise SourceClosedError("the trajectory source is closed")
            self._add(trajectory, group_id, None)
        self._wake()

    async def aput(self, trajectory: dict[str, Any], group_id: str | None = None) -> None:
        """``put``, after writing the trajectory to the store (in a worker thread): once this
        returns, no restart loses it. After ``close`` a trajectory is still stored (it is
        trained after the next start); without a store it is refused (``SourceClosedError``)."""
        if self.store is None:
            self.put(trajectory, group_id)
            return
        session_id = str(trajectory.get("session_id") or f"anon-{secrets.token_hex(8)}")
        # Stored under its group id ("" = grouped in arrival order, also after a restart).
        row_id = await asyncio.to_thread(
            self.store.add_trajectory, session_id, group_id or "", trajectory
        )
        with self._lock:
            if self._closed:
                logger.info("trajectory of session %s kept for the next start", session_id)
                return
            self._add(trajectory, group_id, row_id)
        self._wake()

    def _add(self, trajectory: dict[str, Any], group_id: str | None, row_id: int | None) -> None:
        """Add to its group (lock held)."""
        group = self._group_for(group_id)
        try:
            episode = external_episode(
                trajectory, group_key=group.key, uid=next(self._traj_ids), store_row=row_id
            )
        except (KeyError, TypeError, ValueError) as e:
            logger.warning("dropping an unusable trajectory of group %s: %s", group.key, e)
            self._invalid_since_batch += 1
            if row_id is not None and self.store is not None:
                self.store.drop_trajectories([row_id], self._step, "invalid")
            return
        group.members.append(episode)
        self.total_received += 1
        self._maybe_complete(group)

    def _maybe_complete(self, group: TrajectoryGroup) -> None:
        if len(group.members) + group.abandoned >= self.n_samples:
            if group.members:
                self._complete(group)
            else:  # every member gave up: nothing to train on
                self._drop_group(group)

    def _drop_group(self, group: TrajectoryGroup) -> None:
        if self._auto is group:
            self._auto = None
        else:
            self._open.pop(group.key, None)

    def put_failed(
        self, group_id: str | None = None, reason: str = "", *, retry: bool = True
    ) -> None:
        """Record a failed session (excluded from training; its admission slot is given back).
        Its group keeps waiting for a retry, unless ``retry`` is False (the client gave up)."""
        with self._lock:
            self.total_failed += 1
            self._failed_since_batch += 1
            self._admitted = max(0, self._admitted - 1)
            if group_id is not None and group_id in self._open:
                self._open[group_id].failed += 1
        logger.info("external session of group %s failed: %s", group_id, reason or "no reason")
        if not retry:
            self.abandon(group_id)
        self._wake()

    def abandon(self, group_id: str | None) -> None:
        """One member of ``group_id`` will never come: the group completes without it."""
        if group_id is None:
            return
        with self._lock:
            if self._closed:
                return
            group = self._open.get(group_id)
            if group is None:
                group = self._open[group_id] = TrajectoryGroup(key=group_id)
            group.abandoned += 1
            self._maybe_complete(group)
        self._wake()

    # -- durability ------------------------------------------------------------------------

    def load(self, restored_step: int, trainer_version: int | None = None) -> int:
        """On start (before agents connect): hand back what was consumed after the checkpoint
        at ``restored_step`` and rebuild the groups from every stored, unconsumed trajectory.
        Returns how many were reloaded. Blocks (call it from a thread)."""
        if self.store is None:
            self._step = restored_step
            return 0
        committed, returned = self.store.restore_to(restored_step)
        stored = self.store.pending_trajectories()
        now_wall, now_mono = time.time(), time.monotonic()
        with self._lock:
            self._step = restored_step
            if trainer_version is not None:
                self._version = int(trainer_version)
            for st in stored:
                group = self._group_for(st.group_key or None)
                if not group.members:  # its wait counts from its first member's arrival
                    group.created = now_mono - max(0.0, now_wall - st.created)
                try:
                    episode = external_episode(
                        st.record,
                        group_key=group.key,
                        uid=next(self._traj_ids),
                        store_row=st.row_id,
                    )
                except (KeyError, TypeError, ValueError) as e:
                    logger.warning("stored trajectory %s is unusable: %s", st.session_id, e)
                    self.store.drop_trajectories([st.row_id], restored_step, "invalid")
                    continue
                if trainer_version is not None and self._is_stale(episode, trainer_version):
                    self._stale_on_load += 1
                group.members.append(episode)
                self.total_reloaded += 1
                self._maybe_complete(group)
            self._admitted = self.total_reloaded
        if stored or committed or returned:
            logger.warning(
                "service store: %d acknowledged trajectories reloaded (%d consumed after the "
                "step-%d checkpoint handed back, %d already trained committed)%s",
                len(stored),
                returned,
                restored_step,
                committed,
                f"; {self._stale_on_load} are past the staleness bound and will be "
                + ("trained all the same" if self.train_stale else "dropped")
                if self._stale_on_load
                else "",
            )
        self._wake()
        return len(stored)

    def commit(self, step: int) -> None:
        """A checkpoint at ``step`` is saved: what was consumed up to it is trained for good.
        Blocks (call it from a thread)."""
        if self.store is not None:
            n = self.store.commit_through(step)
            logger.info("step %d checkpoint: %d trajectories committed as trained", step, n)

    def describe(self) -> dict[str, Any]:
        """Counters for ``/admin/status``."""
        with self._lock:
            return {
                "pending": sum(len(g.members) for g in self._open.values())
                + (len(self._auto.members) if self._auto else 0),
                "ready_groups": len(self._ready),
                "received": self.total_received,
                "reloaded": self.total_reloaded,
                "failed": self.total_failed,
                "next_step": self._step + 1,
                "store": self.store.url if self.store is not None else None,
            }

    # -- admission (staleness control at session start) -----------------------------------

    def _admission_limit(self) -> int:
        """Sessions that may have started by now: ``(steps finished + offpolicyness + 1)``
        batches' worth, so a session is consumed at most ``max_head_offpolicyness`` steps (so
        versions) after its weights (AReaL's rule). Steps, not versions: a skipped update
        (all-equal rewards) leaves the version, and every new session (a restart-failed
        member's retry included) then waited for a version that never came."""
        per_batch = self.batch_size * self.n_samples
        return (self._steps_done + self.max_head_offpolicyness + 1) * per_batch

    def try_admit(self) -> bool:
        """Take an admission slot if one is free (always True without admission control)."""
        if not self.admission_control:
            return True
        with self._lock:
            if self._admitted < self._admission_limit():
                self._admitted += 1
                return True
        return False

    def release_admission(self) -> None:
        """Give back a slot of a session that never started."""
        with self._lock:
            self._admitted = max(0, self._admitted - 1)
        self._wake()

    async def admit(self, timeout: float | None = None) -> bool:
        """Wait (no polling: woken when a training step ends or a session fails) for a slot."""
        if self.try_admit():
            return True
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        waiter = (loop, event)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._waiters.add(waiter)
        try:
            while True:
                event.clear()
                if self.try_admit():
                    return True
                with self._lock:
                    if self._closed:
                        raise SourceClosedError("the trajectory source is closed")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                try:
                    await asyncio.wait_for(event.wait(), timeout=left)
                except TimeoutError:
                    pass
        finally:
            with self._lock:
                self._waiters.discard(waiter)

    def _group_for(self, group_id: str | None) -> TrajectoryGroup:
        if group_id is None:
            if self._auto is None:
                self._auto = TrajectoryGroup(key=f"auto-{self._auto_tag}-{next(self._auto_ids)}")
            return self._auto
        group = self._open.get(group_id)
        if group is None:
            group = self._open[group_id] = TrajectoryGroup(key=group_id)
        return group

    def _complete(self, group: TrajectoryGroup) -> None:
        if self._auto is group:
            self._auto = None
        else:
            self._open.pop(group.key, None)
        self._ready.append(group)

    def _flush_expired(self, now: float) -> float | None:
        """Move groups that waited too long to ready; return seconds until the next expiry."""
        next_in: float | None = None
        candidates = list(self._open.values()) + ([self._auto] if self._auto else [])
        for group in candidates:
            if not group.members:
                continue
            left = group.created + self.group_timeout - now
            if left <= 0:
                logger.info(
                    "group %s used incomplete (%d/%d) after %.0f s",
                    group.key,
                    len(group.members),
                    self.n_samples,
                    self.group_timeout,
                )
                self._complete(group)
            else:
                next_in = left if next_in is None else min(next_in, left)
        return next_in

    def _wake(self) -> None:
        with self._lock:
            waiters = list(self._waiters)
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that loop is closed
                pass

    def close(self) -> None:
        """Refuse further trajectories and wake every waiter with ``SourceClosedError``."""
        with self._lock:
            self._closed = True
        self._wake()

    # -- consumer side (the trainer) -------------------------------------------------------

    def set_version(self, version: int) -> None:
        with self._lock:
            self._version = int(version)
        self._step_finished()

    def get_version(self) -> int:
        return self._version

    def _step_finished(self) -> None:
        """The trainer is done with every batch it took (it moved the version on, or asks for
        the next batch): admission may grow (``_admission_limit``)."""
        with self._lock:
            self._steps_done = self._batches_taken
        self._wake()

    @property
    def num_ready_groups(self) -> int:
        with self._lock:
            return len(self._ready)

    @property
    def num_pending_trajectories(self) -> int:
        with self._lock:
            pending = sum(len(g.members) for g in self._open.values())
            return pending + (len(self._auto.members) if self._auto else 0)

    def _is_stale(self, episode: Episode, trainer_version: int) -> bool:
        oldest = episode.min_version
        return oldest is not None and trainer_version - oldest > self.max_head_offpolicyness

    def _split_stale(
        self, group: TrajectoryGroup, trainer_version: int
    ) -> tuple[list[Episode], list[Episode], int]:
        """``(to train, to drop, trained past the bound)`` of a group's members."""
        if self.train_stale:
            over = sum(self._is_stale(t, trainer_version) for t in group.members)
            return list(group.members), [], over
        fresh = [t for t in group.members if not self._is_stale(t, trainer_version)]
        old = [t for t in group.members if self._is_stale(t, trainer_version)]
        return fresh, old, 0

    uses_proxy = False
    """The trainer grants no proxy capacity for this source (the gateway admits sessions)."""
    # The BatchSource protocol (areal_env.api.source): next_batch, set_version, aclose. The
    # data lives with the external agents: nothing is submitted.

    async def next_batch(
        self,
        *,
        trainer_version: int,
        batch_size: int | None = None,
        timeout: float | None = None,
        step: int | None = None,
    ) -> RolloutBatch:
        """``rollout_batch`` with an explicit number of groups."""
        return await self.rollout_batch(
            trainer_version=trainer_version, timeout=timeout, batch_size=batch_size, step=step
        )

    async def aclose(self) -> None:
        """Nothing to cancel: the gateway owns the sessions (``close()`` ends the source)."""

    async def rollout_batch(
        self,
        *,
        trainer_version: int,
        timeout: float | None = None,
        batch_size: int | None = None,
        step: int | None = None,
    ) -> RolloutBatch:
        """Wait for ``batch_size`` complete groups and return them.

        ``step`` is the trainer step the batch is for (default: one past the last batch); with a
        store the trajectories are marked consumed at it before they are returned.

        The data lives with the external agents. Trajectories generated on weights more than
        ``max_head_offpolicyness`` versions behind ``trainer_version`` are dropped (counted).
        ``timeout`` (seconds) returns what arrived by then (possibly an empty batch).
        """
        want = int(batch_size or self.batch_size)
        self._step_finished()  # the previous step is over, whether it updated or not
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        waiter = (loop, event)
        selected: list[list[Episode]] = []
        stale_trajs: list[Episode] = []
        over_bound = 0
        with self._lock:
            self._waiters.add(waiter)
        try:
            while True:
                event.clear()
                with self._lock:
                    if self._closed:
                        raise SourceClosedError("the trajectory source was closed")
                    next_expiry = self._flush_expired(time.monotonic())
                    while self._ready and len(selected) < want:
                        group = self._ready.popleft()
                        fresh, old, over = self._split_stale(group, trainer_version)
                        stale_trajs += old
                        over_bound += over
                        if fresh:
                            selected.append(fresh)
                if len(selected) >= want:
                    break
                wait_for = next_expiry
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    wait_for = left if wait_for is None else min(wait_for, left)
                try:
                    await asyncio.wait_for(event.wait(), timeout=wait_for)
                except TimeoutError:
                    pass
        except BaseException:
            with self._lock:  # cancelled or closed: give the groups back, oldest first
                for members in reversed(selected):
                    self._ready.appendleft(
                        TrajectoryGroup(key=str(members[0].group_id), members=members)
                    )
            raise
        finally:
            with self._lock:
                self._waiters.discard(waiter)
        step = self._step + 1 if step is None else int(step)
        self._step = step
        if selected or stale_trajs:
            with self._lock:
                self._batches_taken += 1
        if self.store is not None:
            consumed = [r for g in selected for e in g if (r := store_row(e)) is not None]
            dropped = [r for e in stale_trajs if (r := store_row(e)) is not None]
            await asyncio.to_thread(self.store.mark_consumed, consumed, step)
            await asyncio.to_thread(self.store.drop_trajectories, dropped, step, "stale")
        if stale_trajs:
            logger.warning(
                "step %d: %d trajectories dropped: generated more than %d versions before "
                "version %d (rollout.max_head_offpolicyness)",
                step,
                len(stale_trajs),
                self.max_head_offpolicyness,
                trainer_version,
            )
        if over_bound:
            logger.info(
                "step %d: %d trajectories trained although generated more than %d versions "
                "before version %d (their group waited for a retried member)",
                step,
                over_bound,
                self.max_head_offpolicyness,
                trainer_version,
            )
        waited = time.monotonic() - start
        for e in stale_trajs:
            e.accepted, e.reason = False, "stale"
        return self._finish(selected, stale_trajs, over_bound, trainer_version, waited)

    def _finish(
        self,
        groups: list[list[Episode]],
        stale: list[Episode],
        over_bound: int,
        trainer_version: int,
        waited: float,
    ) -> RolloutBatch:
        with self._lock:
            failed, self._failed_since_batch = self._failed_since_batch, 0
            invalid, self._invalid_since_batch = self._invalid_since_batch, 0
        stats = service_stats(
            groups,
            n_samples=self.n_samples,
            trainer_version=trainer_version,
            stale=len(stale),
            over_bound=over_bound,
            failed=failed,
            invalid=invalid,
            waited=waited,
        )
        self.last_batch = RolloutBatch(groups, stale, stats, trainer_version)
        return self.last_batch
