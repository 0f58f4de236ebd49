"""``ExternalTrajectorySource``: training batches filled by trajectories that external agents finish.

The gateway ``put``s each finalized session's exported trajectory here (from its own thread and
event loop), where it becomes an :class:`~areal_env.api.episode.Episode`; the trainer awaits
``next_batch`` (from another loop) and gets a :class:`~areal_env.api.source.RolloutBatch`, as
from the ``RolloutExecutor``, so it takes either as its batch source.

Grouping: sessions carrying the same ``group_id`` form one GRPO group (across clients); a group
is complete once ``n_samples`` successful trajectories arrived (failed sessions do not count, so a
client may retry them). Sessions without a group id are grouped in arrival order. A group that
waits longer than ``group_timeout`` for members is used as it is. A group id names one group:
once its group is complete (or used incomplete) it takes no more members, and a late session
or trajectory is refused (``GroupClosedError``) instead of starting a group of one. Waiting
never polls: waiters sleep on an ``asyncio.Event`` that ``put`` sets thread-safely.

Admission (staleness control at session start) admits groups, not sessions: a group's first
session takes ``n_samples`` slots, and its later members (retries included) are admitted at
once, so a started group is never split by the admission limit.

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


class GroupClosedError(RuntimeError):
    """A session or trajectory names a GRPO group that takes no more members (it is complete,
    or was used incomplete): group ids are single-use."""


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
        """Admission slots taken since this source started: ``n_samples`` per named group, one
        per session without a group id (reloaded trajectories included)."""
        self._admitted_groups: dict[str, int] = {}
        """Named groups admitted and not complete yet -> their sessions still running."""
        self._closed_groups: dict[str, str] = {}
        """Group ids that take no more members -> why (for the refusal's message)."""
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
            self._check_group_open(group_id)
            self._add(trajectory, group_id, None)
        self._wake()

    async def aput(self, trajectory: dict[str, Any], group_id: str | None = None) -> None:
        """``put``, after writing the trajectory to the store (in a worker thread): once this
        returns, no restart loses it. After ``close`` a trajectory is still stored (it is
        trained after the next start); without a store it is refused (``SourceClosedError``).
        A trajectory of a group that takes no more members is refused (``GroupClosedError``)."""
        if self.store is None:
            self.put(trajectory, group_id)
            return
        with self._lock:
            self._check_group_open(group_id)
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
        if group_id is not None and group_id in self._closed_groups:
            # Its group closed while the trajectory was written (a race with the group's
            # completion): take it out again rather than start a group of one.
            if row_id is not None and self.store is not None:
                self.store.drop_trajectories([row_id], self._step, "late")
            self._session_over(group_id)
            self._check_group_open(group_id)
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
        self._session_over(group_id)

    def _maybe_complete(self, group: TrajectoryGroup) -> None:
        if len(group.members) + group.abandoned >= self.n_samples:
            if group.members:
                self._complete(group)
            else:  # every member gave up: nothing to train on
                self._drop_group(group)

    def _drop_group(self, group: TrajectoryGroup) -> None:
        if self._auto is group:
            self._auto = None
            return
        self._open.pop(group.key, None)
        self._close_group(group.key, "every member gave up")
        if self._admitted_groups.pop(group.key, None) is not None:
            self._admitted = max(0, self._admitted - self.n_samples)  # it fills no batch slot

    def put_failed(
        self, group_id: str | None = None, reason: str = "", *, retry: bool = True
    ) -> None:
        """Record a failed session (excluded from training; its admission slot is given back).
        Its group keeps waiting for a retry, unless ``retry`` is False (the client gave up)."""
        with self._lock:
            self.total_failed += 1
            self._failed_since_batch += 1
            self._session_over(group_id)
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
            if self._closed or group_id in self._closed_groups:
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
        trained_groups = self.store.trained_groups()
        now_wall, now_mono = time.time(), time.monotonic()
        with self._lock:
            self._step = restored_step
            if trainer_version is not None:
                self._version = int(trainer_version)
            for key, step in trained_groups.items():
                self._closed_groups[key] = f"it was trained at step {step}"
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
            # Reloaded groups are admitted: the retries of their members lost in the restart
            # start at once (their slots count, as every session's did before the restart).
            self._admitted_groups = {key: 0 for key in self._open}
            named = {st.group_key for st in stored if st.group_key}
            auto = len(stored) - sum(1 for st in stored if st.group_key)
            self._admitted = auto + self.n_samples * len(named)
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
        """Slots that may be taken by now: ``(steps finished + offpolicyness + 1)`` batches'
        worth, so a session is consumed at most ``max_head_offpolicyness`` steps (so versions)
        after its weights (AReaL's rule). Steps, not versions: a skipped update (all-equal
        rewards) leaves the version, and every new session (a restart-failed member's retry
        included) then waited for a version that never came."""
        per_batch = self.batch_size * self.n_samples
        return (self._steps_done + self.max_head_offpolicyness + 1) * per_batch

    def try_admit(self, group_id: str | None = None) -> bool:
        """Admit a session of ``group_id`` if it may start now (always without admission
        control). The first session of a group takes the whole group's ``n_samples`` slots;
        its later members are admitted at once. ``GroupClosedError`` if the group takes no
        more members."""
        with self._lock:
            self._check_group_open(group_id)
            if not self.admission_control:
                return True
            if group_id is not None and group_id in self._admitted_groups:
                self._admitted_groups[group_id] += 1
                return True
            need = 1 if group_id is None else self.n_samples
            if self._admitted + need > self._admission_limit():
                return False
            self._admitted += need
            if group_id is not None:
                self._admitted_groups[group_id] = 1
            return True

    def release_admission(self, group_id: str | None = None) -> None:
        """An admitted session of ``group_id`` never started: give its admission back."""
        with self._lock:
            self._session_over(group_id)
        self._wake()

    def _session_over(self, group_id: str | None) -> None:
        """An admitted session ended (stored, failed, or never started; lock held). A session
        without a group id gives its slot back unless it was stored; a named group gives its
        slots back once nothing of it is left: no member stored, no session running."""
        if not self.admission_control:
            return
        if group_id is None:
            return
        running = self._admitted_groups.get(group_id)
        if running is None:
            return
        running = max(0, running - 1)
        self._admitted_groups[group_id] = running
        group = self._open.get(group_id)
        if running == 0 and (group is None or not group.members):
            del self._admitted_groups[group_id]
            self._admitted = max(0, self._admitted - self.n_samples)

    def _check_group_open(self, group_id: str | None) -> None:
        """Raise ``GroupClosedError`` if ``group_id`` takes no more members (lock held)."""
        if group_id is None:
            return
        why = self._closed_groups.get(group_id)
        if why is not None:
            raise GroupClosedError(
                f"group {group_id!r} takes no more members: {why}. A group id names one GRPO "
                "group; run this sample in a new group (a new group_id)"
            )

    def _close_group(self, key: str, why: str) -> None:
        """Group ``key`` (a named one) takes no more members (lock held)."""
        self._closed_groups[key] = why
        self._admitted_groups.pop(key, None)

    async def admit(self, group_id: str | None = None, timeout: float | None = None) -> bool:
        """Wait (no polling: woken when a training step ends or a session gives its slot
        back) until a session of ``group_id`` is admitted; False after ``timeout`` seconds.
        ``SourceClosedError`` once the source closes, ``GroupClosedError`` for a closed group."""
        if self.try_admit(group_id):
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
                with self._lock:
                    if self._closed:
                        raise SourceClosedError("the trajectory source is closed")
                if self.try_admit(group_id):
                    return True
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

    def _complete(self, group: TrajectoryGroup, why: str | None = None) -> None:
        if self._auto is group:
            self._auto = None
        else:
            self._open.pop(group.key, None)
            members = f"{len(group.members)} of {self.n_samples} members"
            self._close_group(group.key, why or f"it is complete ({members})")
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
                self._complete(
                    group,
                    f"it was used with {len(group.members)} of {self.n_samples} members after "
                    f"waiting service.group_timeout={self.group_timeout:.0f} s",
                )
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
        with self._lock:
            if selected or stale_trajs:
                self._batches_taken += 1
            for members in selected:
                key = str(members[0].group_id)
                if key in self._closed_groups:
                    self._closed_groups[key] = f"it was trained at step {step}"
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
