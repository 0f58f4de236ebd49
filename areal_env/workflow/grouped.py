"""``GroupedRolloutWorkflow``: n samples of the same prompt, run concurrently, as one group.

GRPO normalises rewards within a group, so the members must stay together. Members that are
rejected are dropped; the group is rejected (``None``) only when every member is. Rows come back
tagged with ``traj_ids`` (the member's index in the group, shared by all rows of one trajectory)
and ``group_ids`` (0 here; the executor renumbers both across a batch).
"""

from __future__ import annotations

import asyncio
import copy
import traceback
import uuid
from typing import Any

from areal_env.api.workflow import RolloutWorkflow
from areal_env.workflow.batch import concat_tensor_dicts, tag_rows
from areal_env.workflow.proxy_workflow import (
    EpisodeRecord,
    current_group_id,
    episode_sink,
    log_rejection,
    record_episode,
    task_id_of,
)


def normalize_episode_output(out: Any) -> dict[str, Any] | None:
    """Bring what a workflow returned into tensor-dict form (or None = rejected).

    Accepts a tensor dict, export rows ``{row_id: {"input_ids": [...], ...}}`` or
    ``{interaction_id: Interaction}`` (rows built per interaction, reward as recorded).
    """
    import torch

    from areal_env.workflow.batch import rows_to_tensor_dict, tensor_only

    if out is None:
        return None
    if not isinstance(out, dict):
        raise TypeError(
            f"a workflow returned {type(out).__name__}; expected a tensor dict, export rows, "
            "{id: Interaction} or None"
        )
    if not out:
        return None
    if isinstance(out.get("input_ids"), torch.Tensor):
        td = tensor_only(out)
        return td if td["input_ids"].shape[0] > 0 else None
    values = list(out.values())
    if all(isinstance(v, dict) and "input_ids" in v for v in values):
        return rows_to_tensor_dict(values)
    if all(hasattr(v, "prompt_ids") and hasattr(v, "output_ids") for v in values):
        rows = []
        for it in values:
            p, o = list(it.prompt_ids), list(it.output_ids)
            rows.append(
                {
                    "input_ids": p + o,
                    "loss_mask": [0] * len(p) + [1] * len(o),
                    "logprobs": [0.0] * len(p) + list(it.output_logprobs),
                    "versions": [-1] * len(p) + list(it.output_versions),
                    "reward": it.reward if it.reward is not None else 0.0,
                }
            )
        return rows_to_tensor_dict(rows)
    raise TypeError("a workflow returned a dict that is neither a tensor dict nor export rows")


async def run_member(
    workflow: RolloutWorkflow, engine: Any, data: dict[str, Any], traj_index: int | None
) -> tuple[dict[str, Any] | None, list[EpisodeRecord]]:
    """Run one episode in its own record sink; always yields at least one record, never raises."""
    with episode_sink() as sink:
        try:
            out = normalize_episode_output(await workflow.arun_episode(engine, data))
            error = None
        except asyncio.CancelledError:
            raise
        except Exception as e:
            out = None
            error = f"{type(e).__name__}: {e}"
            log_rejection("workflow_error", error, traceback.format_exc())
        records = list(sink)
    if not records:
        records = [
            EpisodeRecord(
                task_id=task_id_of(data),
                group_id=current_group_id.get(),
                accepted=out is not None,
                reason=None
                if out is not None
                else ("workflow_error" if error else "workflow_rejected"),
                error=error,
            )
        ]
        if out is not None:
            records[0].n_rows = int(out["input_ids"].shape[0])
            records[0].output_tokens = int(out["loss_mask"].sum())
    if traj_index is not None:
        for r in records:
            r.traj_index = traj_index
    return out, records


class GroupedRolloutWorkflow(RolloutWorkflow):
    """Runs ``inner`` ``n_samples`` times concurrently on the same item."""

    def __init__(self, inner: RolloutWorkflow, n_samples: int) -> None:
        if n_samples < 1:
            raise ValueError(f"n_samples={n_samples} must be >= 1")
        self.inner = inner
        self.n_samples = n_samples

    @property
    def sessions_per_episode(self) -> int:
        """Proxy sessions one group opens (the executor grants this much capacity per group)."""
        return self.n_samples * int(getattr(self.inner, "sessions_per_episode", 0))

    async def aclose(self) -> None:
        close = getattr(self.inner, "aclose", None)
        if close is not None:
            await close()

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, Any] | None:
        token = current_group_id.set(uuid.uuid4().hex[:16])
        try:
            results = await asyncio.gather(
                *(run_member(self.inner, engine, _copy(data), i) for i in range(self.n_samples))
            )
        finally:
            current_group_id.reset(token)
        parts = []
        for i, (out, records) in enumerate(results):
            for r in records:
                record_episode(r)
            if out is not None:
                parts.append(tag_rows(out, group_id=0, traj_id=i))
        if not parts:
            return None
        return concat_tensor_dicts(parts)


def _copy(data: Any) -> Any:
    """Each member gets its own copy, so an agent mutating ``data`` cannot affect its siblings."""
    try:
        return copy.deepcopy(data)
    except Exception:
        return data
