"""``PPOTrainer``: rollouts through the proxy → PPO update → weight push → version bump.

One training step:
1. take ``rollout.batch_size`` items from the dataset (shuffled with ``seed``, position saved);
2. ``RolloutExecutor.rollout_batch`` runs ``n_samples`` episodes per item through the proxy
   (or, with ``rollout.max_head_offpolicyness > 0``, the next batch is already rolling out
   while this one trains);
3. ``PPOActor.update`` in a worker thread (the event loop — proxy sessions, prefetching — stays
   responsive);
4. push the new weights to the engine (in-process state dict, or an HF folder under
   ``run_dir/weights/v{N}`` for engines that load from disk) and bump the version everywhere;
5. metrics, trajectory dumps, reward plot, and a checkpoint every ``trainer.save_freq_steps``.

A batch where every episode was rejected skips the update (logged as ``update_skipped``) and
training goes on. The trainer's model copy is separate from the engine's.

Batches come from a :class:`~areal_env.api.source.BatchSource`: by default a
``DatasetSource`` (dataset + workflow + ``RolloutExecutor`` through the trainer's own proxy);
``PPOTrainer(cfg, source=src, engine=engine)`` takes them from any other source (e.g. the
any-agent service's ``ExternalTrajectorySource``): no data loader, no proxy or executor of its
own. Everything else — recover, metrics, dumps, plot, checkpoints — is the same loop. A
passed-in engine is pushed to but never destroyed (its owner does that).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from areal_env.api.config import ExperimentConfig, validate_config
from areal_env.api.engine import InferenceEngine
from areal_env.api.source import BatchSource, SourceClosedError, TensorBatch
from areal_env.engine.factory import create_engine
from areal_env.engine.models import resolve_model_path
from areal_env.proxy.client import grant_capacity
from areal_env.proxy.server import ProxyServer
from areal_env.trainer import checkpoint as ckpt
from areal_env.trainer import memory
from areal_env.trainer.actor import PPOActor
from areal_env.trainer.data import DataLoader, load_items
from areal_env.trainer.dist import SINGLE
from areal_env.trainer.eval import (
    Evaluator,
    paired_p_value,
    read_eval_log,
    read_eval_summary,
    truncate_eval_log,
)
from areal_env.trainer.faults import fault_from_env, kill_now
from areal_env.trainer.feed import DatasetSource
from areal_env.trainer.stats import (
    MetricsLogger,
    Progress,
    dump_lines,
    dump_records,
    plot_reward_curve,
)
from areal_env.workflow.executor import RolloutExecutor
from areal_env.workflow.resolve import resolve_workflow

logger = logging.getLogger(__name__)


class PPOTrainer:
    """Trains ``config.model`` with PPO/GRPO on episodes of an agent workflow.

    ``with PPOTrainer(cfg, dataset) as t: t.train(workflow="my_agent.py:Agent")``. The dataset is
    a list of dicts, a JSONL path or a ``datasets.Dataset`` (default: ``cfg.train_dataset``).

    ``source``: a :class:`~areal_env.api.source.BatchSource` to train on; then no dataset or
    workflow is used and training runs to ``trainer.total_train_steps`` (``None``: until the
    source is closed). ``executor`` is its former name. ``engine``: an initialized engine to
    generate with and push weights to; the caller keeps ownership. ``on_checkpoint(step,
    path)``: called (rank 0) after each checkpoint is written, e.g. to mark the trajectories
    trained so far as durable (``areal-env serve-training`` commits its store there).
    """

    def __init__(
        self,
        config: ExperimentConfig,
        train_dataset: Any = None,
        valid_dataset: Any = None,
        *,
        source: BatchSource | None = None,
        engine: InferenceEngine | None = None,
        executor: BatchSource | None = None,
        on_checkpoint: Callable[[int, Path], None] | None = None,
    ) -> None:
        validate_config(config)
        memory.tune_allocator()  # before the models load: see memory.tune_allocator
        self.config = config
        source = source if source is not None else executor
        self.external = source is not None
        self.data: DataLoader | None = None
        if not self.external:
            dataset = train_dataset if train_dataset is not None else config.train_dataset
            self.data = DataLoader(dataset, config.rollout.batch_size, seed=config.seed)
        elif train_dataset is not None:
            raise ValueError("pass either a train_dataset or an external source, not both")
        self.valid_items: list[dict[str, Any]] | None = None
        valid = valid_dataset if valid_dataset is not None else config.valid_dataset
        if valid is not None:
            self.valid_items = list(load_items(valid))
        self.run_dir = Path(config.run_dir)
        self.checkpoint_failures = 0
        self.ckpt_root = self.run_dir / "checkpoints"
        self.engine: InferenceEngine | None = engine
        self._own_engine = engine is None
        self.proxy: ProxyServer | None = None
        self.actor: PPOActor | None = None
        self.tokenizer: Any = None
        self.source: BatchSource | None = source
        self.evaluator: Evaluator | None = None
        self.metrics: MetricsLogger | None = None
        self.step = 0
        self.version = 0
        self.saved_step = 0
        self.last_metrics: dict[str, Any] = {}
        self._data_state: dict[str, Any] | None = None
        self._closed = False
        self.dist = SINGLE
        self.last_push_bytes = 0
        self.on_checkpoint = on_checkpoint
        self._nccl_sync: Any = None  # NcclWeightSync, made on the first NCCL push
        self._fault = fault_from_env()  # AREAL_ENV_FAULT (hardening tests); None when unset

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> PPOTrainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop the proxy and the engine (idempotent); a passed-in engine is left running."""
        if self._closed:
            return
        self._closed = True
        if self.proxy is not None:
            try:
                self.proxy.stop()
            except Exception as e:
                logger.warning("stopping the proxy failed: %s", e)
            self.proxy = None
        if self.engine is not None and self._own_engine:
            try:
                self.engine.destroy()
            except Exception as e:
                logger.warning("destroying the engine failed: %s", e)
            self.engine = None
        if self.metrics is not None:
            self.metrics.close()
        if self.dist.distributed:
            from areal_env.trainer.dist import destroy

            destroy()

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

    # -- training ---------------------------------------------------------------------------

    def train(
        self,
        workflow: Any = None,
        workflow_kwargs: dict[str, Any] | None = None,
        eval_workflow: Any = None,
    ) -> dict[str, Any]:
        """Run training to ``total_steps``; return the final metrics.

        Works with or without a running event loop (inside one, training runs on a helper
        thread with its own loop).
        """
        coro_args = (workflow, workflow_kwargs, eval_workflow)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.atrain(*coro_args))
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["out"] = asyncio.run(self.atrain(*coro_args))
            except BaseException as e:  # re-raised in the caller's thread
                box["err"] = e

        th = threading.Thread(target=run, name="areal-env-trainer")
        th.start()
        th.join()
        if "err" in box:
            raise box["err"]
        return box["out"]

    async def atrain(
        self,
        workflow: Any = None,
        workflow_kwargs: dict[str, Any] | None = None,
        eval_workflow: Any = None,
    ) -> dict[str, Any]:
        """The training loop (async form of ``train``): one named step after another."""
        self._seed_everything(self.config.seed)
        self._join_process_group()
        if not self.dist.is_main:
            # Rollout runs once, on rank 0; this rank only trains on the rows it is sent.
            return await asyncio.to_thread(self._follow)
        source = await self._setup(workflow, workflow_kwargs, eval_workflow)
        total = self.total_steps
        progress = Progress(total, initial=self.step, enabled=self.config.trainer.progress)  # type: ignore[arg-type]
        logger.info(
            "training %s steps (from step %d, version %d); run dir %s",
            total if total is not None else "unlimited",
            self.step,
            self.version,
            self.run_dir,
        )
        try:
            if self.evaluator is not None and self.config.trainer.eval_before_training:
                if self.step == 0:
                    await self._run_evaluation()
            while total is None or self.step < total:
                t_step = time.perf_counter()
                memory.release_free_memory()
                memory.reset_peak()
                fetched = await self._fetch_batch(source)
                if fetched is None:  # the source was closed: keep what was trained
                    if self.step > self.saved_step:
                        await asyncio.to_thread(self._save_checkpoint)
                    break
                batch, metrics = fetched
                if self._fault is not None and self._fault.should_kill_before_update(self.step + 1):
                    kill_now(f"step {self.step + 1}: batch fetched, update not started")
                records, dumped_version = list(source.last_episodes), self.version
                metrics.update(await self._update(batch))
                if metrics.get("actor/updated"):
                    metrics.update(await self._push_new_weights(source))
                self._dump(records, dumped_version, self.step + 1)
                self.step += 1
                if isinstance(source, DatasetSource):
                    self._data_state = source.data_state
                metrics.update(await self.evaluate(total))
                self._log(metrics, t_step, progress)
                await self._checkpoint(total)
        finally:
            progress.close()
            self._command({"op": "stop"})
            await source.aclose()
            if self.evaluator is not None:
                await self.evaluator.aclose()
        return self._final_metrics()

    # -- the steps ----------------------------------------------------------------------------

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
        truncate_eval_log(self.run_dir, self.step if restored else -1)
        self.saved_step = self.step
        if self.source is None:
            self.source = await self._dataset_source(wf_spec, wf_kwargs)
        if self.valid_items and not self.external:
            spec = eval_workflow if eval_workflow is not None else wf_spec
            self.evaluator = self._make_evaluator(spec, wf_kwargs)
        self.source.set_version(self.version)
        return self.source

    async def _fetch_batch(
        self, source: BatchSource
    ) -> tuple[TensorBatch | None, dict[str, Any]] | None:
        """Step 1: the next batch and its rollout stats; ``None`` once the source is closed."""
        t0 = time.perf_counter()
        try:
            batch, stats = await source.next_batch(
                trainer_version=self.version, batch_size=self.config.rollout.batch_size
            )
        except SourceClosedError:
            logger.info("the batch source was closed: training stops at step %d", self.step)
            return None
        metrics: dict[str, Any] = dict(stats)
        metrics["time/rollout_s"] = time.perf_counter() - t0
        metrics["mem/rollout_peak_rss_gb"] = memory.peak_rss_gb()
        return batch, metrics

    async def _update(self, batch: TensorBatch | None) -> dict[str, Any]:
        """Step 2: one PPO update (skipped when every episode was rejected)."""
        if batch is None or int(batch["loss_mask"].sum()) == 0:
            logger.warning("step %d: every episode was rejected; update skipped", self.step)
            return {"actor/update_skipped": 1.0, "empty_batch": 1.0, "actor/updated": 0.0}
        ustats = await asyncio.to_thread(self._update_all_ranks, batch)
        return {
            **ustats,
            "empty_batch": 0.0,
            "actor/updated": float(not ustats.get("actor/update_skipped")),
        }

    async def _push_new_weights(self, source: BatchSource) -> dict[str, float]:
        """Step 3: the new weights to the engine; the version moves on everywhere."""
        t0 = time.perf_counter()
        await asyncio.to_thread(self._push_weights, self.version + 1)
        self.version += 1
        source.set_version(self.version)
        return {"time/weight_push_s": time.perf_counter() - t0}

    def _dump(self, records: list[dict[str, Any]], version: int, step: int) -> None:
        """Step 4: the step's trajectories into rollout/{version}/{task}.jsonl."""
        if not (self.config.rollout.dump_to_file and records):
            return
        try:
            dump_records(self.run_dir / "rollout", dump_lines(records, version, step))
        except OSError as e:  # a full disk must not stop training
            logger.warning("trajectory dump failed: %s", e)

    async def evaluate(self, total: int | None = None) -> dict[str, float]:
        """Step 5: held-out evaluation (greedy, ``is_eval``) every ``trainer.eval_freq_steps``
        and after the last step; ``eval/*`` metrics (see ``areal_env.trainer.eval``)."""
        freq = self.config.trainer.eval_freq_steps
        if self.evaluator is None:
            return {}
        if not (self.step == total or (freq and self.step % freq == 0)):
            return {}
        return await self._run_evaluation()

    async def _run_evaluation(self) -> dict[str, float]:
        assert self.evaluator is not None
        result = await self.evaluator.evaluate(version=self.version, step=self.step)
        return {f"eval/{k}": v for k, v in result.metrics.items()}

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

    def _log(self, metrics: dict[str, Any], t_step: float, progress: Progress) -> None:
        """Step 6: metrics (JSONL, TensorBoard), progress line and reward plot."""
        assert self.metrics is not None
        step_s = time.perf_counter() - t_step
        metrics["time/step_s"] = step_s
        # the update resets the high-water mark for its own figure: take the max
        metrics["mem/peak_rss_gb"] = max(
            metrics["mem/rollout_peak_rss_gb"],
            float(metrics.get("mem/update_peak_rss_gb", 0.0)),
            memory.peak_rss_gb(),
        )
        metrics["version"] = self.version
        if self._data_state is not None:
            metrics["data/epoch"] = self._data_state["epoch"]
            metrics["data/batch_index"] = self._data_state["batch_index"]
        if metrics.get("tokens/total"):
            metrics["perf/tokens_per_s"] = metrics["tokens/total"] / step_s
        self.metrics.log(self.step, metrics)
        self.last_metrics = {"step": self.step, **metrics}
        progress.update(self.step, metrics)
        plot_reward_curve(
            self.metrics.read(),
            self.run_dir / "reward_curve.png",
            evals=read_eval_log(self.run_dir),
        )

    async def _checkpoint(self, total: int | None) -> None:
        """Step 7: a checkpoint every ``trainer.save_freq_steps`` and at the last step."""
        freq = self.config.trainer.save_freq_steps
        if self.step == total or (freq and self.step % freq == 0):
            try:
                await asyncio.to_thread(self._save_checkpoint)
                self.saved_step = self.step
            except ckpt.CheckpointWriteError as e:
                if self.step == total:
                    raise  # the run's last weights: never end as if they were saved
                # a full disk mid-run: the previous checkpoint stays the latest, and losing one
                # checkpoint is better than losing the run
                self.checkpoint_failures += 1
                logger.error("%s; training goes on and retries at the next save", e)

    def _final_metrics(self) -> dict[str, Any]:
        assert self.metrics is not None
        records = self.metrics.read()
        evals = read_eval_log(self.run_dir)
        plot = plot_reward_curve(records, self.run_dir / "reward_curve.png", evals=evals)
        final = dict(self.last_metrics)
        if evals:
            final["eval/first"], final["eval/last"] = evals[0], evals[-1]
            before = read_eval_summary(self.run_dir, int(evals[0]["version"]))
            after = read_eval_summary(self.run_dir, int(evals[-1]["version"]))
            if before is not None and after is not None and len(evals) > 1:
                final["eval/p_value"] = paired_p_value(before.outcomes, after.outcomes)
        rewards = [r["reward/mean"] for r in records if r.get("reward/mean") is not None]
        if rewards:
            k = max(1, min(3, len(rewards) // 2))
            final["reward/first_steps_mean"] = sum(rewards[:k]) / k
            final["reward/last_steps_mean"] = sum(rewards[-k:]) / k
        final.update(
            {
                "run_dir": str(self.run_dir),
                "metrics_file": str(self.metrics.path),
                "reward_plot": str(plot) if plot else None,
                "dump_dir": str(self.run_dir / "rollout"),
                "eval_dir": str(self.run_dir / "eval-rollout") if evals else None,
                "checkpoint": str(ckpt.latest_checkpoint(self.ckpt_root) or ""),
            }
        )
        return final

    # -- pieces -----------------------------------------------------------------------------

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

    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % (2**32))
        torch.manual_seed(seed)

    def _join_process_group(self) -> None:
        """Under torchrun with ``actor.strategy: fsdp``: join the ranks' process group."""
        from areal_env.trainer.dist import init_distributed

        self.dist = SINGLE
        if self.config.actor.strategy == "fsdp":
            self.dist = init_distributed(self.config.model.device)
            if self.dist.distributed and self.external:
                raise ValueError(
                    "an external batch source runs in one process: use actor.strategy single, "
                    "or run the service's trainer under torchrun without an external executor"
                )

    def _command(self, cmd: dict[str, Any]) -> None:
        """Rank 0 tells the other ranks which collective comes next (no-op on one rank)."""
        from areal_env.trainer.dist import broadcast_object

        if self.dist.distributed and self.dist.is_main:
            broadcast_object(cmd, self.dist)

    def _update_all_ranks(self, batch: dict[str, Any]) -> dict[str, float]:
        """The PPO update; every rank gets the batch and trains on its token-balanced share."""
        self._command({"op": "update", "batch": batch, "step": self.step})
        return self._actor.update(batch, step=self.step)

    def _follow(self) -> dict[str, Any]:
        """A rank other than 0: build the sharded actor, restore, then run the collectives rank
        0 announces (update, weight gather, checkpoint) until it says stop."""
        self._setup_models()
        self._maybe_recover()
        ops = 0
        while True:
            cmd = self._receive()
            op = cmd["op"]
            if op == "stop":
                break
            if op == "update":
                self.step = int(cmd["step"])
                self._actor.update(cmd["batch"], step=self.step)
            elif op == "push":
                self._gather_for_push(cmd["what"])
            elif op == "save":
                self.step = int(cmd["step"])
                self._save_checkpoint()
            else:  # pragma: no cover - both sides ship together
                raise RuntimeError(f"rank {self.dist.rank}: unknown command {op!r}")
            ops += 1
        logger.info("rank %d: rank 0 finished; %d collective steps done", self.dist.rank, ops)
        return {"rank": self.dist.rank, "collective_ops": ops}

    def _receive(self) -> dict[str, Any]:
        from areal_env.trainer.dist import broadcast_object

        return broadcast_object(None, self.dist)

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

    def _maybe_recover(self) -> bool:
        """``trainer.recover: auto``: restore the latest checkpoint and push it to the engine."""
        if self.config.trainer.recover != "auto":
            return False
        found = ckpt.latest_checkpoint(self.ckpt_root)
        if found is None:
            return False
        actor = self._actor
        state = ckpt.restore_checkpoint(found, model=actor.model, optimizer=actor.optimizer)
        self.step = int(state["step"])
        self.version = int(state.get("version", self.step))
        if self.data is not None and state.get("data") is not None:
            self.data.load_state_dict(state["data"])
        actor.update_count = int(state.get("update_count", self.step))
        if self.version > 0 and self.dist.is_main:
            self._push_weights(self.version)
        position = (
            f"data position epoch {self.data.epoch} batch {self.data.batch_index}"
            if self.data is not None
            else "external batch source"
        )
        logger.info(
            "recovered from %s: step %d, version %d, %s", found, self.step, self.version, position
        )
        return True

    def _drop_stale_dumps(self, keep_step: int) -> None:
        """Dump lines of steps after the restored one (or all, on a fresh start) belong to steps
        that will be redone: remove them so they are not written twice. Filtered by step, not by
        version: a step whose update was skipped leaves the version where it was."""
        root = self.run_dir / "rollout"
        if not root.is_dir():
            return
        for f in root.rglob("*.jsonl"):
            lines = f.read_text().splitlines()
            kept = [x for x in lines if int(json.loads(x).get("step", 0)) <= keep_step]
            if len(kept) == len(lines):
                continue
            if kept:
                f.write_text("\n".join(kept) + "\n")
            else:
                f.unlink()

    def _start_proxy(self) -> None:
        pcfg = self.config.proxy
        if pcfg.initial_capacity is None:
            # Sessions start only when the executor grants them (its staleness control).
            pcfg = dataclasses.replace(pcfg, initial_capacity=0)
        self.proxy = ProxyServer(
            self._engine, self.tokenizer, pcfg, train_gconfig=self.config.gconfig
        ).start()
        logger.info("proxy listening at %s", self.proxy.base_url)

    def _push_weights(self, new_version: int) -> None:
        """Gather the weights once and load them on every inference server.

        In-process engines take the state dict; server engines load one HF folder written once
        under ``run_dir/weights/v{N}`` (with LoRA only the adapter when the engine takes
        adapters). A server that fails to load is reported by address and the step fails."""
        engine = self._engine
        lora = self.config.actor.lora is not None and engine.supports_lora
        in_process = engine.supports_state_dict_update
        what = "full" if in_process else ("adapter" if lora else "hf")
        sg = self.config.engine.sglang
        if not in_process and self.config.engine.backend == "sglang" and sg.weight_sync == "nccl":
            self._command({"op": "push", "what": "full"})  # the others only gather
            self._push_nccl(self._gather_for_push("full"), new_version)
            return
        self._command({"op": "push", "what": what})
        if in_process:
            engine.update_weights(self._gather_for_push(what))
        else:
            folder = self.run_dir / "weights" / f"v{new_version}"
            if folder.exists():
                shutil.rmtree(folder)
            self.last_push_bytes = self._gather_for_push(what, folder)
            if not lora:
                self.tokenizer.save_pretrained(str(folder))
            engine.update_weights(str(folder))
            for old in (self.run_dir / "weights").glob("v*"):
                if old != folder:
                    shutil.rmtree(old, ignore_errors=True)
        engine.set_version(new_version)

    def _push_nccl(self, weights: dict[str, Any], new_version: int) -> None:
        """SGLang's tensor path (``engine.sglang.weight_sync: nccl``; GPU only, unverified here)."""
        from areal_env.engine.sglang_nccl import NcclWeightSync

        sync = self._nccl_sync
        if sync is None:
            import socket

            sg = self.config.engine.sglang
            sync = self._nccl_sync = NcclWeightSync(
                self._engine,
                master_address=socket.gethostbyname(socket.gethostname()),
                master_port=sg.weight_sync_port,
                tp_size=sg.tp_size,
            )
        device = self._actor.device
        self._engine.pause()
        try:
            sync.push(((k, v.to(device)) for k, v in weights.items()), new_version)
        finally:
            self._engine.resume()
        self._engine.set_version(new_version)

    def _gather_for_push(self, what: str, folder: Path | None = None) -> Any:
        """The collective half of a push: every rank runs it, rank 0 gets (or writes) the
        weights; the other ranks write nothing."""
        if what == "full":
            return self._actor.state_dict_for_engine()
        target = folder or self.run_dir / "weights" / "unused"
        if what == "adapter":
            return self._actor.save_adapter(target)
        return self._actor.export_hf(target)

    def _save_checkpoint(self) -> Path:
        self._command({"op": "save", "step": self.step})
        actor = self._actor
        data_state = self._data_state
        if data_state is None and self.data is not None:
            data_state = self.data.state_dict()
        state = {
            "version": self.version,
            "epoch": data_state["epoch"] if data_state else 0,
            "data": data_state,
            "update_count": actor.update_count,
            "experiment_name": self.config.experiment_name,
            "trial_name": self.config.trial_name,
            "model_path": actor.model_path,
        }
        path = ckpt.save_checkpoint(
            self.ckpt_root,
            self.step,
            model=actor.model,
            tokenizer=self.tokenizer,
            optimizer=actor.optimizer,
            trainer_state=state,
            keep_last=self.config.trainer.keep_checkpoints,
            export_hf=actor.export_hf,
        )
        if self.on_checkpoint is not None and self.dist.is_main:
            self.on_checkpoint(self.step, path)
        return path
