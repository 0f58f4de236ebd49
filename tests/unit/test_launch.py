"""``areal-env launch``: servers + torchrun ranks end to end (kill a rank, resume), the
multi-node rehearsal (two torchrun invocations with --nnodes 2) and the Slurm script."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from areal_env.api.config import ExperimentConfig
from areal_env.api.config_load import config_from_dict
from areal_env.launch.slurm import sbatch_script
from tests.distributed.run import free_port, run_worker

REPO = Path(__file__).resolve().parents[2]

AGENT = """
from openai import AsyncOpenAI

class ParityAgent:
    async def run(self, data, *, base_url, api_key, http_client=None, **_):
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, http_client=http_client)
        r = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": data["prompt"]}],
            max_tokens=6, temperature=1.0)
        return float(len(r.choices[0].message.content or "") % 2)
"""


def test_sbatch_script_splits_gpus_and_runs_one_launch_per_node(tmp_path):
    cfg = config_from_dict(
        ExperimentConfig,
        {
            "experiment_name": "big",
            "fileroot": str(tmp_path),
            "engine": {"backend": "sglang", "sglang": {"num_servers": 2}},
        },
    )
    text = sbatch_script(
        cfg,
        config_path="/shared/cfg.yaml",
        overrides=["rollout.n_samples=8"],
        nnodes=2,
        nproc_per_node=6,
        gpus_per_node=8,
    )
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=8" in text
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7" in text  # node 0: 2 servers + 6 ranks
    assert "CUDA_VISIBLE_DEVICES=2,3,4,5,6,7" in text  # other nodes: the ranks' GPUs
    assert "--nproc-per-node=6" in text and '--node-rank="$SLURM_NODEID"' in text
    assert "rollout.n_samples=8" in text
    assert "export HEAD=" in text  # the srun shell must see it
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    with pytest.raises(ValueError, match="GPUs per node"):
        sbatch_script(
            cfg, config_path="c", overrides=[], nnodes=1, nproc_per_node=7, gpus_per_node=8
        )


@pytest.mark.slow
@pytest.mark.extended
def test_multi_node_rehearsal_two_torchrun_invocations(tmp_path, model_path):
    """Two torchrun invocations (--nnodes 2, one rank each) on 127.0.0.1 run one FSDP step
    together, and it equals the 1-process step."""
    port = free_port()
    common = ["--model", model_path, "--steps", "sgd", "--strategy", "fsdp"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = []
    for node in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc-per-node=1",
            f"--node-rank={node}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            "-m",
            "tests.distributed.step_worker",
            *common,
            "--out",
            str(tmp_path / f"node{node}"),
        ]
        procs.append(
            subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    results = [json.loads(x[7:]) for o in outs for x in o.splitlines() if x.startswith("RESULT ")]
    assert sorted((r["rank"], r["world_size"]) for r in results) == [(0, 2), (1, 2)]
    (single,) = run_worker(
        [
            "--model",
            model_path,
            "--steps",
            "sgd",
            "--strategy",
            "single",
            "--out",
            str(tmp_path / "s"),
        ]
    )
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "s" / "0_sgd.st"))
    b = load_file(str(tmp_path / "node0" / "0_sgd.st"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5


def _rank_pid(rank: int, marker: str) -> int | None:
    """The pid of the trainer process with RANK=rank whose command line names ``marker``."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker in cmd and "areal_env.cli train" in cmd and f"RANK={rank}".encode() in env:
            return int(d.name)
    return None


def launch_cmd(config: Path, nproc: int = 2) -> list[str]:
    """``areal-env launch CONFIG`` with ``nproc`` ranks on a free rendezvous port."""
    return [
        sys.executable,
        "-m",
        "areal_env.cli",
        "launch",
        str(config),
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
    ]


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.extended
def test_launch_servers_and_ranks_kill_a_rank_then_resume(tmp_path):
    """2 ``areal-env serve`` servers + 2 FSDP ranks train; killing rank 1 stops the whole job
    with a clear message and no orphans; launching again resumes from the sharded checkpoint."""
    (tmp_path / "agent.py").write_text(AGENT)
    data = [{"id": f"t{i}", "prompt": f"Say something about {i}."} for i in range(8)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(x) + "\n" for x in data))
    cfg = {
        "experiment_name": "launch",
        "trial_name": "t",
        "fileroot": str(tmp_path / "out"),
        "seed": 3,
        "rollout": {"batch_size": 2, "n_samples": 2},
        "gconfig": {"max_new_tokens": 6},
        "actor": {"ppo_n_minibatches": 1},
        "engine": {"backend": "sglang", "sglang": {"num_servers": 2, "base_port": 0}},
        "trainer": {"total_train_steps": 3, "save_freq_steps": 1, "progress": False},
        "workflow": "agent.py:ParityAgent",
        "train_dataset": "data.jsonl",
    }
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "out" / "launch" / "t"
    cmd = launch_cmd(config)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    log = (tmp_path / "run1.log").open("w")
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 900
        while not (run_dir / "checkpoints" / "step_1" / "trainer_state.json").is_file():
            assert p.poll() is None, (tmp_path / "run1.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "no checkpoint within 900 s"
            time.sleep(1)
        victim = _rank_pid(1, str(config))
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        rc = p.wait(300)
    finally:
        if p.poll() is None:
            p.kill()
    text = (tmp_path / "run1.log").read_text()
    assert rc != 0 and "the trainer exited with code" in text
    assert _rank_pid(0, str(config)) is None  # no trainer rank left behind
    serve_left = subprocess.run(
        ["pgrep", "-f", f"areal_env.cli serve.*{tmp_path}"], capture_output=True, check=False
    )
    assert serve_left.stdout.strip() == b""

    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "recovered from" in out.stderr
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    trained = [r for r in records if r.get("actor/update_skipped") == 0.0]
    for r in trained:
        assert r["dist/world_size"] == 2.0
        assert 0 < r["dist/rank0_rows"] < r["actor/rows"]  # rows were split across ranks
    assert records[-1]["version"] == len(trained)  # every server took every push
    state = run_dir / "checkpoints" / "step_3" / "state"
    assert len(list(state.glob("*.distcp"))) == 2  # one shard file per rank


def _slurm_up() -> bool:
    import shutil

    if not shutil.which("sbatch") or not shutil.which("sinfo"):
        return False
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, check=False)
    return out.returncode == 0 and "idle" in out.stdout


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(not _slurm_up(), reason="no Slurm cluster with an idle node is reachable")
def test_slurm_sbatch_runs_a_training_step(tmp_path):
    """``areal-env launch --slurm --submit`` on a real (single-node) Slurm: sbatch → srun →
    areal-env launch → torchrun → one FSDP training step with the embedded engine."""
    (tmp_path / "agent.py").write_text(AGENT)
    data = [{"id": f"t{i}", "prompt": f"Say something about {i}."} for i in range(4)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(x) + "\n" for x in data))
    cfg = {
        "experiment_name": "slurm",
        "trial_name": "t",
        "fileroot": str(tmp_path / "out"),
        "rollout": {"batch_size": 2, "n_samples": 2},
        "gconfig": {"max_new_tokens": 4},
        "actor": {"ppo_n_minibatches": 1},
        "model": {"num_threads": 1},
        "trainer": {"total_train_steps": 1, "progress": False},
        "workflow": str(tmp_path / "agent.py") + ":ParityAgent",
        "train_dataset": str(tmp_path / "data.jsonl"),
    }
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    script = tmp_path / "job.sbatch"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "areal_env.cli",
            "launch",
            str(config),
            "--slurm",
            str(script),
            "--submit",
            "--gpus-per-node=0",
            "--nproc-per-node=1",
            f"--master-port={free_port()}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    job = out.stdout.strip().split()[-1]
    assert job.isdigit(), out.stdout
    run_dir = tmp_path / "out" / "slurm" / "t"
    deadline = time.monotonic() + 1000
    while time.monotonic() < deadline:
        q = subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True)
        if not q.stdout.strip():
            break
        time.sleep(3)
    else:
        subprocess.run(["scancel", job], check=False)
        pytest.fail("the Slurm job did not finish")
    log = (run_dir / f"slurm-{job}.out").read_text()
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1], log[-3000:]
    assert (run_dir / "checkpoints" / "step_1" / "state").is_dir()
