"""``TrainerBookkeeping``: what a run leaves on disk and how it resumes from it.

Checkpoints (every ``trainer.save_freq_steps`` and the last step) and recovery from the
latest one, trajectory dumps (and dropping those of steps that will be redone), metrics, the
reward plot and the final summary.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

from areal_env.trainer import checkpoint as ckpt
from areal_env.trainer import memory
from areal_env.trainer.eval import paired_p_value, read_eval_log, read_eval_summary
from areal_env.trainer.ppo_push import TrainerPush
from areal_env.trainer.stats import Progress, dump_lines, dump_records, plot_reward_curve

logger = logging.getLogger(__name__)


class TrainerBookkeeping(TrainerPush):
    """Checkpoint, resume, dumps, metrics and the final summary of a ``PPOTrainer``."""

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
        self.redraws_used = int(state.get("redraws_used", 0))
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
            "redraws_used": self.redraws_used,
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

    def _dump(self, records: list[dict[str, Any]], version: int, step: int) -> None:
        """Step 4: the step's trajectories into rollout/{version}/{task}.jsonl."""
        if not (self.config.rollout.dump_to_file and records):
            return
        try:
            dump_records(self.run_dir / "rollout", dump_lines(records, version, step))
        except OSError as e:  # a full disk must not stop training
            logger.warning("trajectory dump failed: %s", e)

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
