"""External sessions as episodes: a finished session's record becomes an
:class:`~areal_env.api.episode.Episode`, waits in its GRPO group, and a batch's service
counters are added to the executor's (``workflow.batch.rollout_stats``).

Apart from ``source`` (the queue, admission and durability) so each stays one job.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from areal_env.api.episode import Episode
from areal_env.workflow.batch import rollout_stats

#: What an external episode keeps of its session record besides the export itself.
ORIGIN_KEYS = ("group_id", "user", "status", "metadata", "final_reward")


def external_episode(
    record: dict[str, Any], *, group_key: str, uid: int, store_row: int | None = None
) -> Episode:
    """The episode of one finished session (the gateway's record: the proxy's export plus the
    session's metadata). ``ValueError`` when it has no rows to train on."""
    final = record.get("final_reward")
    origin = {k: record.get(k) for k in ORIGIN_KEYS}
    if store_row is not None:
        origin["store_row"] = store_row
    return Episode.from_export(
        record,
        task_id=record.get("task_id"),
        group_id=group_key,
        session_id=record.get("session_id"),
        reward=final,
        score=float(final) if final is not None else None,
        uid=uid,
        origin=origin,
    )


def store_row(episode: Episode) -> int | None:
    """The episode's row in the service store (``None`` without a store)."""
    row = episode.origin.get("store_row")
    return int(row) if row is not None else None


@dataclass
class TrajectoryGroup:
    """External episodes waiting for their group to complete."""

    key: str
    created: float = field(default_factory=time.monotonic)
    members: list[Episode] = field(default_factory=list)
    failed: int = 0
    abandoned: int = 0
    """Members that failed and will not be retried: the group stops waiting for them."""


def service_stats(
    groups: list[list[Episode]],
    *,
    n_samples: int,
    trainer_version: int,
    stale: int,
    over_bound: int,
    failed: int,
    invalid: int,
    waited: float,
) -> dict[str, float]:
    """The batch's counters: the executor's (``rollout_stats``) plus the service's own.
    ``stale``: dropped past the staleness bound; ``over_bound``: past it but trained
    (``service.stale_trajectories: train``); ``failed`` / ``invalid``: sessions that ended
    without a usable trajectory since the last batch."""
    stats = rollout_stats(groups, [], trainer_version=trainer_version, wall_time=waited)
    stats.update(
        {
            "episodes/rejected": float(stale + failed + invalid),
            "rejected/stale": float(stale),
            "rejected/failed": float(failed),
            "rejected/invalid": float(invalid),
            "groups/incomplete": float(sum(1 for g in groups if len(g) < n_samples)),
            "staleness/over_bound": float(over_bound),
        }
    )
    return stats
