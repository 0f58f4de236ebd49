"""The PPO/GRPO trainer: actor (loss, update), advantages, data, checkpoints, observability.

``from areal_env.trainer import PPOTrainer`` (imported lazily: this package pulls in torch).
"""

from __future__ import annotations

from typing import Any

__all__ = ["PPOTrainer", "PPOActor"]


def __getattr__(name: str) -> Any:
    if name == "PPOTrainer":
        from areal_env.trainer.ppo import PPOTrainer

        return PPOTrainer
    if name == "PPOActor":
        from areal_env.trainer.actor import PPOActor

        return PPOActor
    raise AttributeError(f"module 'areal_env.trainer' has no attribute {name!r}")
