"""The trainer's policies: each one's actor, weight pusher and (rank 0) the engine serving it.

A run without ``policies:`` has one policy, named ``None``: the base model, trained and pushed
exactly as before there were policies (its metrics, checkpoints and weights keep their places).
A multi-agent run has one :class:`Policy` per entry of ``policies:``: LoRA policies share one
trainer copy of the base model with a named adapter each (``PPOActor(share=...)``), a policy
with a model of its own has its own copy; every policy has its own optimiser (its settings from
``ExperimentConfig.policy_actor``) and its own pusher, which pushes its weights alone.

This module also holds what a step does per policy: which rows are a policy's
(:func:`policy_groups`), how its metrics are named (:func:`metric_prefix`), and the checkpoint
parts of a multi-agent run (:func:`checkpoint_parts`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_env.api.config import ExperimentConfig, LoraConfig
from areal_env.api.engine import InferenceEngine
from areal_env.api.episode import Episode
from areal_env.engine.models import resolve_model_path
from areal_env.engine.policies import POLICIES_DIR, PolicyEngines
from areal_env.trainer.actor import PPOActor
from areal_env.trainer.checkpoint import CheckpointPart
from areal_env.trainer.push import WeightPusher
from areal_env.trainer.ranks import RankChannel

logger = logging.getLogger(__name__)


@dataclass
class Policy:
    """One trainable policy: what trains it, what pushes its weights, what serves it."""

    name: str | None
    """Its name in ``policies:`` (``None``: the run's only policy)."""
    actor: PPOActor
    pusher: WeightPusher
    tokenizer: Any
    engine: InferenceEngine | None
    """The engine that answers it (rank 0; ``None`` on the other ranks)."""
    adapter: bool = False
    """A LoRA adapter on the base model (else its own model, or the run's only one)."""

    @property
    def prefix(self) -> str:
        return metric_prefix(self.name)


def metric_prefix(name: str | None) -> str:
    """Metric names of a policy: ``policy/<name>/...`` (unprefixed for the only policy)."""
    return "" if name is None else f"policy/{name}/"


def build_policies(
    config: ExperimentConfig,
    ranks: RankChannel,
    engines: PolicyEngines | None,
) -> dict[str | None, Policy]:
    """The actors and pushers of ``config.policies`` (every rank; ``engines`` on rank 0)."""
    adapters: dict[str, LoraConfig] = {}
    for name, policy in config.policies.items():
        lora = config.policy_actor(name).lora
        if policy.is_adapter and lora is not None:
            adapters[name] = lora
    base_path = str(resolve_model_path(config.model.path, config.model.cache_dir))
    shared: PPOActor | None = None
    out: dict[str | None, Policy] = {}
    for name, policy in config.policies.items():
        acfg = config.policy_actor(name)
        if policy.is_adapter:
            actor = PPOActor(
                base_path,
                acfg,
                config.model,
                temperature=config.gconfig.temperature,
                seed=config.seed,
                adapter=name,
                adapters=adapters,
                share=shared,
                engine_dtype=config.engine.served_dtype(config.model),
            )
            shared = shared or actor
        else:
            assert policy.model is not None
            path = str(resolve_model_path(policy.model, config.model.cache_dir))
            actor = PPOActor(
                path,
                acfg,
                config.model,
                temperature=config.gconfig.temperature,
                seed=config.seed,
                engine_dtype=config.engine.served_dtype(config.model),
            )
        engine = engines.routes[name] if engines is not None else None
        tokenizer = engines.tokenizer(name) if engines is not None else _tokenizer(actor)
        pusher = WeightPusher(
            config,
            actor,
            ranks,
            engine=engine,
            tokenizer=tokenizer,
            policy=name,
            adapter=policy.is_adapter,
        )
        out[name] = Policy(name, actor, pusher, tokenizer, engine, adapter=policy.is_adapter)
        logger.info(
            "policy %s: %s, lr %g",
            name,
            "LoRA adapter on the base model" if policy.is_adapter else f"model {actor.model_path}",
            acfg.lr,
        )
    return out


def _tokenizer(actor: PPOActor) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(actor.model_path)


# -- a step, per policy -----------------------------------------------------------------------


def policy_groups(
    groups: Sequence[Sequence[Episode]], name: str | None
) -> list[list[Episode]] | None:
    """The batch's groups with only policy ``name``'s rows in each episode (episodes and groups
    without any dropped), for its own update: advantages are then normalised per task and
    policy. ``None`` when no row is that policy's."""
    out = []
    for group in groups:
        kept = []
        for episode in group:
            rows = [r for r in episode.rows if r.policy == name]
            if rows:
                kept.append(_with_rows(episode, rows))
        if kept:
            out.append(kept)
    return out or None


def _with_rows(episode: Episode, rows: list[Any]) -> Episode:
    from dataclasses import replace

    return replace(episode, rows=rows)


def unrouted_rows(groups: Sequence[Sequence[Episode]], names: Sequence[str | None]) -> int:
    """Rows whose policy the run does not train (none named, or a name not in ``policies:``):
    they are left out of every update, and counted."""
    known = set(names)
    return sum(1 for g in groups for e in g for r in e.rows if r.policy not in known)


def policy_rollout_stats(
    groups: Sequence[Sequence[Episode]], name: str, trainer_version: int
) -> dict[str, float]:
    """A policy's share of a batch: its rows, their mean reward (the reward each of its rows
    was given, discounted along the conversation), tokens and staleness."""
    rows = [r for g in groups for e in g for r in e.rows if r.policy == name]
    p = metric_prefix(name)
    if not rows:
        return {f"{p}rows": 0.0}
    versions = [v for r in rows for v in r.generated_versions()]
    return {
        f"{p}rows": float(len(rows)),
        f"{p}reward/mean": sum(r.reward for r in rows) / len(rows),
        f"{p}tokens/output": float(sum(r.num_trained for r in rows)),
        f"{p}staleness/max": float(trainer_version - min(versions)) if versions else 0.0,
    }


# -- checkpoints of a multi-agent run ------------------------------------------------------------


def checkpoint_parts(policies: Mapping[str | None, Policy]) -> list[CheckpointPart]:
    """One part per policy, under ``policies/<name>/``: a LoRA policy saves its adapter alone
    (state and a peft adapter folder), a model of its own the whole model."""
    parts = []
    for name, policy in policies.items():
        assert name is not None, "the run's only policy is saved as the checkpoint itself"
        actor = policy.actor
        parts.append(
            CheckpointPart(
                folder=f"{POLICIES_DIR}/{name}",
                model=actor.model,
                optimizer=actor.optimizer,
                export=_adapter_export(actor) if policy.adapter else actor.export_hf,
                tokenizer=None if policy.adapter else policy.tokenizer,
                trainable_only=policy.adapter,
                activate=actor.activate,
            )
        )
    return parts


def _adapter_export(actor: PPOActor) -> Any:
    def export(folder: Path) -> int:
        return actor.save_adapter(folder)

    return export


def policies_state(policies: Mapping[str | None, Policy]) -> dict[str, Any]:
    """What the trainer state records of each policy (``trainer_state.json``: ``policies``)."""
    return {
        str(name): {
            "kind": "adapter" if p.adapter else "model",
            "model_path": p.actor.model_path,
            "update_count": p.actor.update_count,
            "folder": f"{POLICIES_DIR}/{name}",
        }
        for name, p in policies.items()
    }
