"""The rollout workflow interface: one episode in, training data (or a rejection) out."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from areal_env.api.engine import InferenceEngine
    from areal_env.api.rows import TrainingRow


class RolloutWorkflow(abc.ABC):
    """Runs one episode for one dataset item.

    ``arun_episode`` returns the episode's :class:`~areal_env.api.rows.TrainingRow` list (also
    accepted: the proxy's export rows, ``{interaction_id: Interaction}``, or a tensor dict with
    ``input_ids``, ``attention_mask``, ``loss_mask``, ``logprobs``, ``versions``, ``rewards``), or
    ``None`` when the trajectory is rejected (errors, no completions, bad reward).

    ``n_samples``: episodes one call runs (a group); ``sessions_per_episode``: proxy sessions
    one episode opens (the executor grants that much capacity before starting it).
    """

    n_samples: int = 1
    sessions_per_episode: int = 0

    @abc.abstractmethod
    async def arun_episode(
        self, engine: InferenceEngine | None, data: dict[str, Any]
    ) -> list[TrainingRow] | Any | None:
        raise NotImplementedError

    async def aclose(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release what the workflow holds (HTTP clients, worker processes)."""
