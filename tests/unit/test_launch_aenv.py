"""Issue 11 end to end: the real ``AenvAgent`` trained through ``areal-env launch`` with 2 FSDP
trainer ranks (torchrun, gloo) and 2 ``areal-env serve`` inference servers, on a real
aenvironment server (the example calculator environment) and the real SmolLM2-135M model.

Short on purpose (2 steps, 2 items x 2 samples, 24 new tokens): it proves the pieces fit —
rollout once on rank 0 through the proxy and both servers, tool calls on the real environment,
rows split across the ranks, every server loading each new version — not that the model learns.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.unit.test_launch import launch_cmd

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "examples" / "aenv" / "env_tools.py"
ITEMS = [
    {"task_id": "t0", "question": "What is 17 + 25? Use the add tool.", "answer": 42},
    {"task_id": "t1", "question": "What is 30 + 12? Use the add tool.", "answer": 42},
    {"task_id": "t2", "question": "What is 8 + 5? Use the add tool.", "answer": 13},
    {"task_id": "t3", "question": "What is 21 + 9? Use the add tool.", "answer": 30},
]
# what examples/aenv/env_tools.py:reward pays a completion: 1.0 for a right answer, 0.25 for
# each right call it made (CALL_CREDIT), summed
CALL_CREDIT = 0.25


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.extended
def test_launch_aenv_agent_two_ranks_two_servers(tmp_path):
    from areal_env.envs.aenv.launcher import AenvServerLauncher

    (tmp_path / "data.jsonl").write_text("".join(json.dumps(x) + "\n" for x in ITEMS))
    with AenvServerLauncher(TOOLS, num_servers=1, first_host=90, log_dir=tmp_path / "aenv") as env:
        cfg = {
            "experiment_name": "launch-aenv",
            "trial_name": "t",
            "fileroot": str(tmp_path / "out"),
            "seed": 5,
            "rollout": {"batch_size": 2, "n_samples": 2, "episode_timeout": 300},
            "gconfig": {"max_new_tokens": 24, "temperature": 1.0},
            # a small entropy bonus: the update runs even when a group's rewards are all equal
            "actor": {"ppo_n_minibatches": 1, "entropy_coef": 1e-4},
            "engine": {"backend": "sglang", "sglang": {"num_servers": 2, "base_port": 0}},
            "trainer": {
                "total_train_steps": 2,
                "save_freq_steps": 1,
                "progress": False,
                "tensorboard": False,
            },
            "workflow": "areal_env.AenvAgent",
            "workflow_kwargs": {
                "aenv_config": {
                    "env_name": "calculator@1.0.0",
                    "aenv_url": env.urls[0],
                    "retry_delay": 0.1,
                },
                "max_turns": 2,
                "max_tokens": 24,
                "temperature": 1.0,
                "first_turn_tool_choice": {"type": "function", "function": {"name": "add"}},
            },
            "train_dataset": "data.jsonl",
        }
        config = tmp_path / "config.yaml"
        config.write_text(yaml.safe_dump(cfg))
        run_dir = tmp_path / "out" / "launch-aenv" / "t"
        cmd = launch_cmd(config)
        env_vars = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        log_path = tmp_path / "launch.log"
        with log_path.open("w") as log:
            p = subprocess.Popen(cmd, cwd=REPO, env=env_vars, stdout=log, stderr=log)
        try:
            # once step 1 is checkpointed its weights were pushed: both servers report them
            deadline = time.monotonic() + 600
            step1 = run_dir / "checkpoints" / "step_1" / "trainer_state.json"
            while not step1.is_file():
                assert p.poll() is None, log_path.read_text()[-4000:]
                assert time.monotonic() < deadline, "no step-1 checkpoint within 600 s"
                time.sleep(0.5)
            found = re.search(r"engine\.sglang\.addresses=\[([^\]]+)\]", log_path.read_text())
            assert found, log_path.read_text()[-4000:]
            servers = found.group(1).split(",")
            assert len(servers) == 2
            version_1 = json.loads(step1.read_text())["version"]
            for addr in servers:
                got = httpx.get(f"http://{addr}/get_weight_version", timeout=10).json()
                assert int(got["weight_version"]) >= version_1 >= 1, (addr, got)
            rc = p.wait(600)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = log_path.read_text()
    assert rc == 0, text[-4000:]

    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    trained = [r for r in records if r.get("actor/update_skipped") == 0.0]
    assert trained, records
    for r in trained:
        assert r["dist/world_size"] == 2.0
        assert 0 < r["dist/rank0_rows"] < r["actor/rows"]  # rows were split across ranks
    assert records[-1]["version"] == len(trained)  # every server took every push
    assert sum(r["episodes/accepted"] for r in records) >= 4, records

    # the episodes ran the real environment: its tool results and its rewards
    lines = [
        json.loads(x)
        for f in sorted((run_dir / "rollout").rglob("*.jsonl"))
        for x in f.read_text().splitlines()
    ]
    assert {x["step"] for x in lines} == {1, 2}
    paid = [
        v
        for x in lines
        if x["accepted"]
        for v in (
            x["episode_reward"].values()
            if isinstance(x["episode_reward"], dict)
            else [x["episode_reward"]]
        )
    ]
    assert paid and all((v / CALL_CREDIT).is_integer() and 0 <= v <= 1.75 for v in paid), paid
    assert len(list((run_dir / "checkpoints" / "step_2" / "state").glob("*.distcp"))) == 2
