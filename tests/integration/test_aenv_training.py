"""Training through the proxy on real aenvironment servers (RUN_AENV_INTEGRATION=1).

Each test runs one PPO step on the embedded default model with a tiny batch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_env.envs.agent import AenvAgent

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
ITEMS = [
    {"task_id": "t0", "question": "What is 17 + 25? Use the add tool.", "answer": 42},
    {"task_id": "t1", "question": "What is 30 + 12? Use the add tool.", "answer": 42},
]


def _config(tmp_path, model_path, *, batch_size=1, n_samples=2):
    from areal_env.api.config import ExperimentConfig
    from areal_env.api.config_load import config_from_dict

    return config_from_dict(
        ExperimentConfig,
        {
            "experiment_name": "aenv-it",
            "trial_name": tmp_path.name,
            "fileroot": str(tmp_path),
            "model": {"path": model_path},
            "rollout": {
                "n_samples": n_samples,
                "batch_size": batch_size,
                "max_concurrent_rollouts": 4,
                "episode_timeout": 300,
            },
            "gconfig": {"max_new_tokens": 24, "temperature": 1.0},
            # A small entropy bonus: the update runs (and is pushed) even when a group's rewards
            # are all equal, which the weak base model often produces on this task.
            "actor": {"ppo_n_minibatches": 1, "entropy_coef": 1e-4},
            "trainer": {"total_train_steps": 1, "tensorboard": False, "progress": False},
        },
    )


def _train(cfg, items, workflow, workflow_kwargs=None):
    from areal_env.trainer.ppo import PPOTrainer

    with PPOTrainer(cfg, items) as trainer:
        metrics = trainer.train(workflow=workflow, workflow_kwargs=workflow_kwargs)
        return trainer, metrics


ENV_REWARDS = {0.0, 0.1, 0.5, 1.0}  # the grades examples/aenv/env_tools.py:reward gives


def _assert_trained(trainer, metrics, *, min_accepted=1):
    """A real step: episodes accepted, an update ran and was pushed, rewards from the env."""
    assert trainer.step == 1
    assert metrics["episodes/accepted"] >= min_accepted, metrics
    assert metrics["empty_batch"] == 0.0 and trainer.version == 1, metrics
    lines = [
        json.loads(line)
        for f in sorted(Path(metrics["dump_dir"]).rglob("*.jsonl"))
        for line in f.read_text().splitlines()
    ]
    rewards = {line["episode_reward"] for line in lines if line["accepted"]}
    assert rewards and rewards <= ENV_REWARDS, rewards
    return lines


def _agent_kwargs(url: str) -> dict:
    return {
        "aenv_config": {"env_name": "calculator@1.0.0", "aenv_url": url, "retry_delay": 0.1},
        "max_turns": 2,
        "max_tokens": 24,
        "temperature": 1.0,
        "first_turn_tool_choice": {"type": "function", "function": {"name": "add"}},
    }


def test_train_step_aenv_agent_from_import_string(tmp_path, model_path, aenv_server):
    cfg = _config(tmp_path, model_path)
    trainer, metrics = _train(cfg, ITEMS[:1], "areal_env.AenvAgent", _agent_kwargs(aenv_server.url))
    _assert_trained(trainer, metrics)


def test_train_step_agents_sdk_runner(tmp_path, model_path, aenv_server):
    cfg = _config(tmp_path, model_path)
    kwargs = _agent_kwargs(aenv_server.url)
    trainer, metrics = _train(
        cfg, ITEMS[:1], str(ROOT / "agents" / "openai_agents_runner.py") + ":RunnerAgent", kwargs
    )
    _assert_trained(trainer, metrics)


class _KillingAgent(AenvAgent):
    """Items marked ``kill`` run on a dedicated server that dies as the episode starts."""

    def __init__(self, doomed, **kwargs):
        super().__init__(**kwargs)
        self.doomed = doomed  # (launcher, index)
        self.doomed_episodes = 0

    def open_environment(self, data):
        if data.get("kill"):
            self.doomed_episodes += 1
            launcher, index = self.doomed
            cfg = self.config.new(aenv_url=launcher.urls[index], max_retries=1)
            from areal_env.envs.episode import EnvironmentPool

            return EnvironmentPool(cfg).adapter()
        return super().open_environment(data)

    async def _episode(self, client, model, env, data):
        if data.get("kill"):  # the first doomed episode to get here kills the server; a later
            # one finds it dead here or already while listing its tools (either way: rejected)
            launcher, index = self.doomed
            launcher.stop_server(index, kill=True)
        return await super()._episode(client, model, env, data)


def test_server_killed_mid_episode_is_rejected_training_goes_on(
    tmp_path, model_path, aenv_server, aenv_server_factory
):
    doomed = aenv_server_factory(1)
    agent = _KillingAgent((doomed, 0), **_agent_kwargs(aenv_server.url))
    items = [dict(ITEMS[0]), dict(ITEMS[1], kill=True)]
    cfg = _config(tmp_path, model_path, batch_size=2, n_samples=2)
    trainer, metrics = _train(cfg, items, agent)
    assert agent.doomed_episodes == 2
    _assert_trained(trainer, metrics)  # the healthy group trained
    rejected = [v for k, v in metrics.items() if "reject" in k and isinstance(v, (int, float))]
    assert rejected and max(rejected) >= 2, metrics
