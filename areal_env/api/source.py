"""``BatchSource``: where ``PPOTrainer`` takes its training batches from.

Two implementations: ``areal_env.trainer.feed.DatasetSource`` (dataset items rolled out by a
``RolloutExecutor`` through the proxy, optionally one batch ahead) and the any-agent service's
``ExternalTrajectorySource`` (trajectories that external agents finish). The trainer programs
against this protocol only, so it has one batch-fetching path whatever the source.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    TensorBatch = dict[str, torch.Tensor]
else:
    TensorBatch = dict


class SourceClosedError(RuntimeError):
    """The source was closed while a batch was awaited (a normal way for training to stop)."""


@runtime_checkable
class BatchSource(Protocol):
    """A stream of training batches, each collated once into tensors.

    ``next_batch`` waits for ``batch_size`` groups (the source's default when ``None``) made on
    weights no older than the staleness bound allows at ``trainer_version``, and returns
    ``(batch or None when every episode was rejected, stats)``. ``last_episodes``: the records
    of the episodes behind the last batch (for trajectory dumps). ``set_version`` tells the
    source the trainer's current weight version. ``aclose`` cancels background work.
    Raises :class:`SourceClosedError` when the source ends.
    """

    @property
    def last_episodes(self) -> list[dict[str, Any]]: ...

    async def next_batch(
        self, *, trainer_version: int, batch_size: int | None = None
    ) -> tuple[TensorBatch | None, dict[str, float]]: ...

    def set_version(self, version: int) -> None: ...

    async def aclose(self) -> None: ...
