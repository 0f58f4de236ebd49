"""``TrainingRow``: the one record a training sequence travels in, from the proxy's export to
the trainer.

The proxy exports rows as JSON objects (``input_ids``, ``loss_mask``, ``logprobs``,
``versions``, ``reward``); an :class:`~areal_env.api.episode.Episode` holds its rows, and a
batch of episodes is numbered and padded into tensors exactly once, by
``areal_env.workflow.batch.collate_groups``. Plain lists, no torch: light clients can build
rows too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from areal_env.api.records import field_dict

ROW_FIELDS = ("input_ids", "loss_mask", "logprobs", "versions")


@dataclass(slots=True)
class TrainingRow:
    """One sequence: every token, which of them are trained on, their behaviour logprobs and
    weight versions (``-1``: not generated, e.g. prompt tokens), and the row's reward.

    ``traj_id``: the trajectory the row belongs to (rows of one agent episode share it; inside
    an episode's output it is the episode-local index, renumbered for the batch).
    ``group_id``: the GRPO group in the batch (set when the batch is assembled).
    """

    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float = 0.0
    traj_id: int = 0
    group_id: int = 0
    temperature: float | list[float] = 1.0
    """The temperature the logprobs were taken at (``proxy.sampling``): the trainer recomputes
    at the same one. A list (per token) when the turns of a row were sampled differently."""
    explored: bool = False
    """Some trained token was drawn by ``gconfig.choice_exploration``'s uniform pick rather than
    by the model (see ``actor.punish_failed_exploration``)."""
    row_id: str | None = None
    """The completion (the proxy's interaction id) the row ends at, when it came from an
    export: it links what the trainer did with the row back to the conversation (the token
    record, ``areal-env view``)."""
    policy: str | None = None
    """The policy whose tokens the row trains (a multi-agent run's ``policies:`` name: the
    ``model`` the completion was asked of); ``None`` in a run with one policy."""
    returns: list[float] | None = None
    """Per token, the return of the turn the token belongs to, when the turns of one row earn
    different credit: a ``concat`` row whose intermediate completions carry rewards of their own
    (a verifier's credit for a right tool call), or ``rollout.discount < 1``. ``reward`` is then
    the return of the row's first turn. ``None``: every token earns ``reward``."""

    guided: list[int] | None = None
    """Per token, 1 where a session's guide wrote the turn (``rollout.guided_samples``: a
    reference solution's step, not the model's own choice), else 0; ``None`` when no turn of the
    row was guided. ``actor.guided_nll_coef`` imitates these tokens."""

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        for name in ROW_FIELDS[1:]:
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"row {name} has {len(getattr(self, name))} entries, input_ids has {n}"
                )
        if isinstance(self.temperature, list) and len(self.temperature) != n:
            raise ValueError(
                f"row temperature has {len(self.temperature)} entries, input_ids has {n}"
            )
        if self.returns is not None:
            if len(self.returns) != n:
                raise ValueError(f"row returns has {len(self.returns)} entries, input_ids has {n}")
            if not all(math.isfinite(x) for x in self.returns):
                raise ValueError("row returns must be finite numbers")
        if self.guided is not None and len(self.guided) != n:
            raise ValueError(f"row guided has {len(self.guided)} entries, input_ids has {n}")

    @classmethod
    def from_dict(cls, row: Mapping[str, Any], *, traj_id: int = 0) -> TrainingRow:
        """A row from the proxy's export format (``ValueError`` for misaligned lists)."""
        reward = row.get("reward")
        return cls(
            input_ids=[int(t) for t in row["input_ids"]],
            loss_mask=[int(m) for m in row["loss_mask"]],
            logprobs=[float(x) for x in row["logprobs"]],
            versions=[int(v) for v in row["versions"]],
            reward=float(reward) if reward is not None else 0.0,
            traj_id=traj_id,
            temperature=_temperature(row.get("temperature", 1.0)),
            explored=bool(row.get("explored", False)),
            policy=_policy(row.get("policy")),
            returns=_returns(row.get("returns")),
            guided=_guided(row.get("guided")),
        )

    def to_dict(self) -> dict[str, Any]:
        """The export format (what the proxy sends and light clients read)."""
        return field_dict(self, exclude=("traj_id", "group_id", "row_id"))

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_trained(self) -> int:
        """Tokens in the loss (the generated ones)."""
        return sum(1 for m in self.loss_mask if m)

    def generated_versions(self) -> list[int]:
        """Weight versions of the trained tokens (those generated by some policy)."""
        return [v for v, m in zip(self.versions, self.loss_mask, strict=True) if m and v >= 0]


def _policy(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value or None
    raise ValueError(f"row policy must be a policy name (a string), got {value!r}")


def _guided(value: Any) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple) or any(x not in (0, 1) for x in value):
        raise ValueError("row guided must be a list of 0/1 flags, one per token")
    return [int(x) for x in value] if any(value) else None


def _returns(value: Any) -> list[float] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple):
        raise ValueError(
            f"row returns must be a list of numbers (one per token), got {value!r:.80}"
        )
    return [float(x) for x in value]


def _temperature(value: Any) -> float | list[float]:
    if isinstance(value, list | tuple):
        return [float(x) for x in value]
    return float(value) if value is not None else 1.0


def rows_from_export(
    rows: Mapping[str, Mapping[str, Any]] | Iterable[Mapping[str, Any]],
) -> list[TrainingRow]:
    """Rows of one export (``{row_id: row}`` or a list), in order, all in trajectory 0; from a
    mapping each row keeps its key as ``row_id``."""
    if isinstance(rows, Mapping):
        out = []
        for key, value in rows.items():
            row = TrainingRow.from_dict(value)
            row.row_id = str(key)
            out.append(row)
        return out
    return [TrainingRow.from_dict(r) for r in rows]
