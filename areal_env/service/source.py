"""``ExternalTrajectorySource``: training batches filled by trajectories that external agents finish.

The gateway ``put``s each finalized session's exported trajectory here (from its own thread and
event loop); the trainer awaits ``rollout_batch`` (from another loop), which has the same shape
as ``RolloutExecutor.rollout_batch`` so the trainer can take either as its batch source.

Grouping: sessions carrying the same ``group_id`` form one GRPO group (across clients); a group
is complete once ``n_samples`` successful trajectories arrived (failed sessions do not count, so a
client may retry them). Sessions without a group id are grouped in arrival order. A group that
waits longer than ``group_timeout`` for members is used as it is. Waiting never polls: waiters
sleep on an ``asyncio.Event`` that ``put`` sets thread-safely.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


class SourceClosedError(RuntimeError):
    """The source was closed while a batch was awaited (the service is shutting down)."""


@dataclass
class Trajectory:
    """One finished external session, ready to be batched."""

    traj_id: int
    group_key: str
    rows: list[dict[str, Any]]
    reward: float
    min_version: int | None
    """Oldest weights version among the generated tokens (None: no generated tokens)."""
    max_version: int | None
    num_tokens: int
    record: dict[str, Any]
    """The raw export (plus gateway metadata), kept for trajectory dumps."""


@dataclass
class _Group:
    key: str
    created: float = field(default_factory=time.monotonic)
    members: list[Trajectory] = field(default_factory=list)
    failed: int = 0


def _row_versions(row: dict[str, Any]) -> list[int]:
    versions = row.get("versions") or []
    mask = row.get("loss_mask") or [1] * len(versions)
    return [int(v) for v, m in zip(versions, mask, strict=False) if m and int(v) >= 0]


def _to_trajectory(traj_id: int, group_key: str, record: dict[str, Any]) -> Trajectory:
    rows_obj = record.get("trajectories", record.get("rows", {}))
    rows = list(rows_obj.values()) if isinstance(rows_obj, dict) else list(rows_obj)
    if not rows:
        raise ValueError("trajectory has no rows (the session made no completions)")
    versions = [v for r in rows for v in _row_versions(r)]
    if record.get("final_reward") is not None:
        reward = float(record["final_reward"])
    else:
        reward = sum(float(r.get("reward", 0.0)) for r in rows) / len(rows)
    return Trajectory(
        traj_id=traj_id,
        group_key=group_key,
        rows=rows,
        reward=reward,
        min_version=min(versions) if versions else None,
        max_version=max(versions) if versions else None,
        num_tokens=sum(len(r["input_ids"]) for r in rows),
        record=record,
    )


def collate_rows(rows: list[dict[str, Any]], group_ids: list[int], traj_ids: list[int]) -> dict:
    """Right-padded tensor batch (keys as ``to_tensor_dict`` plus ``group_ids``/``traj_ids``)."""
    import torch

    n = len(rows)
    length = max(len(r["input_ids"]) for r in rows)
    out = {
        "input_ids": torch.zeros(n, length, dtype=torch.int64),
        "attention_mask": torch.zeros(n, length, dtype=torch.bool),
        "loss_mask": torch.zeros(n, length, dtype=torch.int32),
        "logprobs": torch.zeros(n, length, dtype=torch.float32),
        "versions": torch.full((n, length), -1, dtype=torch.int32),
        "rewards": torch.tensor([float(r.get("reward", 0.0)) for r in rows], dtype=torch.float32),
        "group_ids": torch.tensor(group_ids, dtype=torch.int64),
        "traj_ids": torch.tensor(traj_ids, dtype=torch.int64),
    }
    for i, r in enumerate(rows):
        k = len(r["input_ids"])
        out["input_ids"][i, :k] = torch.tensor(r["input_ids"], dtype=torch.int64)
        out["attention_mask"][i, :k] = True
        for key, dtype in (("loss_mask", torch.int32), ("logprobs", torch.float32)):
            vals = list(r.get(key) or [])[:k]
            if vals:
                out[key][i, : len(vals)] = torch.tensor(vals, dtype=dtype)
        vers = list(r.get("versions") or [])[:k]
        if vers:
            out["versions"][i, : len(vers)] = torch.tensor(vers, dtype=torch.int32)
    return out


def _collate(groups: list[list[Trajectory]]) -> dict:
    """One tensor batch; ``group_ids`` index the group in the batch, ``traj_ids`` the session.

    Uses the workflow package's batching (one batch format for the trainer) when present.
    """
    rows: list[dict[str, Any]] = []
    group_ids: list[int] = []
    traj_ids: list[int] = []
    for gi, group in enumerate(groups):
        for traj in group:
            for row in traj.rows:
                rows.append(row)
                group_ids.append(gi)
                traj_ids.append(traj.traj_id)
    try:
        from areal_env.workflow.batch import rows_to_tensor_dict
    except ImportError:
        return collate_rows(rows, group_ids, traj_ids)
    import torch

    out = rows_to_tensor_dict(rows)
    out["group_ids"] = torch.tensor(group_ids, dtype=torch.int64)
    out["traj_ids"] = torch.tensor(traj_ids, dtype=torch.int64)
    return out


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
    ) -> None:
        self.n_samples = int(n_samples or getattr(rollout, "n_samples", 1))
        self.batch_size = int(batch_size or getattr(rollout, "batch_size", 1))
        if max_head_offpolicyness is None:
            max_head_offpolicyness = getattr(rollout, "max_head_offpolicyness", 0)
        self.max_head_offpolicyness = int(max_head_offpolicyness)
        self.group_timeout = float(group_timeout)
        self._lock = threading.Lock()
        self._open: dict[str, _Group] = {}
        self._auto: _Group | None = None
        self._auto_ids = itertools.count()
        self._ready: deque[_Group] = deque()
        self._traj_ids = itertools.count()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._closed = False
        self._version = 0
        self._version0: int | None = None
        self.admission_control = admission_control
        self._admitted = 0
        self._failed_since_batch = 0
        self._invalid_since_batch = 0
        self.total_received = 0
        self.total_failed = 0
        self.last_episodes: list[dict[str, Any]] = []

    # -- producer side (any thread) --------------------------------------------------------

    def put(self, trajectory: dict[str, Any], group_id: str | None = None) -> None:
        """Add one finished session's export (``{"trajectories": {row_id: row}, ...}``)."""
        with self._lock:
            if self._closed:
                raise SourceClosedError("the trajectory source is closed")
            group = self._group_for(group_id)
            try:
                traj = _to_trajectory(next(self._traj_ids), group.key, trajectory)
            except (KeyError, TypeError, ValueError) as e:
                logger.warning("dropping an unusable trajectory of group %s: %s", group.key, e)
                self._invalid_since_batch += 1
                return
            group.members.append(traj)
            self.total_received += 1
            if len(group.members) >= self.n_samples:
                self._complete(group)
        self._wake()

    def put_failed(self, group_id: str | None = None, reason: str = "") -> None:
        """Record a failed session (excluded from training; its group keeps waiting, and its
        admission slot is given back)."""
        with self._lock:
            self.total_failed += 1
            self._failed_since_batch += 1
            self._admitted = max(0, self._admitted - 1)
            if group_id is not None and group_id in self._open:
                self._open[group_id].failed += 1
        logger.info("external session of group %s failed: %s", group_id, reason or "no reason")
        self._wake()

    # -- admission (staleness control at session start) -----------------------------------

    def _admission_limit(self) -> int:
        """Sessions that may have started by now: ``(versions trained + offpolicyness + 1)``
        batches. A session admitted under this limit is consumed at most
        ``max_head_offpolicyness`` versions after its weights (AReaL's rule)."""
        trained = self._version - (self._version0 if self._version0 is not None else 0)
        per_batch = self.batch_size * self.n_samples
        return (trained + self.max_head_offpolicyness + 1) * per_batch

    def try_admit(self) -> bool:
        """Take an admission slot if one is free (always True without admission control)."""
        if not self.admission_control:
            return True
        with self._lock:
            if self._version0 is None:
                self._version0 = self._version
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
        """Wait (no polling: woken by version bumps and failures) for an admission slot."""
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

    def _group_for(self, group_id: str | None) -> _Group:
        if group_id is None:
            if self._auto is None:
                self._auto = _Group(key=f"auto-{next(self._auto_ids)}")
            return self._auto
        group = self._open.get(group_id)
        if group is None:
            group = self._open[group_id] = _Group(key=group_id)
        return group

    def _complete(self, group: _Group) -> None:
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
            if self._version0 is None and self._admitted == 0:
                self._version0 = int(version)
            self._version = int(version)
        self._wake()  # admission waiters may proceed

    def get_version(self) -> int:
        return self._version

    @property
    def num_ready_groups(self) -> int:
        with self._lock:
            return len(self._ready)

    @property
    def num_pending_trajectories(self) -> int:
        with self._lock:
            pending = sum(len(g.members) for g in self._open.values())
            return pending + (len(self._auto.members) if self._auto else 0)

    def _is_stale(self, traj: Trajectory, trainer_version: int) -> bool:
        return (
            traj.min_version is not None
            and trainer_version - traj.min_version > self.max_head_offpolicyness
        )

    # RolloutExecutor's prefetching interface (``submit`` + ``next_batch``), so a trainer that
    # drives an executor can drive this source unchanged: items are ignored (the data lives
    # with the external agents).
    uses_proxy = False

    def submit(self, item: Any = None) -> None:
        """No-op: external agents choose their own work."""

    def feed(self, items: Any = None) -> None:
        """No-op: external agents choose their own work."""

    async def next_batch(
        self, *, trainer_version: int, batch_size: int | None = None, timeout: float | None = None
    ) -> tuple[dict | None, dict[str, float]]:
        """``rollout_batch`` with an explicit number of groups."""
        return await self.rollout_batch(
            trainer_version=trainer_version, timeout=timeout, batch_size=batch_size
        )

    async def aclose(self) -> None:
        """Nothing to cancel: the gateway owns the sessions (``close()`` ends the source)."""

    async def rollout_batch(
        self,
        items: list[dict] | None = None,
        *,
        trainer_version: int,
        timeout: float | None = None,
        batch_size: int | None = None,
    ) -> tuple[dict | None, dict[str, float]]:
        """Wait for ``batch_size`` complete groups and return ``(tensor batch, stats)``.

        ``items`` is accepted for signature compatibility with ``RolloutExecutor`` and ignored:
        the data lives with the external agents. Trajectories generated on weights more than
        ``max_head_offpolicyness`` versions behind ``trainer_version`` are dropped (counted).
        ``timeout`` (seconds) returns ``(None, stats)`` when not enough groups arrived.
        """
        want = int(batch_size or self.batch_size)
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        waiter = (loop, event)
        selected: list[list[Trajectory]] = []
        stale = 0
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
                        fresh = [t for t in group.members if not self._is_stale(t, trainer_version)]
                        stale += len(group.members) - len(fresh)
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
                for group in reversed(selected):
                    self._ready.appendleft(_Group(key=group[0].group_key, members=group))
            raise
        finally:
            with self._lock:
                self._waiters.discard(waiter)
        return self._finish(selected, stale, trainer_version, time.monotonic() - start)

    def _finish(
        self, groups: list[list[Trajectory]], stale: int, trainer_version: int, waited: float
    ) -> tuple[dict | None, dict[str, float]]:
        with self._lock:
            failed, self._failed_since_batch = self._failed_since_batch, 0
            invalid, self._invalid_since_batch = self._invalid_since_batch, 0
        trajs = [t for g in groups for t in g]
        rewards = [t.reward for t in trajs]
        n = len(rewards)
        mean = sum(rewards) / n if n else 0.0
        std = (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5 if n else 0.0
        staleness = [trainer_version - t.min_version for t in trajs if t.min_version is not None]
        # Same names as the RolloutExecutor's stats, so the trainer logs both alike.
        stats: dict[str, float] = {
            "episodes/accepted": float(n),
            "episodes/rejected": float(stale + failed + invalid),
            "rejected/stale": float(stale),
            "rejected/failed": float(failed),
            "rejected/invalid": float(invalid),
            "groups/accepted": float(len(groups)),
            "groups/incomplete": float(sum(1 for g in groups if len(g) < self.n_samples)),
            "groups/zero_variance": float(
                sum(
                    1
                    for g in groups
                    if len(g) > 1 and max(t.reward for t in g) - min(t.reward for t in g) < 1e-8
                )
            ),
            "reward/mean": mean,
            "reward/std": std,
            "reward/min": min(rewards) if rewards else 0.0,
            "reward/max": max(rewards) if rewards else 0.0,
            "staleness/mean": sum(staleness) / len(staleness) if staleness else 0.0,
            "staleness/max": float(max(staleness)) if staleness else 0.0,
            "rows": float(sum(len(t.rows) for t in trajs)),
            "tokens/output": float(
                sum(sum(r.get("loss_mask") or []) for t in trajs for r in t.rows)
            ),
            "tokens/total": float(sum(t.num_tokens for t in trajs)),
            "time/wall": waited,
        }
        self.last_episodes = [dict(t.record, group_key=t.group_key) for t in trajs]
        if not trajs:
            return None, stats
        return _collate(groups), stats
