"""``PPOTrainer``: rollouts through the proxy → PPO update → weight push → version bump.

One training step (``atrain`` reads top to bottom):
1. a batch of episodes from the :class:`~areal_env.api.source.BatchSource`, collated into
   tensors once (``workflow.batch.collate_groups``): by default a
   ``DatasetSource`` (``rollout.batch_size`` dataset items, ``n_samples`` episodes each, run by
   a ``RolloutExecutor`` through the trainer's own proxy; with
   ``rollout.max_head_offpolicyness > 0`` the next batch already rolls out while this one
   trains), or any other source passed in (e.g. the any-agent service's trajectories);
2. ``PPOActor.update`` in a worker thread (the event loop — proxy sessions, prefetching —
   stays responsive); a batch without signal may be redrawn
   (``trainer.redraw_batches_without_signal``);
3. the new weights to the engine (``WeightPusher``) and the version + 1 everywhere;
4. trajectory dumps, held-out evaluation, metrics and the reward plot, a checkpoint every
   ``trainer.save_freq_steps`` (``RunBooks``).

The trainer holds its parts as objects: its policies (``setup.build_models``; each an actor,
a weight pusher and the engine serving it: one, the base model, unless ``policies:`` names
several), the books and, under torchrun, the channel that tells the other ranks which
collective comes next. A passed-in engine is pushed to but never destroyed (its owner does
that).

With ``policies:`` (multi-agent RL) every step updates each policy on its own rows (its
advantages normalised per task among its rows) and pushes the weights of those it updated,
while every engine is paused, then moves all of them to the step's version: one clock for the
run, so staleness means the same for every policy.
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
from areal_env.api.episode import Episode
from areal_env.api.source import BatchSource, RolloutBatch, SourceClosedError
from areal_env.engine.policies import PolicyEngines
from areal_env.proxy.server import ProxyServer
from areal_env.trainer import memory
from areal_env.trainer.actor import PPOActor
from areal_env.trainer.books import RunBooks, RunPosition
from areal_env.trainer.data import DataLoader, load_items, make_loader
from areal_env.trainer.dist import SINGLE, DistContext
from areal_env.trainer.eval import Evaluator
from areal_env.trainer.faults import fault_from_env, kill_now
from areal_env.trainer.feed import DatasetSource
from areal_env.trainer.policies import (
    Policy,
    policy_groups,
    policy_rollout_stats,
    unrouted_rows,
)
from areal_env.trainer.ranks import RankChannel
from areal_env.trainer.setup import (
    build_models,
    dataset_source,
    join_process_group,
    make_evaluator,
    seed_everything,
    start_proxy,
)
from areal_env.trainer.stats import Progress, write_run_config
from areal_env.trainer.token_record import TokenLog
from areal_env.workflow.batch import collate_groups

logger = logging.getLogger(__name__)


class PPOTrainer:
    """Trains ``config.model`` with PPO/GRPO on episodes of an agent workflow.

    ``with PPOTrainer(cfg, dataset) as t: t.train(workflow="my_agent.py:Agent")``. The dataset is
    a list of dicts, a JSONL path or a ``datasets.Dataset`` (default: ``cfg.train_dataset``).

    ``source``: a :class:`~areal_env.api.source.BatchSource` to train on; then no dataset or
    workflow is used and training runs to ``trainer.total_train_steps`` (``None``: until the
    source is closed). ``engine``: an initialized engine to generate with and push weights to
    (with ``policies:``, an initialized ``PolicyEngines`` or the base engine to build one on);
    the caller keeps ownership. ``on_checkpoint(step, path)``: called (rank 0) after each
    checkpoint is written, e.g. to mark the trajectories trained so far as durable
    (``areal-env serve-training`` commits its store there).
    """

    def __init__(
        self,
        config: ExperimentConfig,
        train_dataset: Any = None,
        valid_dataset: Any = None,
        *,
        source: BatchSource | None = None,
        engine: InferenceEngine | PolicyEngines | None = None,
        on_checkpoint: Callable[[int, Path], None] | None = None,
    ) -> None:
        validate_config(config)
        # before the models load: see memory.tune_allocator
        memory.tune_allocator(int(config.trainer.malloc_mmap_threshold_mb * 2**20))
        self.config = config
        self.external = source is not None
        self.data: DataLoader | None = None
        if not self.external:
            dataset = train_dataset if train_dataset is not None else config.train_dataset
            self.data = make_loader(dataset, config.rollout, seed=config.seed)
        elif train_dataset is not None:
            raise ValueError("pass either a train_dataset or an external source, not both")
        valid = valid_dataset if valid_dataset is not None else config.valid_dataset
        self.valid_items = list(load_items(valid)) if valid is not None else None
        self.run_dir = Path(config.run_dir)
        self.position = RunPosition()
        self.dist: DistContext = SINGLE
        self.ranks = RankChannel(SINGLE)
        self.books = RunBooks(config, self.ranks, on_checkpoint=on_checkpoint)
        self.engines: PolicyEngines | None = None
        """With ``policies:`` (rank 0): every policy's engine (``engine`` is their base)."""
        self._given_engines: PolicyEngines | None = None
        if isinstance(engine, PolicyEngines):
            self._given_engines, engine = engine, engine.base
        self.engine: InferenceEngine | None = engine
        self._own_engine = False
        self.source: BatchSource | None = source
        # set up by atrain (rank 0 holds them all; other ranks only the actors)
        self.policies: dict[str | None, Policy] = {}
        """By name; ``{None: ...}``: the run's only policy (no ``policies:``)."""
        self.tokenizer: Any = None
        self.proxy: ProxyServer | None = None
        self.evaluator: Evaluator | None = None
        self.token_log: TokenLog | None = None  # rollout.dump_to_file: what each update did
        self._fault = fault_from_env()  # AREAL_ENV_FAULT (hardening tests); None when unset
        self._closed = False

    # -- where the run stands -------------------------------------------------------------

    @property
    def step(self) -> int:
        return self.position.step

    @property
    def version(self) -> int:
        return self.position.version

    @property
    def redraws_used(self) -> int:
        return self.position.redraws_used

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

    # -- life cycle -----------------------------------------------------------------------

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
        if self.engines is not None and self.engines is not self._given_engines:
            try:
                self.engines.destroy()  # the policies' own engines, and the base if made here
            except Exception as e:
                logger.warning("destroying the engines failed: %s", e)
            self.engines = self.engine = None
        if self.engine is not None and self._own_engine:
            try:
                self.engine.destroy()
            except Exception as e:
                logger.warning("destroying the engine failed: %s", e)
            self.engine = None
        self.books.close()
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

    # -- the loop -------------------------------------------------------------------------

    async def atrain(
        self,
        workflow: Any = None,
        workflow_kwargs: dict[str, Any] | None = None,
        eval_workflow: Any = None,
    ) -> dict[str, Any]:
        """The training loop (async form of ``train``)."""
        seed_everything(self.config.seed)
        self.dist = join_process_group(self.config, external_source=self.external)
        self.ranks.dist = self.dist
        if not self.dist.is_main:
            # Rollout runs once, on rank 0; this rank only trains on the rows it is sent.
            return await asyncio.to_thread(self._follow)
        source = await self._set_up(workflow, workflow_kwargs, eval_workflow)
        pos, total = self.position, self.total_steps
        progress = Progress(total, initial=pos.step, enabled=self.config.trainer.progress)  # type: ignore[arg-type]
        logger.info(
            "training %s steps (from step %d, version %d); run dir %s",
            total if total is not None else "unlimited",
            pos.step,
            pos.version,
            self.run_dir,
        )
        try:
            if self.evaluator is not None and self.config.trainer.eval_before_training:
                if pos.step == 0:
                    await self._evaluate()
            while total is None or pos.step < total:
                t_step = time.perf_counter()
                memory.release_free_memory()
                memory.reset_peak()
                # 1-2: a batch and the update on it (a batch without signal may be redrawn)
                done = await self._fetch_and_update(source)
                if done is None:  # the source was closed: keep what was trained
                    if pos.step > pos.saved_step:
                        await asyncio.to_thread(self._save_checkpoint)
                    break
                metrics, episodes, rolled_out_at = done
                # 3: the new weights everywhere, or (no update) the step still moves on
                if metrics.get("actor/updated"):
                    metrics.update(await self._push_new_weights(source, metrics))
                elif isinstance(source, DatasetSource):
                    source.skip_step()  # the version stays; the staleness bound moves on
                # 4: the books
                self.books.dump(episodes, rolled_out_at, pos.step + 1)
                pos.step += 1
                if isinstance(source, DatasetSource):
                    pos.data_state = source.data_state
                last = pos.step == total
                if last:
                    # The run's weights are saved before its final evaluation, and what only
                    # further updates need is let go, so that the evaluation's KV cache takes
                    # its memory instead of adding to it (the run's peak otherwise).
                    await self.books.checkpoint(
                        pos, total, self.policies, self.tokenizer, self.data
                    )
                    for policy in self.policies.values():
                        policy.actor.release_training_state()
                if self._evaluation_due(total):
                    metrics.update(await self._evaluate())
                self.books.log(pos, metrics, t_step, progress)
                if not last:
                    await self.books.checkpoint(
                        pos, total, self.policies, self.tokenizer, self.data
                    )
        finally:
            progress.close()
            self.ranks.announce({"op": "stop"})
            await source.aclose()
            if self.evaluator is not None:
                await self.evaluator.aclose()
        return self.books.final_metrics()

    async def _set_up(
        self, workflow: Any, workflow_kwargs: dict[str, Any] | None, eval_workflow: Any
    ) -> BatchSource:
        """Models, recovery, the books, the proxy, the batch source and the evaluator."""
        cfg = self.config
        spec = workflow if workflow is not None else cfg.workflow
        if self.external:
            if workflow is not None or eval_workflow is not None:
                raise ValueError("an external source brings its own batches: pass no workflow")
        elif spec is None:
            raise ValueError(
                "no workflow: pass train(workflow=...) or set `workflow` in the config"
            )
        kwargs = workflow_kwargs if workflow_kwargs is not None else dict(cfg.workflow_kwargs)
        restored = await asyncio.to_thread(self._set_up_models)
        engine = self._engine
        if restored is None and not self._own_engine:
            # A passed-in engine may already have moved on; its tokens carry that version.
            self.position.version = engine.get_version()
        self.books.open(self.position.step)
        write_run_config(self.run_dir, cfg)
        if cfg.rollout.dump_to_file:  # the token record (areal-env view), written off the loop
            self.token_log = TokenLog(
                self.run_dir, cfg.actor, tokenizer=self.tokenizer, keep_step=self.position.step
            )
            for policy in self.policies.values():
                policy.actor.trace = self.token_log.trace
        if self.source is None:
            assert self.data is not None
            self.proxy = start_proxy(cfg, engine, self.tokenizer, self.policies)
            total = self.total_steps
            self.source = await dataset_source(
                cfg,
                self.data,
                engine,
                self.proxy,
                spec,
                kwargs,
                batches=None if total is None else total - self.position.step,
            )
            if self.valid_items:
                eval_spec = eval_workflow if eval_workflow is not None else spec
                self.evaluator = make_evaluator(
                    cfg, engine, self.proxy, eval_spec, kwargs, self.valid_items
                )
        self.source.set_version(self.position.version)
        return self.source

    def _set_up_models(self) -> RunPosition | None:
        """Models and recovery (every rank); rank 0 pushes restored weights to its engines.
        Returns the restored position, or ``None`` for a fresh start."""
        models = build_models(
            self.config, self.dist, self.engine, self.ranks, engines=self._given_engines
        )
        self.policies, self.tokenizer = models.policies, models.tokenizer
        self.engine, self._own_engine = models.engine, models.own_engine
        self.engines = models.engines
        restored = self.books.recover(self.policies, self.data)
        if restored is not None:
            self.position = restored
        version = self.position.version
        if self.dist.is_main and (restored is not None or self.config.policies):
            # restored weights; on a fresh start the adapter policies (served by nobody until
            # their adapters are loaded); a fresh model of its own is on its engine already
            fresh = restored is None or version == 0
            pushed = [p for p in self.policies.values() if p.adapter or not fresh]
            if pushed:
                self._push(pushed, version)
        return restored

    async def _fetch_and_update(
        self, source: BatchSource
    ) -> tuple[dict[str, Any], list[Episode], int] | None:
        """A batch, then the update on it; a batch without signal is replaced by a fresh one
        while ``trainer.redraw_batches_without_signal`` allows (its episodes are dumped under
        this step all the same). ``(metrics, episodes, the version they were rolled out at)``,
        or ``None`` once the source is closed."""
        pos = self.position
        redrawn, rollout_s = 0, 0.0
        while True:
            t0 = time.perf_counter()
            try:
                batch = await source.next_batch(
                    trainer_version=pos.version, batch_size=self.config.rollout.batch_size
                )
            except SourceClosedError:
                logger.info("the batch source was closed: training stops at step %d", pos.step)
                return None
            metrics: dict[str, Any] = dict(batch.stats)
            rollout_s += time.perf_counter() - t0
            metrics["mem/rollout_peak_rss_gb"] = memory.peak_rss_gb()
            if self._fault is not None and self._fault.should_kill_before_update(pos.step + 1):
                kill_now(f"step {pos.step + 1}: batch fetched, update not started")
            budget = self.config.trainer.redraw_batches_without_signal
            may_redraw = pos.redraws_used < budget and isinstance(source, DatasetSource)
            # while it may be redrawn, a batch without signal is not trained on, even where a
            # KL or entropy term would still move the policy: it is replaced instead
            metrics.update(await self._update(batch, require_signal=may_redraw))
            no_signal = not metrics.get("actor/updated") and not metrics.get("empty_batch")
            if not (no_signal and may_redraw and isinstance(source, DatasetSource)):
                metrics["rollout/redrawn"] = float(redrawn)
                metrics["time/rollout_s"] = rollout_s
                return metrics, batch.episodes, batch.trainer_version
            pos.redraws_used += 1
            redrawn += 1
            logger.info(
                "step %d: no episode's advantage is non-zero (reward mean %.3f); drawing "
                "another batch (%d of trainer.redraw_batches_without_signal=%d used)",
                pos.step + 1,
                float(metrics.get("reward/mean", 0.0)),
                pos.redraws_used,
                budget,
            )
            source.skip_step()  # that batch is consumed without an update
            self.books.dump(batch.episodes, batch.trainer_version, pos.step + 1)

    async def _update(self, batch: RolloutBatch, *, require_signal: bool) -> dict[str, Any]:
        """One PPO update per policy, each on its own rows of the batch (collated into tensors
        here, once per policy), on every rank. ``actor/updated``: some policy was updated.
        ``require_signal``: a policy whose rows have no non-zero advantage is not updated
        (``PPOActor.update``)."""
        if not self.config.policies:
            return await self._update_policy(
                self.policies[None], batch.groups, batch, require_signal=require_signal
            )
        out: dict[str, Any] = {}
        left_out = unrouted_rows(batch.groups, list(self.policies))
        if left_out:
            logger.warning(
                "step %d: %d rows name no policy of this run (policies: %s); not trained",
                self.step + 1,
                left_out,
                ", ".join(str(n) for n in self.policies),
            )
        out["rows/without_policy"] = float(left_out)
        for name, policy in self.policies.items():
            assert name is not None
            out.update(policy_rollout_stats(batch.groups, name, batch.trainer_version))
            groups = policy_groups(batch.groups, name)
            stats = await self._update_policy(
                policy, groups or [], batch, require_signal=require_signal
            )
            out.update({f"{policy.prefix}{k}": v for k, v in stats.items()})
        out["actor/updated"] = float(
            any(out.get(f"{p.prefix}actor/updated") for p in self.policies.values())
        )
        out["empty_batch"] = float(
            all(out.get(f"{p.prefix}empty_batch") for p in self.policies.values())
        )
        return out

    async def _update_policy(
        self,
        policy: Policy,
        groups: list[list[Episode]],
        batch: RolloutBatch,
        *,
        require_signal: bool,
    ) -> dict[str, Any]:
        """One PPO update of ``policy`` on ``groups`` (skipped when it has no trained token).
        The token record (``areal-env view``) gets its rows with what the update did: a part
        of the step per policy."""
        tensors = collate_groups(groups) if any(groups) else None
        if tensors is None or int(tensors["loss_mask"].sum()) == 0:
            if policy.name is None:
                logger.warning("step %d: every episode was rejected; update skipped", self.step)
            else:
                logger.warning(
                    "step %d: no trained token for policy %s; its update skipped",
                    self.step + 1,
                    policy.name,
                )
            return {"actor/update_skipped": 1.0, "empty_batch": 1.0, "actor/updated": 0.0}
        step = self.position.step

        def update_all_ranks() -> dict[str, float]:
            cmd: dict[str, Any] = {
                "op": "update",
                "batch": tensors,
                "step": step,
                "require_signal": require_signal,
            }
            if policy.name is not None:
                cmd["policy"] = policy.name
            self.ranks.announce(cmd)
            return policy.actor.update(tensors, step=step, require_signal=require_signal)

        ustats = await asyncio.to_thread(update_all_ranks)
        if self.token_log is not None:
            self.token_log.commit(step + 1, batch.trainer_version, groups)
        return {
            **ustats,
            "empty_batch": 0.0,
            "actor/updated": float(not ustats.get("actor/update_skipped")),
        }

    async def _push_new_weights(
        self, source: BatchSource, metrics: dict[str, Any]
    ) -> dict[str, float]:
        """The updated policies' new weights to their engines; the version moves on
        everywhere."""
        t0 = time.perf_counter()
        new_version = self.position.version + 1
        updated = [p for p in self.policies.values() if metrics.get(f"{p.prefix}actor/updated")]
        await asyncio.to_thread(self._push, updated, new_version)
        self.position.version = new_version
        source.set_version(new_version)
        out = {"time/weight_push_s": time.perf_counter() - t0}
        if self.config.policies:
            out.update({f"{p.prefix}push_bytes": float(p.pusher.last_push_bytes) for p in updated})
        return out

    def _push(self, policies: list[Policy], version: int) -> None:
        """Push ``policies``' weights (rank 0). With ``policies:`` every engine is paused
        meanwhile and then set to ``version``: the step's new weights appear at once, under
        one version, for every policy (updated or not)."""
        if self.engines is None:
            for policy in policies:
                policy.pusher.push(version)
            return
        self.engines.pause()
        try:
            for policy in policies:
                policy.pusher.push(version)
            self.engines.set_version(version)
        finally:
            self.engines.resume()

    def _evaluation_due(self, total: int | None) -> bool:
        """Every ``trainer.eval_freq_steps`` and after the last step."""
        if self.evaluator is None:
            return False
        freq, step = self.config.trainer.eval_freq_steps, self.position.step
        return step == total or bool(freq and step % freq == 0)

    async def _evaluate(self) -> dict[str, float]:
        """Held-out evaluation (greedy, ``is_eval``): ``eval/*`` metrics, and
        ``eval/<set>/*`` for each of ``extra_valid_datasets`` (see ``areal_env.trainer.eval``)."""
        assert self.evaluator is not None
        # The update's freed activations are still in the heap: give them back first, or the
        # evaluation's KV cache comes on top of them (the demo's last step, the one with an
        # evaluation, peaked 0.6 GB above the others).
        memory.release_free_memory()
        result = await self.evaluator.evaluate(version=self.version, step=self.step)
        return {f"eval/{k}": v for k, v in result.flat_metrics().items()}

    def _save_checkpoint(self) -> Path:
        return self.books.save(self.position, self.policies, self.tokenizer, self.data)

    def _follow(self) -> dict[str, Any]:
        """A rank other than 0: build the sharded actor, restore, then run the collectives
        rank 0 announces (update, weight gather, checkpoint) until it says stop."""
        self._set_up_models()
        ops = 0
        while True:
            cmd = self.ranks.receive()
            op = cmd["op"]
            if op == "stop":
                break
            if op == "update":
                self.position.step = int(cmd["step"])
                policy = self.policies[cmd.get("policy")]
                policy.actor.update(
                    cmd["batch"],
                    step=self.position.step,
                    require_signal=bool(cmd.get("require_signal", False)),
                )
            elif op == "push":
                self.policies[cmd.get("policy")].pusher.gather(cmd["what"])
            elif op == "save":
                self.position.step = int(cmd["step"])
                self._save_checkpoint()
            else:  # pragma: no cover - both sides ship together
                raise RuntimeError(f"rank {self.dist.rank}: unknown command {op!r}")
            ops += 1
        logger.info("rank %d: rank 0 finished; %d collective steps done", self.dist.rank, ops)
        return {"rank": self.dist.rank, "collective_ops": ops}

    # -- parts that exist once set up -----------------------------------------------------

    @property
    def _engine(self) -> InferenceEngine:
        if self.engine is None:
            raise RuntimeError("the trainer has no engine (closed, or not set up)")
        return self.engine

    @property
    def actor(self) -> PPOActor:
        """The run's only policy's actor (a run without ``policies:``)."""
        if None not in self.policies:
            raise RuntimeError(
                "the trainer has no single actor: not set up, or a run with policies "
                "(see trainer.policies)"
            )
        return self.policies[None].actor
