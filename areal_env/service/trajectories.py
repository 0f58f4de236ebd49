"""The external trajectories the service batches: one finished session (``Trajectory``), the
GRPO group it waits in, the tensor batch a list of groups collates to, and the batch's stats.

Apart from ``source`` (the queue, admission and durability) so each stays one job.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from areal_env.api.rows import TrainingRow, rows_from_export
from areal_env.workflow.batch import collate, number_groups

__all__ = ["Trajectory", "TrajectoryGroup", "batch_stats", "collate_groups", "to_trajectory"]


@dataclass
class Trajectory:
    """One finished external session, ready to be batched."""

    traj_id: int
    group_key: str
    rows: list[TrainingRow]
    reward: float
    min_version: int | None
    """Oldest weights version among the generated tokens (None: no generated tokens)."""
    max_version: int | None
    num_tokens: int
    record: dict[str, Any]
    """The raw export (plus gateway metadata), kept for trajectory dumps."""
    row_id: int | None = None
    """Its row in the service store (None without a store)."""


@dataclass
class TrajectoryGroup:
    key: str
    created: float = field(default_factory=time.monotonic)
    members: list[Trajectory] = field(default_factory=list)
    failed: int = 0
    abandoned: int = 0
    """Members that failed and will not be retried: the group stops waiting for them."""


def to_trajectory(traj_id: int, group_key: str, record: dict[str, Any]) -> Trajectory:
    rows = rows_from_export(record.get("trajectories", record.get("rows", {})))
    if not rows:
        raise ValueError("trajectory has no rows (the session made no completions)")
    versions = [v for r in rows for v in r.generated_versions()]
    if record.get("final_reward") is not None:
        reward = float(record["final_reward"])
    else:
        reward = sum(r.reward for r in rows) / len(rows)
    return Trajectory(
        traj_id=traj_id,
        group_key=group_key,
        rows=rows,
        reward=reward,
        min_version=min(versions) if versions else None,
        max_version=max(versions) if versions else None,
        num_tokens=sum(r.num_tokens for r in rows),
        record=record,
    )


def collate_groups(groups: list[list[Trajectory]]) -> dict:
    """One tensor batch; ``group_ids`` index the group in the batch, ``traj_ids`` the session."""
    for group in groups:
        for traj in group:
            for row in traj.rows:
                row.traj_id = traj.traj_id
    return collate(number_groups([[r for t in g for r in t.rows] for g in groups]))


def batch_stats(
    groups: list[list[Trajectory]],
    *,
    n_samples: int,
    trainer_version: int,
    stale: int,
    over_bound: int,
    failed: int,
    invalid: int,
    waited: float,
) -> dict[str, float]:
    """The batch's counters, under the same names as the ``RolloutExecutor``'s stats so the
    trainer logs both alike. ``stale``: dropped past the staleness bound; ``over_bound``: past
    it but trained (``service.stale_trajectories: train``)."""
    trajs = [t for g in groups for t in g]
    rewards = [t.reward for t in trajs]
    n = len(rewards)
    mean = sum(rewards) / n if n else 0.0
    std = (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5 if n else 0.0
    staleness = [trainer_version - t.min_version for t in trajs if t.min_version is not None]
    return {
        "episodes/accepted": float(n),
        "episodes/rejected": float(stale + failed + invalid),
        "rejected/stale": float(stale),
        "rejected/failed": float(failed),
        "rejected/invalid": float(invalid),
        "groups/accepted": float(len(groups)),
        "groups/incomplete": float(sum(1 for g in groups if len(g) < n_samples)),
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
        "staleness/over_bound": float(over_bound),
        "rows": float(sum(len(t.rows) for t in trajs)),
        "tokens/output": float(sum(r.num_trained for t in trajs for r in t.rows)),
        "tokens/total": float(sum(t.num_tokens for t in trajs)),
        "time/wall": waited,
    }
