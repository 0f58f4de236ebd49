"""The rollout workflow interface: one episode in, training data (or a rejection) out."""

from __future__ import annotations

import abc
from typing import Any


class RolloutWorkflow(abc.ABC):
    """Runs one episode for one dataset item.

    ``arun_episode`` returns ``{interaction_id: Interaction}`` (the proxy's records), a tensor dict
    (``input_ids``, ``attention_mask``, ``loss_mask``, ``logprobs``, ``versions``, ``rewards``),
    or ``None`` when the trajectory is rejected (errors, no completions, bad reward).
    """

    @abc.abstractmethod
    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any | None:
        raise NotImplementedError
