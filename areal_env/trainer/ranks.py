"""``RankChannel``: how rank 0 tells the other ranks which collective comes next.

Under ``torchrun`` with ``actor.strategy: fsdp`` only rank 0 rolls out; the others hold their
shard of the actor and must enter every collective (update, weight gather, checkpoint) in the
same order. Rank 0 announces each one with a small command dict; the others wait for it.
"""

from __future__ import annotations

from typing import Any

from areal_env.trainer.dist import DistContext, broadcast_object


class RankChannel:
    """Commands from rank 0 to the other ranks (no-ops in one process)."""

    def __init__(self, dist: DistContext) -> None:
        self.dist = dist

    def announce(self, cmd: dict[str, Any]) -> None:
        """Rank 0: the collective that comes next (``{"op": ..., ...}``)."""
        if self.dist.distributed and self.dist.is_main:
            broadcast_object(cmd, self.dist)

    def receive(self) -> dict[str, Any]:
        """A rank other than 0: wait for rank 0's next command."""
        return broadcast_object(None, self.dist)
