"""Plain set-up functions of a training run: seeds, the process group, the models, the proxy,
the default batch source and the evaluator. ``PPOTrainer`` calls them in order and holds what
they return."""

from __future__ import annotations

import dataclasses
import logging
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from areal_env.api.config import ExperimentConfig
from areal_env.api.engine import InferenceEngine
from areal_env.engine.factory import create_engine
from areal_env.engine.models import resolve_model_path
from areal_env.engine.policies import PolicyEngines
from areal_env.proxy.client import grant_capacity
from areal_env.proxy.policies import PolicyEndpoint
from areal_env.proxy.server import ProxyServer
from areal_env.trainer.actor import PPOActor
from areal_env.trainer.data import DataLoader, load_items
from areal_env.trainer.dist import SINGLE, DistContext, init_distributed
from areal_env.trainer.eval import Evaluator
from areal_env.trainer.feed import DatasetSource
from areal_env.trainer.policies import Policy, build_policies
from areal_env.trainer.push import WeightPusher
from areal_env.trainer.ranks import RankChannel
from areal_env.workflow.executor import RolloutExecutor
from areal_env.workflow.resolve import resolve_workflow

logger = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def join_process_group(config: ExperimentConfig, *, external_source: bool) -> DistContext:
    """Under torchrun with ``actor.strategy: fsdp``: join the ranks' process group."""
    if config.actor.strategy != "fsdp":
        return SINGLE
    dist = init_distributed(config.model.device)
    if dist.distributed and external_source:
        raise ValueError(
            "an external batch source runs in one process: use actor.strategy single, or run "
            "the service's trainer under torchrun without an external source"
        )
    return dist


@dataclass
class Models:
    """What a rank trains and generates with. Ranks other than 0 hold only their shard of the
    actors: they neither generate nor serve (``engine`` is None there)."""

    policies: dict[str | None, Policy]
    """The policies, by name (``{None: ...}``: the run's only policy)."""
    tokenizer: Any
    """The base model's tokenizer."""
    engine: InferenceEngine | None
    """The base model's engine (with policies: the host of the adapter policies)."""
    own_engine: bool
    """The engine was made here (and is destroyed with the trainer), not passed in."""
    engines: PolicyEngines | None = None
    """With policies (rank 0): every policy's engine."""


def build_models(
    config: ExperimentConfig,
    dist: DistContext,
    engine: InferenceEngine | None,
    ranks: RankChannel,
    *,
    engines: PolicyEngines | None = None,
) -> Models:
    """The engine (its own model copy; made unless passed in) and the trainer's policies
    (``engines``: a multi-agent run's engines, initialized by their owner)."""
    if config.policies:
        return _build_policy_models(config, dist, engine, ranks, engines)
    from transformers import AutoTokenizer

    model_path = str(resolve_model_path(config.model.path, config.model.cache_dir))
    own_engine = False
    if dist.is_main and engine is None:
        engine_cfg = config
        if config.model.path != model_path:
            engine_cfg = dataclasses.replace(
                config, model=dataclasses.replace(config.model, path=model_path)
            )
        engine = create_engine(engine_cfg)
        engine.initialize()
        own_engine = True
    # Engines behind HTTP (SGLang) tokenize on their servers: load our own then.
    tokenizer = (engine.tokenizer if engine is not None else None) or (
        AutoTokenizer.from_pretrained(model_path)
    )
    actor = PPOActor(
        model_path,
        config.actor,
        config.model,
        temperature=config.gconfig.temperature,
        seed=config.seed,
        engine_dtype=config.engine.served_dtype(config.model),
    )
    engine = engine if dist.is_main else None
    pusher = WeightPusher(config, actor, ranks, engine=engine, tokenizer=tokenizer)
    only = Policy(None, actor, pusher, tokenizer, engine)
    return Models({None: only}, tokenizer, engine, own_engine)


def _build_policy_models(
    config: ExperimentConfig,
    dist: DistContext,
    engine: InferenceEngine | None,
    ranks: RankChannel,
    given: PolicyEngines | None,
) -> Models:
    """A multi-agent run: every policy's engine (rank 0) and actor."""
    engines = None
    if dist.is_main:
        engines = given
        if engines is None:
            engines = PolicyEngines.from_config(config, base=engine)
            engines.initialize()
    policies = build_policies(config, ranks, engines)
    first = next(iter(policies.values()))
    tokenizer = engines.base.tokenizer if engines is not None else None
    if tokenizer is None:
        from transformers import AutoTokenizer

        path = resolve_model_path(config.model.path, config.model.cache_dir)
        tokenizer = first.tokenizer if first.adapter else AutoTokenizer.from_pretrained(str(path))
    return Models(
        policies,
        tokenizer,
        engines.base if engines is not None else None,
        engines is not None and given is None and engines.own_base,
        engines,
    )


def start_proxy(
    config: ExperimentConfig,
    engine: InferenceEngine,
    tokenizer: Any,
    policies: dict[str | None, Policy] | None = None,
) -> ProxyServer:
    """The trainer's own proxy (routing by ``model`` to the policies of a multi-agent run).
    Sessions start only when the executor grants them (its staleness control), unless
    ``proxy.initial_capacity`` says otherwise."""
    pcfg = config.proxy
    if pcfg.initial_capacity is None:
        pcfg = dataclasses.replace(pcfg, initial_capacity=0)
    endpoints = None
    if config.policies and policies:
        endpoints = {
            name: PolicyEndpoint(p.engine, p.tokenizer)
            for name, p in policies.items()
            if name is not None and p.engine is not None
        }
    proxy = ProxyServer(
        engine, tokenizer, pcfg, train_gconfig=config.gconfig, policies=endpoints
    ).start()
    logger.info("proxy listening at %s", proxy.base_url)
    return proxy


def make_executor(
    config: ExperimentConfig,
    engine: InferenceEngine,
    proxy: ProxyServer,
    spec: Any,
    kwargs: dict[str, Any],
) -> RolloutExecutor:
    """A ``RolloutExecutor`` running workflow ``spec`` through ``proxy``."""
    addr = {"proxy_base_url": proxy.base_url, "admin_key": proxy.admin_key}
    workflow = resolve_workflow(spec, kwargs, rollout=config.rollout, **addr)
    return RolloutExecutor(
        engine, workflow, config.rollout, show_progress=config.trainer.progress, **addr
    )


async def dataset_source(
    config: ExperimentConfig,
    data: DataLoader,
    engine: InferenceEngine,
    proxy: ProxyServer,
    spec: Any,
    kwargs: dict[str, Any],
    *,
    batches: int | None,
) -> DatasetSource:
    """The default source: dataset items rolled out through the trainer's own proxy;
    ``batches``: how many will be asked for (``None``: no limit)."""
    executor = make_executor(config, engine, proxy, spec, kwargs)
    if not executor.uses_proxy:
        # A workflow the executor does not grant sessions for still gets to use the proxy.
        await grant_capacity(proxy.base_url, proxy.admin_key, 1 << 30)
    return DatasetSource(
        data,
        executor,
        prefetch=config.rollout.max_head_offpolicyness > 0,
        batches=batches,
    )


def make_evaluator(
    config: ExperimentConfig,
    engine: InferenceEngine,
    proxy: ProxyServer,
    spec: Any,
    kwargs: dict[str, Any],
    items: list[dict[str, Any]],
) -> Evaluator:
    """An evaluator of workflow ``spec`` on the held-out ``items`` (and the config's
    ``extra_valid_datasets``): one greedy episode each."""
    rollout = dataclasses.replace(config.rollout, n_samples=1)
    addr = {"proxy_base_url": proxy.base_url, "admin_key": proxy.admin_key}
    workflow = resolve_workflow(spec, kwargs, rollout=rollout, **addr)
    extra = {name: list(load_items(path)) for name, path in config.extra_valid_datasets.items()}
    return Evaluator(
        engine,
        workflow,
        items,
        rollout,
        config.run_dir,
        success_reward=config.trainer.eval_success_reward,
        show_progress=config.trainer.progress,
        extra_sets=extra,
        **addr,
    )
