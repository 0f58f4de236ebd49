"""``TrainerSetup``: building what a ``PPOTrainer`` trains with.

The engine and the trainer's own actor (rank 0; other ranks only their shard), recovery and
stale-output cleanup, the proxy, the default dataset source and the evaluator.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from typing import Any

import numpy as np
import torch

from areal_env.api.source import BatchSource
from areal_env.engine.factory import create_engine
from areal_env.engine.models import resolve_model_path
from areal_env.proxy.client import grant_capacity
from areal_env.proxy.server import ProxyServer
from areal_env.trainer.actor import PPOActor
from areal_env.trainer.eval import Evaluator, truncate_eval_log
from areal_env.trainer.feed import DatasetSource
from areal_env.trainer.ppo_bookkeeping import TrainerBookkeeping
from areal_env.trainer.stats import MetricsLogger, write_run_config
from areal_env.trainer.token_record import TokenLog
from areal_env.workflow.executor import RolloutExecutor
from areal_env.workflow.resolve import resolve_workflow

logger = logging.getLogger(__name__)


class TrainerSetup(TrainerBookkeeping):
    """Models, proxy, batch source and evaluator of a ``PPOTrainer``."""

    async def _setup(
        self, workflow: Any, workflow_kwargs: dict[str, Any] | None, eval_workflow: Any
    ) -> BatchSource:
        """Models, recovery, proxy and the batch source (built here unless passed in)."""
        cfg = self.config
        wf_spec = workflow if workflow is not None else cfg.workflow
        if self.external:
            if workflow is not None or eval_workflow is not None:
                raise ValueError("an external source brings its own batches: pass no workflow")
        elif wf_spec is None:
            raise ValueError(
                "no workflow: pass train(workflow=...) or set `workflow` in the config"
            )
        wf_kwargs = workflow_kwargs if workflow_kwargs is not None else dict(cfg.workflow_kwargs)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = MetricsLogger(self.run_dir, tensorboard=cfg.trainer.tensorboard)
        await asyncio.to_thread(self._setup_models)
        restored = await asyncio.to_thread(self._maybe_recover)
        if not restored and not self._own_engine:
            # A passed-in engine may already have moved on; its tokens carry that version.
            self.version = self._engine.get_version()
        self.metrics.truncate_after(self.step if restored else 0)
        self._drop_stale_dumps(self.step if restored else 0)
        write_run_config(self.run_dir, cfg)
        if cfg.rollout.dump_to_file:
            self.token_log = TokenLog(
                self.run_dir,
                cfg.actor,
                tokenizer=self.tokenizer,
                keep_step=self.step if restored else 0,
            )
            self._actor.trace = self.token_log.trace
        truncate_eval_log(self.run_dir, self.step if restored else -1)
        self.saved_step = self.step
        if self.source is None:
            self.source = await self._dataset_source(wf_spec, wf_kwargs)
        if self.valid_items and not self.external:
            spec = eval_workflow if eval_workflow is not None else wf_spec
            self.evaluator = self._make_evaluator(spec, wf_kwargs)
        self.source.set_version(self.version)
        return self.source

    def _setup_models(self) -> None:
        """Engine (its own model copy) + the trainer's actor. Ranks other than 0 build only
        their shard of the actor: they neither generate nor serve."""
        from transformers import AutoTokenizer

        cfg = self.config
        model_path = str(resolve_model_path(cfg.model.path, cfg.model.cache_dir))
        if not self.dist.is_main:
            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
            self.actor = PPOActor(
                model_path, cfg.actor, cfg.model, temperature=cfg.gconfig.temperature, seed=cfg.seed
            )
            return
        if self.engine is None:
            engine_cfg = cfg
            if cfg.model.path != model_path:
                engine_cfg = dataclasses.replace(
                    cfg, model=dataclasses.replace(cfg.model, path=model_path)
                )
            self.engine = create_engine(engine_cfg)
            self.engine.initialize()
        # Engines behind HTTP (SGLang) tokenize on their servers: load our own then.
        self.tokenizer = self.engine.tokenizer or AutoTokenizer.from_pretrained(model_path)
        self.actor = PPOActor(
            model_path,
            cfg.actor,
            cfg.model,
            temperature=cfg.gconfig.temperature,
            seed=cfg.seed,
        )

    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % (2**32))
        torch.manual_seed(seed)

    def _start_proxy(self) -> None:
        pcfg = self.config.proxy
        if pcfg.initial_capacity is None:
            # Sessions start only when the executor grants them (its staleness control).
            pcfg = dataclasses.replace(pcfg, initial_capacity=0)
        self.proxy = ProxyServer(
            self._engine, self.tokenizer, pcfg, train_gconfig=self.config.gconfig
        ).start()
        logger.info("proxy listening at %s", self.proxy.base_url)

    def _executor(self, spec: Any, kwargs: dict[str, Any], *, progress: bool) -> RolloutExecutor:
        """A ``RolloutExecutor`` running workflow ``spec`` through this trainer's proxy."""
        assert self.proxy is not None
        proxy = {"proxy_base_url": self.proxy.base_url, "admin_key": self.proxy.admin_key}
        wf = resolve_workflow(spec, kwargs, rollout=self.config.rollout, **proxy)
        return RolloutExecutor(
            self._engine, wf, self.config.rollout, show_progress=progress, **proxy
        )

    async def _dataset_source(self, spec: Any, kwargs: dict[str, Any]) -> DatasetSource:
        """The default source: dataset items rolled out through the trainer's own proxy."""
        assert self.data is not None
        self._start_proxy()
        executor = self._executor(spec, kwargs, progress=self.config.trainer.progress)
        if not executor.uses_proxy:
            # A workflow the executor does not grant sessions for still gets to use the proxy.
            assert self.proxy is not None
            await grant_capacity(self.proxy.base_url, self.proxy.admin_key, 1 << 30)
        total = self.total_steps
        return DatasetSource(
            self.data,
            executor,
            prefetch=self.config.rollout.max_head_offpolicyness > 0,
            batches=None if total is None else total - self.step,
        )

    def _make_evaluator(self, spec: Any, wf_kwargs: dict[str, Any]) -> Evaluator:
        """An evaluator of ``spec`` on the held-out items: one greedy episode per item."""
        assert self.proxy is not None
        cfg = self.config
        rollout = dataclasses.replace(cfg.rollout, n_samples=1)
        proxy = {"proxy_base_url": self.proxy.base_url, "admin_key": self.proxy.admin_key}
        workflow = resolve_workflow(spec, wf_kwargs, rollout=rollout, **proxy)
        return Evaluator(
            self._engine,
            workflow,
            list(self.valid_items or []),
            rollout,
            self.run_dir,
            success_reward=cfg.trainer.eval_success_reward,
            show_progress=cfg.trainer.progress,
            **proxy,
        )
