"""``Episode``: the one record an agent episode travels in, from the proxy's export to the
trainer's batch (slime's ``Sample`` is the model).

A workflow episode (one agent run through the proxy) and an external session finished through
the service are the same thing to everything downstream: the executor and the service's
trajectory source group episodes, the trainer collates the accepted ones into tensors once
(``areal_env.workflow.batch.collate_groups``), and dumps, evaluation and the viewer read the
same fields. An episode's training sequences are its ``rows`` (one :class:`TrainingRow` per
branch of the conversation tree); the rest says where it came from and what happened.

Plain data, no torch: light clients can build episodes too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from areal_env.api.rows import TrainingRow, rows_from_export


@dataclass
class Episode:
    """One agent episode (accepted or rejected) and its training rows."""

    rows: list[TrainingRow] = field(default_factory=list)
    """Its training sequences; empty when rejected."""
    task_id: str | None = None
    group_id: str | None = None
    """The group it is trained with (GRPO normalises rewards inside a group): the proxy
    session's group id for workflow episodes, the group key for external sessions."""
    traj_index: int = 0
    """Its index among the members of its group."""
    guided: bool = False
    """Whether the engine wrote steps of a reference solution into its replies
    (``rollout.guided_samples``): its reward says what the guide made possible, not what the
    policy does alone."""
    session_id: str | None = None
    accepted: bool = False
    reason: str | None = None
    """Why it was rejected: agent_error | timeout | bad_reward | no_completions | proxy_error |
    workflow_error | workflow_rejected (or a reason the agent's error names)."""
    error: str | None = None
    reward: Any = None
    """What the agent returned once validated (a float or ``{completion_id: float}``)."""
    score: float | None = None
    """The episode's single reward for statistics and evaluation (an external session's
    ``final_reward``); ``None``: the mean of its rows' rewards (see :attr:`mean_reward`)."""
    interactions: list[dict[str, Any]] = field(default_factory=list)
    """The exported conversation tree (completions, their parents, texts, rewards)."""
    export_stats: dict[str, Any] = field(default_factory=dict)
    start_version: int | None = None
    """The engine's weight version when the episode started."""
    wall_time: float = 0.0
    uid: int = 0
    """Unique among the episodes a source hands out (the batch's trajectory id)."""
    origin: dict[str, Any] = field(default_factory=dict)
    """Where an external episode came from (the service's session record: user, status,
    metadata, final_reward, ...) and its store row (``store_row``); empty for workflow
    episodes."""

    @classmethod
    def from_export(cls, export: Mapping[str, Any], **fields: Any) -> Episode:
        """An accepted episode from one session's export (``{"trajectories": {row_id: row},
        "interactions": [...], "stats": {...}, ...}``); ``ValueError`` when it has no rows."""
        rows = rows_from_export(export.get("trajectories", export.get("rows", {})) or {})
        if not rows:
            raise ValueError("the session made no completions (no rows to train on)")
        return cls(
            rows=rows,
            accepted=True,
            interactions=list(export.get("interactions") or []),
            export_stats=dict(export.get("stats") or {}),
            **fields,
        )

    # -- what the rows say ----------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    @property
    def output_tokens(self) -> int:
        """Tokens in the loss (the generated ones)."""
        return sum(r.num_trained for r in self.rows)

    @property
    def min_version(self) -> int | None:
        """Oldest weight version among its generated tokens (``None``: none generated)."""
        versions = [v for r in self.rows for v in r.generated_versions()]
        return min(versions) if versions else None

    @property
    def max_version(self) -> int | None:
        versions = [v for r in self.rows for v in r.generated_versions()]
        return max(versions) if versions else None

    @property
    def mean_reward(self) -> float:
        """The episode's reward: ``score`` when set, else the mean of its rows' rewards."""
        if self.score is not None:
            return self.score
        return sum(r.reward for r in self.rows) / len(self.rows) if self.rows else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The JSON record dumps and evaluation logs read (rows left out: training data)."""
        out = {
            "task_id": self.task_id,
            "group_id": self.group_id,
            "traj_index": self.traj_index,
            "guided": self.guided,
            "session_id": self.session_id,
            "accepted": self.accepted,
            "reason": self.reason,
            "error": self.error,
            "reward": self.reward,
            "interactions": self.interactions,
            "export_stats": self.export_stats,
            "n_rows": len(self.rows),
            "output_tokens": self.output_tokens,
            "min_version": self.min_version,
            "max_version": self.max_version,
            "start_version": self.start_version,
            "wall_time": self.wall_time,
        }
        if self.origin:
            out["origin"] = {k: v for k, v in self.origin.items() if k != "store_row"}
        return out
