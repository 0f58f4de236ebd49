"""``GroupedRolloutWorkflow``: n samples of the same prompt, run concurrently, as one group.

GRPO normalises rewards within a group, so the members must stay together. Members that are
rejected are dropped; the group is rejected (``None``) only when every member is. Each member's
episode goes to the surrounding episode sink with ``traj_index`` = the member's index; the
executor numbers groups and trajectories for the whole batch once (``batch.collate_groups``).
"""

from __future__ import annotations

import asyncio
import copy
import traceback
import uuid
from typing import Any

from areal_env.api.engine import InferenceEngine
from areal_env.api.episode import Episode
from areal_env.api.rows import TrainingRow
from areal_env.api.workflow import RolloutWorkflow
from areal_env.workflow.batch import episode_rows
from areal_env.workflow.proxy_workflow import (
    current_group_id,
    current_member_index,
    episode_sink,
    log_rejection,
    record_episode,
    task_id_of,
)


async def run_member(
    workflow: RolloutWorkflow,
    engine: InferenceEngine | None,
    data: dict[str, Any],
    traj_index: int | None,
) -> list[Episode]:
    """Run one episode in its own sink and return its episodes (never empty, never raises).

    Proxy workflows record their episodes themselves (rows included); for any other workflow
    the rows it returned become one episode here."""
    member = current_member_index.set(traj_index)
    try:
        with episode_sink() as sink:
            try:
                out = episode_rows(await workflow.arun_episode(engine, data))
                error = None
            except asyncio.CancelledError:
                raise
            except Exception as e:
                out = None
                error = f"{type(e).__name__}: {e}"
                log_rejection("workflow_error", error, traceback.format_exc())
            episodes = list(sink)
    finally:
        current_member_index.reset(member)
    if not episodes:
        episodes = [
            Episode(
                rows=out or [],
                task_id=task_id_of(data),
                group_id=current_group_id.get(),
                accepted=out is not None,
                reason=None
                if out is not None
                else ("workflow_error" if error else "workflow_rejected"),
                error=error,
            )
        ]
    if traj_index is not None:
        for ep in episodes:
            ep.traj_index = traj_index
    return episodes


class GroupedRolloutWorkflow(RolloutWorkflow):
    """Runs ``inner`` ``n_samples`` times concurrently on the same item."""

    def __init__(self, inner: RolloutWorkflow, n_samples: int) -> None:
        if n_samples < 1:
            raise ValueError(f"n_samples={n_samples} must be >= 1")
        self.inner = inner
        self.n_samples = n_samples
        # Proxy sessions one group opens (the executor grants this much capacity per group).
        self.sessions_per_episode = n_samples * inner.sessions_per_episode

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def arun_episode(
        self, engine: InferenceEngine | None, data: dict[str, Any]
    ) -> list[TrainingRow] | None:
        token = current_group_id.set(uuid.uuid4().hex[:16])
        try:
            results = await asyncio.gather(
                *(run_member(self.inner, engine, _copy(data), i) for i in range(self.n_samples))
            )
        finally:
            current_group_id.reset(token)
        rows: list[TrainingRow] = []
        for i, episodes in enumerate(results):
            for ep in episodes:
                record_episode(ep)
                for row in ep.rows if ep.accepted else ():
                    row.traj_id = i  # the member: one trajectory per member in this group
                    rows.append(row)
        return rows or None


def _copy(data: Any) -> Any:
    """Each member gets its own copy, so an agent mutating ``data`` cannot affect its siblings."""
    try:
        return copy.deepcopy(data)
    except Exception:
        return data
