"""``DatasetSource``: dataset items rolled out through a ``RolloutExecutor``, as a
:class:`~areal_env.api.source.BatchSource`.

Without prefetching each ``next_batch`` draws the next items and rolls them out. With it
(``rollout.max_head_offpolicyness > 0``) the items of the following batch are submitted before
this one is returned, so they roll out while the trainer updates on it; the staleness bound
of the executor keeps them close enough to the policy.
"""

from __future__ import annotations

from typing import Any

from areal_env.api.source import RolloutBatch
from areal_env.trainer.data import DataLoader
from areal_env.workflow.executor import RolloutExecutor


class DatasetSource:
    """Batches of ``data`` rolled out by ``executor``; ``batches``: how many will be asked for
    (no items are drawn ahead past the last one; ``None`` = no limit)."""

    def __init__(
        self,
        data: DataLoader,
        executor: RolloutExecutor,
        *,
        prefetch: bool,
        batches: int | None,
    ) -> None:
        self.data = data
        self.executor = executor
        self.prefetch = prefetch
        self._left = batches
        self._pending: list[dict[str, Any]] | None = None
        self.data_state: dict[str, Any] | None = None
        """The data position after the batch last returned (items drawn ahead not counted)."""

    def set_version(self, version: int) -> None:
        self.executor.set_version(version)

    def skip_step(self) -> None:
        """The batch last returned was consumed without an update (see
        ``RolloutExecutor.skip_step``)."""
        self.executor.skip_step()

    def _submit_next(self) -> list[dict[str, Any]]:
        items = self.data.next_batch()
        for item in items:
            self.executor.submit(item)
        return items

    async def next_batch(
        self, *, trainer_version: int, batch_size: int | None = None
    ) -> RolloutBatch:
        if self._left is not None:
            self._left -= 1
        if not self.prefetch:
            items = self.data.next_batch()
            self.data_state = self.data.state_dict()
            batch = await self.executor.rollout_batch(items, trainer_version=trainer_version)
        else:
            if self._pending is None:
                self._pending = self._submit_next()
            self.data_state = self.data.state_dict()
            items = self._pending
            more = self._left is None or self._left > 0
            self._pending = self._submit_next() if more else None
            batch = await self.executor.next_batch(
                trainer_version=trainer_version, batch_size=len(items)
            )
        # the rewards steer the order of the batches drawn from now on (rollout.prompt_sampling)
        self.data.record(batch.episodes)
        batch.stats.update(self.data.order.stats())
        return batch

    async def aclose(self) -> None:
        await self.executor.aclose()
