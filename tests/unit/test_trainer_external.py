"""``PPOTrainer`` on an external batch source (the any-agent service's hook).

Trajectories are real completions of a real engine, fed through a real
``ExternalTrajectorySource``; the trainer gets that source as its executor and the engine as a
passed-in engine it must push to but never destroy.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from areal_env.api.config import ExperimentConfig
from areal_env.api.config_load import config_from_dict
from areal_env.api.io import GenerationConfig, ModelRequest
from areal_env.service.source import ExternalTrajectorySource
from areal_env.trainer.ppo import PPOTrainer


class RecordingSource(ExternalTrajectorySource):
    """Records version pushes; with ``close_when_empty`` it closes itself when asked for a batch
    it has no group for (how a service shuts its source down)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.versions_set: list[int] = []
        self.close_when_empty = False

    def set_version(self, version: int) -> None:
        self.versions_set.append(int(version))
        super().set_version(version)

    async def rollout_batch(self, **kw):
        if self.close_when_empty and self.num_ready_groups == 0:
            self.close()
        return await super().rollout_batch(**kw)


async def _episode(engine, tokenizer, question: str, reward: float, seed: int) -> dict:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    if not isinstance(prompt, list):  # a BatchEncoding in recent transformers
        prompt = prompt["input_ids"]
    prompt = [int(t) for t in prompt]
    resp = await engine.agenerate(
        ModelRequest(input_ids=prompt, gconfig=GenerationConfig(max_new_tokens=6, seed=seed))
    )
    out = list(resp.output_tokens)
    row = {
        "input_ids": prompt + out,
        "loss_mask": [0] * len(prompt) + [1] * len(out),
        "logprobs": [0.0] * len(prompt) + list(resp.output_logprobs),
        "versions": [-1] * len(prompt) + list(resp.output_versions),
        "reward": reward,
    }
    return {
        "trajectories": {"r0": row},
        "interactions": [{"id": f"c{seed}", "reward": reward, "completion_text": "x"}],
        "user": "tester",
        "task_id": question,
    }


async def _feed(source, engine, tokenizer, group: str, base_seed: int) -> None:
    for i, reward in enumerate((1.0, 0.0)):  # different rewards: a non-zero advantage
        ep = await _episode(engine, tokenizer, f"Say hi ({group})", reward, base_seed + i)
        source.put(ep, group_id=group)


def _cfg(tmp_path, steps) -> ExperimentConfig:
    return config_from_dict(
        ExperimentConfig,
        {
            "experiment_name": "ext",
            "trial_name": "t",
            "fileroot": str(tmp_path),
            "rollout": {"n_samples": 2, "batch_size": 1, "max_head_offpolicyness": 1},
            "actor": {"ppo_n_minibatches": 1, "lr": 1e-5},
            "trainer": {"total_train_steps": steps, "tensorboard": False, "progress": False},
        },
    )


@pytest.mark.slow
async def test_external_source_trains_pushes_and_resumes(tmp_path, model_path):
    from areal_env.engine.local import LocalEngine

    engine = LocalEngine(model_path, max_batch_size=4)
    engine.initialize()
    try:
        tok = engine.tokenizer
        source = RecordingSource(n_samples=2, batch_size=1, max_head_offpolicyness=1)
        await _feed(source, engine, tok, "g0", 1)
        await _feed(source, engine, tok, "g1", 3)

        with PPOTrainer(_cfg(tmp_path, 2), source=source, engine=engine) as trainer:
            assert trainer.data is None and trainer.total_steps == 2
            with pytest.raises(ValueError, match="no workflow"):
                await trainer.atrain(workflow="x:y")
            final = await trainer.atrain()
        assert trainer.proxy is None  # no proxy of its own
        run_dir = tmp_path / "ext" / "t"
        metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == [1, 2]
        assert [m["version"] for m in metrics] == [1, 2]
        assert all(m["episodes/accepted"] == 2 and not m["actor/update_skipped"] for m in metrics)
        assert "data/epoch" not in metrics[0]
        assert source.versions_set == [0, 1, 2] and engine.get_version() == 2
        assert final["step"] == 2 and (run_dir / "reward_curve.png").is_file()
        assert (run_dir / "checkpoints" / "step_2" / "model" / "config.json").is_file()
        dumps = [json.loads(x) for f in (run_dir / "rollout").rglob("*.jsonl") for x in open(f)]
        assert sorted((d["version"], d["group_key"]) for d in dumps) == [
            (0, "g0"),
            (0, "g0"),
            (1, "g1"),
            (1, "g1"),
        ]
        assert all(d["user"] == "tester" and d["interactions"] for d in dumps)

        # The passed-in engine outlived the trainer: it still generates.
        resp = await engine.agenerate(
            ModelRequest(input_ids=[1, 2, 3], gconfig=GenerationConfig(max_new_tokens=2))
        )
        assert len(resp.output_tokens) >= 1 and resp.output_versions[-1] == 2

        # A restarted service (recover: auto) continues step and version, trains on, and stops
        # cleanly when its source is closed (no step limit), checkpointing the last step.
        source2 = RecordingSource(n_samples=2, batch_size=1, max_head_offpolicyness=1)
        await _feed(source2, engine, tok, "g2", 5)
        engine.set_version(0)  # as a freshly started engine
        source2.close_when_empty = True
        with PPOTrainer(_cfg(tmp_path, None), source=source2, engine=engine) as trainer2:
            assert trainer2.total_steps is None
            final2 = await asyncio.wait_for(trainer2.atrain(), timeout=600)
        assert final2["step"] == 3 and final2["version"] == 3
        assert source2.versions_set == [2, 3] and engine.get_version() == 3
        metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == [1, 2, 3]
        assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_3"
    finally:
        engine.destroy()
