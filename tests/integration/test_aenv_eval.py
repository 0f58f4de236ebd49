"""Held-out evaluation on the example task, real aenvironment server (RUN_AENV_INTEGRATION=1).

A one-step training run with a ``valid_dataset`` evaluates before and after the step (greedy,
``is_eval`` passed to the agent, dumps under ``eval-rollout/``), and ``areal-env eval`` evaluates
the run's checkpoint and the base model on their own with the same metrics.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
VALID = [json.loads(x) for x in (ROOT / "examples/aenv/valid.jsonl").read_text().splitlines()[:3]]
TRAIN = [json.loads(x) for x in (ROOT / "examples/aenv/train.jsonl").read_text().splitlines()[:2]]
NEW = [
    json.loads(x)
    for x in (ROOT / "examples/aenv/valid_new_phrasing.jsonl").read_text().splitlines()[:2]
]

# Records every is_eval it is called with, then behaves as AenvAgent.
AGENT = """
from areal_env.envs.agent import AenvAgent

SEEN = []

class RecordingAgent(AenvAgent):
    async def run(self, data, **kw):
        SEEN.append(bool(kw.get("is_eval")))
        return await super().run(data, **kw)
"""


def _write_config(tmp_path: Path, model_path: str, url: str) -> Path:
    example = yaml.safe_load((ROOT / "examples/aenv/config.yaml").read_text())
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(x) + "\n" for x in TRAIN))
    (tmp_path / "valid.jsonl").write_text("".join(json.dumps(x) + "\n" for x in VALID))
    (tmp_path / "new.jsonl").write_text("".join(json.dumps(x) + "\n" for x in NEW))
    (tmp_path / "agent.py").write_text(AGENT)
    cfg = {
        **example,
        "trial_name": "evalrun",
        "fileroot": str(tmp_path / "out"),
        "model": {"path": model_path},
        "rollout": {**example["rollout"], "batch_size": 1, "n_samples": 2},
        "trainer": {
            **example["trainer"],
            "total_train_steps": 1,
            "progress": False,
            "recover": "off",
        },
        "train_dataset": str(tmp_path / "train.jsonl"),
        "valid_dataset": str(tmp_path / "valid.jsonl"),
        "extra_valid_datasets": {"rephrased": str(tmp_path / "new.jsonl")},
        "workflow": str(tmp_path / "agent.py") + ":RecordingAgent",
    }
    cfg["workflow_kwargs"]["aenv_config"]["aenv_url"] = url
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_trainer_evaluates_before_and_after_and_cli_evaluates_checkpoints(
    tmp_path, model_path, aenv_server, capsys
):
    from areal_env.api.config import ExperimentConfig, load_config
    from areal_env.api.imports import load_file_module
    from areal_env.trainer.eval import read_eval_log, read_eval_summary
    from areal_env.trainer.eval_cli import main as eval_main
    from areal_env.trainer.ppo import PPOTrainer

    config = _write_config(tmp_path, model_path, aenv_server.url)
    cfg = load_config(ExperimentConfig, config)
    with PPOTrainer(cfg) as trainer:
        final = trainer.train()
    run_dir = Path(final["run_dir"])
    evals = read_eval_log(run_dir)
    assert [e["step"] for e in evals] == [0, 1]
    for e in evals:
        # the extra held-out set is evaluated in the same rollout and reported apart
        assert e["rephrased/n"] == 2 and 0.0 <= e["rephrased/success_rate"] <= 1.0
        assert e["n"] == 3 and 0.0 <= e["success_ci_low"] <= e["success_rate"]
        assert e["success_rate"] <= e["success_ci_high"] <= 1.0
        assert e["turns_mean"] >= 1.0 and e["valid_tool_call_rate"] > 0  # `required` first turn
    before = read_eval_summary(run_dir, evals[0]["version"])
    assert before is not None and set(before.outcomes) == {v["task_id"] for v in VALID}
    assert set(before.extra["rephrased"].outcomes) == {v["task_id"] for v in NEW}
    dumps = sorted((run_dir / "eval-rollout" / "0").glob("valid-*.jsonl"))
    assert len(dumps) == 3
    line = json.loads(dumps[0].read_text().splitlines()[0])
    assert line["prompt"] and "success" in line and line["tool_calls"]
    assert "eval/first" in final and "eval/p_value" in final
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert "eval/success_rate" in metrics[-1] and "eval/rephrased/success_rate" in metrics[-1]
    assert (run_dir / "reward_curve.png").is_file()
    # The agent was told which episodes were evaluations: 3 + 2 before, 3 + 2 after, 2 training
    # per batch drawn (the example config redraws a batch in which no episode was right).
    seen = load_file_module(tmp_path / "agent.py").SEEN
    batches = 1 + int(metrics[-1]["rollout/redrawn"])
    assert sorted(seen) == [False] * 2 * batches + [True] * 10

    for checkpoint, label in ((str(run_dir), "step_1"), (None, "base")):
        argv = [str(config), "--json", "--limit", "2"]
        if checkpoint:
            argv += ["--checkpoint", checkpoint]
        assert eval_main(argv) == 0
        out = capsys.readouterr().out
        assert "success rate" in out and "valid tool calls" in out
        result = json.loads(out.strip().splitlines()[-1])
        assert result["n"] == 2
        summary = run_dir / f"eval-{label}" / "eval-rollout" / str(result["version"])
        assert (summary / "summary.json").is_file()
    assert json.loads(out.strip().splitlines()[-1])["version"] == 0  # the base model


def test_eval_cli_errors(tmp_path, capsys):
    from areal_env.trainer.eval_cli import main as eval_main

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"workflow": "areal_env.AenvAgent"}))
    assert eval_main([str(cfg)]) == 2
    assert "valid_dataset" in capsys.readouterr().err
    (tmp_path / "v.jsonl").write_text('{"question": "1+1?", "answer": 2}\n')
    assert (
        eval_main([str(cfg), "--dataset", str(tmp_path / "v.jsonl"), "--checkpoint", "nope"]) == 2
    )
    assert "does not exist" in capsys.readouterr().err
