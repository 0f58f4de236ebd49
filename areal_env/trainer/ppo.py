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

This module holds the loop and its steps; the rest of the class lives in its bases, one job
each: ``ppo_setup`` (models, proxy, source, evaluator) < ``ppo_bookkeeping`` (checkpoint,
resume, dumps, metrics) < ``ppo_push`` (ranks, weight push) < ``ppo_state`` (the attributes).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from areal_env.api.config import ExperimentConfig
from areal_env.api.config_load import validate_config
from areal_env.api.engine import InferenceEngine
from areal_env.api.source import BatchSource, SourceClosedError, TensorBatch
from areal_env.proxy.server import ProxyServer
from areal_env.trainer import memory
from areal_env.trainer.actor import PPOActor
from areal_env.trainer.data import DataLoader, load_items
from areal_env.trainer.dist import SINGLE
from areal_env.trainer.eval import Evaluator
from areal_env.trainer.faults import fault_from_env, kill_now
from areal_env.trainer.feed import DatasetSource
from areal_env.trainer.ppo_setup import TrainerSetup
from areal_env.trainer.stats import MetricsLogger, Progress
from areal_env.trainer.token_record import TokenLog

logger = logging.getLogger(__name__)


class PPOTrainer(TrainerSetup):
    """Trains ``config.model`` with PPO/GRPO on episodes of an agent workflow.

    ``with PPOTrainer(cfg, dataset) as t: t.train(workflow="my_agent.py:Agent")``. The dataset is
    a list of dicts, a JSONL path or a ``datasets.Dataset`` (default: ``cfg.train_dataset``).

    ``source``: a :class:`~areal_env.api.source.BatchSource` to train on; then no dataset or
    workflow is used and training runs to ``trainer.total_train_steps`` (``None``: until the
    source is closed). ``engine``: an initialized engine to
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
        on_checkpoint: Callable[[int, Path], None] | None = None,
    ) -> None:
        validate_config(config)
        memory.tune_allocator()  # before the models load: see memory.tune_allocator
        self.config = config
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
        self.token_log: TokenLog | None = None  # rollout.dump_to_file: per-token update record
        self.step = 0
        self.version = 0
        self.saved_step = 0
        self.redraws_used = 0
        """Batches without signal replaced so far (``trainer.redraw_batches_without_signal``)."""
        self.last_metrics: dict[str, Any] = {}
        self._data_state: dict[str, Any] | None = None
        self._closed = False
        self.dist = SINGLE
        self.last_push_bytes = 0
        self.on_checkpoint = on_checkpoint
        self._nccl_sync: Any = None  # NcclWeightSync, made on the first NCCL push
        self._fault = fault_from_env()  # AREAL_ENV_FAULT (hardening tests); None when unset

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
        if self.token_log is not None:
            self.token_log.close()
        if self.dist.distributed:
            from areal_env.trainer.dist import destroy

            destroy()

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
                done = await self._fetch_and_update(source)
                if done is None:  # the source was closed: keep what was trained
                    if self.step > self.saved_step:
                        await asyncio.to_thread(self._save_checkpoint)
                    break
                metrics, records, dumped_version = done
                if metrics.get("actor/updated"):
                    metrics.update(await self._push_new_weights(source))
                elif isinstance(source, DatasetSource):
                    source.skip_step()  # the version stays; the staleness bound moves on
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

    async def _fetch_and_update(
        self, source: BatchSource
    ) -> tuple[dict[str, Any], list[dict[str, Any]], int] | None:
        """Steps 1-2: a batch, then the update on it; a batch without signal is replaced by a
        fresh one while ``trainer.redraw_batches_without_signal`` allows (its episodes are
        dumped under this step all the same). ``(metrics, records, their version)``, or
        ``None`` once the source is closed."""
        redrawn, rollout_s = 0, 0.0
        while True:
            fetched = await self._fetch_batch(source)
            if fetched is None:
                return None
            batch, metrics = fetched
            if self._fault is not None and self._fault.should_kill_before_update(self.step + 1):
                kill_now(f"step {self.step + 1}: batch fetched, update not started")
            records, dumped_version = list(source.last_episodes), self.version
            metrics.update(await self._update(batch))
            if self.token_log is not None:
                self.token_log.commit(self.step + 1, dumped_version, records)
            rollout_s += metrics["time/rollout_s"]
            no_signal = not metrics.get("actor/updated") and not metrics.get("empty_batch")
            budget = self.config.trainer.redraw_batches_without_signal
            if not (no_signal and self.redraws_used < budget and isinstance(source, DatasetSource)):
                metrics["rollout/redrawn"] = float(redrawn)
                metrics["time/rollout_s"] = rollout_s
                return metrics, records, dumped_version
            self.redraws_used += 1
            redrawn += 1
            logger.info(
                "step %d: no episode's advantage is non-zero (reward mean %.3f); drawing "
                "another batch (%d of trainer.redraw_batches_without_signal=%d used)",
                self.step + 1,
                float(metrics.get("reward/mean", 0.0)),
                self.redraws_used,
                budget,
            )
            source.skip_step()  # that batch is consumed without an update
            self._dump(records, dumped_version, self.step + 1)

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
        # The update's freed activations are still in the heap: give them back first, or the
        # evaluation's KV cache comes on top of them (the demo's last step, the one with an
        # evaluation, peaked 0.6 GB above the others).
        memory.release_free_memory()
        result = await self.evaluator.evaluate(version=self.version, step=self.step)
        return {f"eval/{k}": v for k, v in result.metrics.items()}

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
