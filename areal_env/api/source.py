"""``BatchSource``: where ``PPOTrainer`` takes its training batches from, as episodes.

Two implementations: ``areal_env.trainer.feed.DatasetSource`` (dataset items rolled out by a
``RolloutExecutor`` through the proxy, optionally one batch ahead) and the any-agent service's
``ExternalTrajectorySource`` (sessions that external agents finish). Both hand out a
:class:`RolloutBatch` of :class:`~areal_env.api.episode.Episode` groups; the trainer collates
it into tensors once (``areal_env.workflow.batch.collate_groups``). No source pads rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from areal_env.api.episode import Episode

if TYPE_CHECKING:
    import torch

    TensorBatch = dict[str, torch.Tensor]
else:
    TensorBatch = dict


class SourceClosedError(RuntimeError):
    """The source was closed while a batch was awaited (a normal way for training to stop)."""


@dataclass
class RolloutBatch:
    """One training step's episodes: the accepted ones in their groups, and the rejected."""

    groups: list[list[Episode]] = field(default_factory=list)
    """Accepted episodes, one list per group (GRPO normalises rewards inside a group)."""
    rejected: list[Episode] = field(default_factory=list)
    """Episodes that will not be trained on (dumped with their reason)."""
    stats: dict[str, float] = field(default_factory=dict)
    """Rollout counters and reward statistics (logged as they are)."""
    trainer_version: int = 0
    """The trainer's weight version when the batch was handed out."""

    @property
    def episodes(self) -> list[Episode]:
        """Every episode of the batch, accepted first (group by group), then the rejected."""
        return [e for g in self.groups for e in g] + list(self.rejected)

    @property
    def empty(self) -> bool:
        """No accepted episode: nothing to train on."""
        return not any(self.groups)


@runtime_checkable
class BatchSource(Protocol):
    """A stream of training batches.

    ``next_batch`` waits for ``batch_size`` groups (the source's default when ``None``) made on
    weights no older than the staleness bound allows at ``trainer_version``. ``set_version``
    tells the source the trainer's current weight version. ``aclose`` cancels background work.
    Raises :class:`SourceClosedError` when the source ends.
    """

    async def next_batch(
        self, *, trainer_version: int, batch_size: int | None = None
    ) -> RolloutBatch: ...

    def set_version(self, version: int) -> None: ...

    async def aclose(self) -> None: ...
