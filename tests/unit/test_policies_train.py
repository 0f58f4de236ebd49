"""Issue 27, training several policies end to end (real model, engine, proxy, SDKs): an agent
calls two LoRA policies in one session (the planner through the OpenAI SDK, the writer through
the Anthropic SDK, continuing the planner's conversation); every step updates each on its own
rows and pushes only its adapter; a run killed with SIGKILL resumes with both policies as the
checkpoint saved them; ``areal-env serve`` answers both names; ``areal-env eval`` reports each."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import torch
import yaml

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

# Each completion is rewarded by the parity of its reply's length (varies within a group).
AGENT = """
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

class TwoRoles:
    async def run(self, data, *, base_url, api_key, http_client=None, **_):
        oai = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client,
                          max_retries=0)
        plan = await oai.chat.completions.create(
            model="planner", messages=[{"role": "user", "content": data["prompt"]}],
            max_tokens=6, temperature=1.0)
        text = plan.choices[0].message.content or "..."
        claude = AsyncAnthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key,
                                max_retries=0)
        msgs = [{"role": "user", "content": data["prompt"]},
                {"role": "assistant", "content": text},
                {"role": "user", "content": "Say it again, shorter."}]
        written = await claude.messages.create(model="writer", max_tokens=6, messages=msgs)
        reply = "".join(b.text for b in written.content if b.type == "text")
        await claude.close()
        return {plan.id: float(len(text) % 2), written.id: float(len(reply) % 2)}
"""

DATA = [{"id": f"t{i}", "prompt": f"Say something about the number {i}."} for i in range(6)]


def _write_run(tmp_path: Path, steps: int) -> Path:
    (tmp_path / "agent.py").write_text(AGENT)
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(x) + "\n" for x in DATA))
    cfg = {
        "experiment_name": "team",
        "trial_name": "t",
        "fileroot": str(tmp_path / "out"),
        "seed": 3,
        "model": {"num_threads": 1},
        "policies": {"planner": {"lr": 2e-3}, "writer": {"lr": 1e-3}},
        "actor": {"lora": {"r": 4, "alpha": 8}, "ppo_n_minibatches": 1},
        "rollout": {"batch_size": 2, "n_samples": 2, "discount": 0.0},
        "gconfig": {"max_new_tokens": 6},
        "trainer": {
            "total_train_steps": steps,
            "save_freq_steps": 1,
            "recover": "auto",
            "progress": False,
            "tensorboard": False,
            "eval_before_training": False,
        },
        "workflow": "agent.py:TwoRoles",
        "train_dataset": "data.jsonl",
        "valid_dataset": "data.jsonl",
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(config: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != "AREAL_ENV_FAULT"}
    return subprocess.run(
        [sys.executable, "-m", "areal_env.cli", "train", str(config)],
        cwd=REPO,
        env={**clean, "PYTHONUNBUFFERED": "1", **env},
        capture_output=True,
        text=True,
        timeout=900,
    )


def _adapter_files(step: Path) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return {
        name: load_file(str(step / "policies" / name / "model" / "adapter_model.safetensors"))
        for name in ("planner", "writer")
    }


@pytest.mark.timeout(2400)
def test_two_policies_train_resume_after_kill_serve_and_eval(tmp_path):
    from areal_env.api.config import ExperimentConfig, load_config
    from areal_env.trainer.ppo import PPOTrainer

    config = _write_run(tmp_path, steps=2)
    run_dir = tmp_path / "out" / "team" / "t"
    ckpts = run_dir / "checkpoints"

    # 1. train step 1 (checkpointed), then SIGKILL with step 2's batch rolled out, not trained
    first = _train(config, AREAL_ENV_FAULT="kill_before_update@2")
    assert first.returncode == -signal.SIGKILL, first.stderr[-4000:]
    step1 = ckpts / "step_1"
    state = json.loads((step1 / "trainer_state.json").read_text())
    assert sorted(state["policies"]) == ["planner", "writer"]
    for name in ("planner", "writer"):
        folder = step1 / "policies" / name
        assert (folder / "state").is_dir() and (folder / "model" / "adapter_config.json").is_file()
        assert state["policies"][name]["kind"] == "adapter"
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == [1]
    m1 = metrics[0]
    for name in ("planner", "writer"):  # each policy trained on its own rows
        assert m1[f"policy/{name}/rows"] >= 1 and f"policy/{name}/reward/mean" in m1
    updated = [n for n in ("planner", "writer") if m1.get(f"policy/{n}/actor/updated")]
    assert updated, "no policy had a reward signal in step 1 (parity rewards all equal)"
    for name in updated:
        assert state["policies"][name]["update_count"] == 1
        assert 0 < m1[f"policy/{name}/push_bytes"] < 2_000_000  # the adapter alone
    # the token record (areal-env view): a part per policy, every row linked to its session
    from areal_env.view.tokens import TokenRecords

    records = TokenRecords(run_dir)
    records.refresh()
    parts = records.parts_of(1)
    assert len(parts) == 2, [p.index for p in parts]
    assert all(s["session_id"] for p in parts for s in p.sessions)
    dumps = [
        json.loads(line)
        for f in (run_dir / "rollout").glob("*/*.jsonl")
        for line in f.read_text().splitlines()
    ]
    sessions: dict[str, list[dict]] = {}
    for rec in dumps:
        sessions.setdefault(rec["session_id"], []).append(rec)
    assert len(sessions) == 4  # 2 tasks x 2 samples
    for lines in sessions.values():  # both policies, the writer spliced onto the planner
        assert [x["policy"] for x in lines] == ["planner", "writer"]
        assert lines[1]["spliced"] and lines[1]["parent_id"] == lines[0]["interaction_id"]

    # 2. recovery restores both adapters (and their optimisers) bitwise
    saved = _adapter_files(step1)
    cfg = load_config(ExperimentConfig, config)
    trainer = PPOTrainer(cfg)
    try:
        from areal_env.trainer.dist import SINGLE

        trainer.dist = SINGLE
        restored = trainer._set_up_models()
        assert restored is not None and restored.step == 1
        for name in ("planner", "writer"):
            actor = trainer.policies[name].actor
            live = {
                k.replace(f".lora_A.{name}.", ".lora_A.").replace(f".lora_B.{name}.", ".lora_B."): v
                for k, v in actor.adapter_state_dict().items()
            }
            assert live.keys() == saved[name].keys()
            assert all(torch.equal(live[k], saved[name][k]) for k in live)
            if name in updated:  # its optimiser's moments came back too
                moments = [s["exp_avg"] for s in actor.optimizer.state.values()]
                assert moments and any(float(m.abs().sum()) > 0 for m in moments)
        assert trainer.engine.adapter_names == ["planner", "writer"]  # pushed to the engine
    finally:
        trainer.close()

    # 3. the resumed run finishes step 2
    second = _train(config)
    assert second.returncode == 0, second.stderr[-4000:]
    assert f"recovered from {step1}" in second.stderr
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == [1, 2]
    final = json.loads((ckpts / "step_2" / "trainer_state.json").read_text())
    assert final["version"] == metrics[-1]["version"]
    evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert "policy/planner/success_rate" in evals[-1] and "team/success_rate" in evals[-1]

    # 4. serving the checkpoint answers both names (and no other)
    from areal_env.service.inference import serve_checkpoint

    svc = serve_checkpoint(run_dir, port=0, block=False)
    try:
        client = openai.OpenAI(base_url=svc.base_url + "/v1", api_key="none", max_retries=0)
        assert sorted(m.id for m in client.models.list().data) == ["planner", "writer"]
        for name in ("planner", "writer"):
            r = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
            assert r.model == name and r.choices[0].message.content is not None
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(
                model="critic", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
    finally:
        svc.stop()

    # 5. evaluating the checkpoint reports each policy
    from areal_env.trainer.eval import arun_evaluation, format_result

    result = asyncio.run(
        arun_evaluation(cfg, DATA[:2], checkpoint=run_dir, out_dir=tmp_path / "ev")
    )
    assert result.version == final["version"]
    for name in ("planner", "writer"):
        assert result.metrics[f"policy/{name}/turns_mean"] == 1.0
    assert "policy planner" in format_result(result)
