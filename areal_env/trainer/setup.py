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
from areal_env.proxy.client import grant_capacity
from areal_env.proxy.server import ProxyServer
from areal_env.trainer.actor import PPOActor
from areal_env.trainer.data import DataLoader, load_items
from areal_env.trainer.dist import SINGLE, DistContext, init_distributed
from areal_env.trainer.eval import Evaluator
from areal_env.trainer.feed import DatasetSource
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
    actor: they neither generate nor serve (``engine`` is None there)."""

    actor: PPOActor
    tokenizer: Any
    engine: InferenceEngine | None
    own_engine: bool
    """The engine was made here (and is destroyed with the trainer), not passed in."""


def build_models(
    config: ExperimentConfig, dist: DistContext, engine: InferenceEngine | None
) -> Models:
    """The engine (its own model copy; made unless passed in) and the trainer's actor."""
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
    )
    return Models(actor, tokenizer, engine if dist.is_main else None, own_engine)


def start_proxy(config: ExperimentConfig, engine: InferenceEngine, tokenizer: Any) -> ProxyServer:
    """The trainer's own proxy. Sessions start only when the executor grants them (its
    staleness control), unless ``proxy.initial_capacity`` says otherwise."""
    pcfg = config.proxy
    if pcfg.initial_capacity is None:
        pcfg = dataclasses.replace(pcfg, initial_capacity=0)
    proxy = ProxyServer(engine, tokenizer, pcfg, train_gconfig=config.gconfig).start()
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
