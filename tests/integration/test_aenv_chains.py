"""The chain recipe (``examples/aenv/config_chains.yaml``) end to end, real aenvironment server
(RUN_AENV_INTEGRATION=1): one training step on multi-call problems with the answer tool, one
guided episode per group that follows the reference to its answer call, and its steps imitated.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CHAINS = [
    json.loads(x) for x in (ROOT / "examples/aenv/train_chains.jsonl").read_text().splitlines()
]


def test_the_chain_recipe_guides_answers_through_the_tool_and_imitates(
    tmp_path, model_path, aenv_server
):
    from areal_env.api.config import ExperimentConfig, load_config
    from areal_env.trainer.ppo import PPOTrainer

    example = yaml.safe_load((ROOT / "examples/aenv/config_chains.yaml").read_text())
    two_calls = [x for x in CHAINS if x["calls"] == 2][:2]
    assert len(CHAINS) > 512 and sum(x["calls"] >= 2 for x in CHAINS) > len(CHAINS) / 2
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(x) + "\n" for x in two_calls))
    cfg = {
        **example,
        "fileroot": str(tmp_path / "out"),
        "model": {"path": model_path},
        "rollout": {**example["rollout"], "batch_size": 2, "n_samples": 2},
        "trainer": {**example["trainer"], "total_train_steps": 1, "progress": False},
        "train_dataset": str(tmp_path / "train.jsonl"),
        "valid_dataset": None,
        "extra_valid_datasets": {},
    }
    cfg["workflow_kwargs"]["aenv_config"]["aenv_url"] = aenv_server.url
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with PPOTrainer(load_config(ExperimentConfig, path)) as trainer:
        final = trainer.train()
    run_dir = Path(final["run_dir"])
    (step,) = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert step["episodes/guided"] >= 2  # member 0 of each group (a redrawn batch adds more)
    assert step["actor/imitated_tokens"] > 0
    # a guided episode makes the reference's two calls, then answers through the answer tool,
    # and is paid for it: the calls' credit and the answer's 1.0
    guided = []
    for dump in (run_dir / "rollout" / "0").glob("*.jsonl"):
        lines = [json.loads(x) for x in dump.read_text().splitlines()]
        guided += [x for x in lines if x["guided"]]
    assert guided
    by_episode: dict = {}
    for line in guided:
        by_episode.setdefault((line["task_id"], line["traj_index"]), []).append(line)
    for lines in by_episode.values():
        item = next(x for x in two_calls if x["task_id"] == lines[0]["task_id"])
        names = [n for line in lines for n in line["tool_calls"]]
        assert names == [*(s[0] for s in item["steps"]), "answer"]
        rewards = lines[-1]["episode_reward"]
        assert sorted(rewards.values()) == [0.25, 0.25, 1.0]
