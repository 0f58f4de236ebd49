"""``TrainerState``: what a ``PPOTrainer`` holds, and how rank 0 talks to the other ranks.

The base of the trainer's classes (``ppo_push`` < ``ppo_bookkeeping`` < ``ppo_setup`` <
``ppo.PPOTrainer``): the attributes ``PPOTrainer.__init__`` sets are declared here so each
piece of the trainer type-checks on its own module.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from areal_env.api.config import ExperimentConfig
from areal_env.api.engine import InferenceEngine
from areal_env.api.source import BatchSource
from areal_env.proxy.server import ProxyServer
from areal_env.trainer.actor import PPOActor
from areal_env.trainer.data import DataLoader
from areal_env.trainer.dist import DistContext
from areal_env.trainer.eval import Evaluator
from areal_env.trainer.faults import FaultPlan
from areal_env.trainer.stats import MetricsLogger
from areal_env.trainer.token_record import TokenLog


class TrainerState:
    """The trainer's state (set by ``PPOTrainer.__init__``) and its small accessors."""

    config: ExperimentConfig
    external: bool
    data: DataLoader | None
    valid_items: list[dict[str, Any]] | None
    run_dir: Path
    checkpoint_failures: int
    ckpt_root: Path
    engine: InferenceEngine | None
    _own_engine: bool
    proxy: ProxyServer | None
    actor: PPOActor | None
    tokenizer: Any
    source: BatchSource | None
    evaluator: Evaluator | None
    metrics: MetricsLogger | None
    token_log: TokenLog | None
    step: int
    version: int
    saved_step: int
    redraws_used: int
    last_metrics: dict[str, Any]
    _data_state: dict[str, Any] | None
    _closed: bool
    dist: DistContext
    last_push_bytes: int
    on_checkpoint: Callable[[int, Path], None] | None
    _nccl_sync: Any
    _fault: FaultPlan | None

    @property
    def total_steps(self) -> int | None:
        """Steps to train; ``None`` only with an external source and no ``total_train_steps``
        (train until the source is closed)."""
        t = self.config.trainer
        if t.total_train_steps is not None:
            return t.total_train_steps
        if self.data is None:
            return None
        return t.total_train_epochs * len(self.data)

    @property
    def _engine(self) -> InferenceEngine:
        if self.engine is None:
            raise RuntimeError("the trainer has no engine (closed, or not set up)")
        return self.engine

    @property
    def _actor(self) -> PPOActor:
        if self.actor is None:
            raise RuntimeError("the trainer has no actor (not set up)")
        return self.actor

    def _command(self, cmd: dict[str, Any]) -> None:
        """Rank 0 tells the other ranks which collective comes next (no-op on one rank)."""
        from areal_env.trainer.dist import broadcast_object

        if self.dist.distributed and self.dist.is_main:
            broadcast_object(cmd, self.dist)

    def _receive(self) -> dict[str, Any]:
        from areal_env.trainer.dist import broadcast_object

        return broadcast_object(None, self.dist)
