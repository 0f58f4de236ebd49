"""``RunBooks``: what a run leaves on disk, and how it resumes from it.

Checkpoints (every ``trainer.save_freq_steps`` and at the last step) and recovery from the
latest one, trajectory dumps (and dropping those of steps that will be redone), metrics
(JSONL, TensorBoard), the reward plot and the final summary. ``RunPosition`` is the part of the
trainer's state that a checkpoint saves: where the run stands.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_env.api.config import ExperimentConfig
from areal_env.api.episode import Episode
from areal_env.trainer import checkpoint as ckpt
from areal_env.trainer import memory
from areal_env.trainer.data import DataLoader
from areal_env.trainer.eval import (
    paired_p_value,
    read_eval_log,
    read_eval_summary,
    truncate_eval_log,
)
from areal_env.trainer.policies import Policy, checkpoint_parts, policies_state
from areal_env.trainer.ranks import RankChannel
from areal_env.trainer.stats import (
    MetricsLogger,
    Progress,
    dump_lines,
    dump_records,
    plot_reward_curve,
)

logger = logging.getLogger(__name__)


@dataclass
class RunPosition:
    """Where a run stands; every checkpoint saves it and a resumed run starts from it."""

    step: int = 0
    """Training steps done."""
    version: int = 0
    """Weight version of the policy (updates pushed so far)."""
    saved_step: int = 0
    """The step of the latest checkpoint."""
    redraws_used: int = 0
    """Batches without signal replaced so far (``trainer.redraw_batches_without_signal``)."""
    data_state: dict[str, Any] | None = None
    """The data loader's position after the batch last trained on (items drawn ahead for
    prefetching are not counted: they are drawn again after a resume)."""


class RunBooks:
    """The run folder's books: checkpoints, dumps, metrics and the final summary."""

    def __init__(
        self,
        config: ExperimentConfig,
        ranks: RankChannel,
        *,
        on_checkpoint: Callable[[int, Path], None] | None = None,
    ) -> None:
        self.config = config
        self.ranks = ranks
        self.run_dir = Path(config.run_dir)
        self.ckpt_root = self.run_dir / "checkpoints"
        self.on_checkpoint = on_checkpoint
        self.checkpoint_failures = 0
        self.metrics: MetricsLogger | None = None
        self.last_metrics: dict[str, Any] = {}

    # -- opening and recovering -----------------------------------------------------------

    def open(self, from_step: int) -> None:
        """Rank 0, before the first step: the metrics log, and what the steps after
        ``from_step`` (0: a fresh run) had written is dropped, since they will be redone."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = MetricsLogger(self.run_dir, tensorboard=self.config.trainer.tensorboard)
        self.metrics.truncate_after(from_step)
        self._drop_stale_dumps(from_step)
        truncate_eval_log(self.run_dir, from_step if from_step else -1)

    def recover(
        self, policies: Mapping[str | None, Policy], data: DataLoader | None
    ) -> RunPosition | None:
        """``trainer.recover: auto``: restore the latest checkpoint into every policy's actor
        (and the data position into ``data``); ``None`` when there is none. Collective under
        FSDP."""
        if self.config.trainer.recover != "auto":
            return None
        found = ckpt.latest_checkpoint(self.ckpt_root)
        if found is None:
            return None
        saved = ckpt.load_trainer_state(found)
        names = sorted(str(n) for n in policies if n is not None)
        if sorted(saved.get("policies") or {}) != names:
            raise RuntimeError(
                f"checkpoint {found} was written by a run with policies "
                f"{sorted(saved.get('policies') or {}) or 'none'}, this run trains "
                f"{names or 'none'}: resume with the same policies, or start a new trial_name"
            )
        if None in policies:
            actor = policies[None].actor
            state = ckpt.restore_checkpoint(found, model=actor.model, optimizer=actor.optimizer)
            actor.update_count = int(state.get("update_count", state["step"]))
        else:
            state = ckpt.restore_checkpoint(found, parts=checkpoint_parts(policies))
            for name, policy in policies.items():
                policy.actor.update_count = int(state["policies"][name]["update_count"])
        position = RunPosition(
            step=int(state["step"]),
            version=int(state.get("version", state["step"])),
            redraws_used=int(state.get("redraws_used", 0)),
        )
        position.saved_step = position.step
        if data is not None and state.get("data") is not None:
            data.load_state_dict(state["data"])
            position.data_state = data.state_dict()
        where = (
            f"data position epoch {data.epoch} batch {data.batch_index}"
            if data is not None
            else "external batch source"
        )
        logger.info(
            "recovered from %s: step %d, version %d, %s",
            found,
            position.step,
            position.version,
            where,
        )
        return position

    def _drop_stale_dumps(self, keep_step: int) -> None:
        """Dump lines of steps after ``keep_step`` belong to steps that will be redone: remove
        them so they are not written twice. Filtered by step, not by version: a step whose
        update was skipped leaves the version where it was."""
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

    # -- checkpoints ----------------------------------------------------------------------

    async def checkpoint(
        self,
        position: RunPosition,
        total: int | None,
        policies: Mapping[str | None, Policy],
        tokenizer: Any,
        data: DataLoader | None,
    ) -> None:
        """A checkpoint every ``trainer.save_freq_steps`` and at the last step. A full disk
        mid-run loses that checkpoint, not the run (the previous one stays the latest)."""
        freq = self.config.trainer.save_freq_steps
        if not (position.step == total or (freq and position.step % freq == 0)):
            return
        try:
            await asyncio.to_thread(self.save, position, policies, tokenizer, data)
        except ckpt.CheckpointWriteError as e:
            if position.step == total:
                raise  # the run's last weights: never end as if they were saved
            self.checkpoint_failures += 1
            logger.error("%s; training goes on and retries at the next save", e)

    def save(
        self,
        position: RunPosition,
        policies: Mapping[str | None, Policy],
        tokenizer: Any,
        data: DataLoader | None,
    ) -> Path:
        """Write a checkpoint of ``position`` and every policy (collective under FSDP: rank 0
        announces it). The run's only policy is the checkpoint's own ``state/`` and ``model/``;
        a multi-agent run's policies each have theirs under ``policies/<name>/``."""
        self.ranks.announce({"op": "save", "step": position.step})
        data_state = position.data_state
        if data_state is None and data is not None:
            data_state = data.state_dict()
        state: dict[str, Any] = {
            "version": position.version,
            "epoch": data_state["epoch"] if data_state else 0,
            "data": data_state,
            "redraws_used": position.redraws_used,
            "experiment_name": self.config.experiment_name,
            "trial_name": self.config.trial_name,
        }
        keep = self.config.trainer.keep_checkpoints
        if None in policies:
            actor = policies[None].actor
            state.update(update_count=actor.update_count, model_path=actor.model_path)
            path = ckpt.save_checkpoint(
                self.ckpt_root,
                position.step,
                model=actor.model,
                tokenizer=tokenizer,
                optimizer=actor.optimizer,
                trainer_state=state,
                keep_last=keep,
                export_hf=actor.export_hf,
            )
        else:
            # the base model the adapter policies are served on, and each policy
            state["model_path"] = str(Path(self.config.model.path))
            state["base_model_path"] = next(
                (p.actor.model_path for p in policies.values() if p.adapter), None
            )
            state["policies"] = policies_state(policies)
            path = ckpt.save_checkpoint(
                self.ckpt_root,
                position.step,
                tokenizer=None,
                trainer_state=state,
                keep_last=keep,
                parts=checkpoint_parts(policies),
            )
        position.saved_step = position.step
        if self.on_checkpoint is not None and self.ranks.dist.is_main:
            self.on_checkpoint(position.step, path)
        return path

    # -- dumps and metrics ----------------------------------------------------------------

    def dump(self, episodes: list[Episode], version: int, step: int) -> None:
        """The step's episodes into ``rollout/{version}/{task}.jsonl`` (``rollout.dump_to_file``)."""
        if not (self.config.rollout.dump_to_file and episodes):
            return
        try:
            dump_records(self.run_dir / "rollout", dump_lines(episodes, version, step))
        except OSError as e:  # a full disk must not stop training
            logger.warning("trajectory dump failed: %s", e)

    def log(
        self,
        position: RunPosition,
        metrics: dict[str, Any],
        t_step: float,
        progress: Progress,
    ) -> None:
        """The step's metrics (JSONL, TensorBoard), the progress line and the reward plot."""
        assert self.metrics is not None, "RunBooks.open() first"
        step_s = time.perf_counter() - t_step
        metrics["time/step_s"] = step_s
        # the update resets the high-water mark for its own figure: take the max
        metrics["mem/peak_rss_gb"] = max(
            metrics["mem/rollout_peak_rss_gb"],
            float(metrics.get("mem/update_peak_rss_gb", 0.0)),
            memory.peak_rss_gb(),
        )
        metrics["version"] = position.version
        if position.data_state is not None:
            metrics["data/epoch"] = position.data_state["epoch"]
            metrics["data/batch_index"] = position.data_state["batch_index"]
        if metrics.get("tokens/total"):
            metrics["perf/tokens_per_s"] = metrics["tokens/total"] / step_s
        self.metrics.log(position.step, metrics)
        self.last_metrics = {"step": position.step, **metrics}
        progress.update(position.step, metrics)
        plot_reward_curve(
            self.metrics.read(),
            self.run_dir / "reward_curve.png",
            evals=read_eval_log(self.run_dir),
        )

    def final_metrics(self) -> dict[str, Any]:
        """The last step's metrics plus the run's summary: first/last evaluation and their
        paired p-value, the first and last steps' mean reward, and where the files are."""
        assert self.metrics is not None, "RunBooks.open() first"
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

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
