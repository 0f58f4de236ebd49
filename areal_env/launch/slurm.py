"""An sbatch script for ``areal-env launch`` on Slurm: one task per node, each running
``areal-env launch --nnodes N --node-rank $SLURM_NODEID --master-addr <first node>``, so node 0
starts the inference servers (on the GPUs the config's servers take) and every node its torchrun
ranks (the remaining GPUs)."""

from __future__ import annotations

import shlex
import subprocess
import sys

from areal_env.api.config import ExperimentConfig


def sbatch_script(
    cfg: ExperimentConfig,
    *,
    config_path: str,
    overrides: list[str],
    nnodes: int,
    nproc_per_node: int,
    gpus_per_node: int,
    master_port: int = 29500,
) -> str:
    """The script text. Server GPUs come first on node 0 (``CUDA_VISIBLE_DEVICES``), the trainer
    ranks take the next ``nproc_per_node`` GPUs on every node. ``gpus_per_node=0``: CPU nodes
    (no ``--gpus-per-node``, no GPU split)."""
    sg = cfg.engine.sglang
    server_gpus = (
        0 if (cfg.engine.backend != "sglang" or sg.addresses) else sg.num_servers * sg.tp_size
    )
    if gpus_per_node and server_gpus + nproc_per_node > gpus_per_node:
        raise ValueError(
            f"{sg.num_servers} server(s) x tp {sg.tp_size} + {nproc_per_node} trainer ranks need "
            f"{server_gpus + nproc_per_node} GPUs per node; the node has {gpus_per_node}"
        )
    run_dir = cfg.run_dir
    launch = [
        sys.executable,
        "-m",
        "areal_env.cli",
        "launch",
        config_path,
        *overrides,
        f"--nproc-per-node={nproc_per_node}",
        f"--nnodes={nnodes}",
        f"--master-port={master_port}",
    ]
    trainer_gpus = ",".join(str(g) for g in range(server_gpus, server_gpus + nproc_per_node))
    all_gpus = ",".join(str(g) for g in range(server_gpus + nproc_per_node))
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=areal-env-{cfg.experiment_name}",
        f"#SBATCH --nodes={nnodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={gpus_per_node}" if gpus_per_node else "",
        f"#SBATCH --output={run_dir}/slurm-%j.out",
        "set -euo pipefail",
        'export HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "# node 0: servers on the first GPUs, trainer ranks on the next; other nodes: ranks only",
        "srun --ntasks-per-node=1 bash -c '"
        + (
            'if [ "$SLURM_NODEID" = 0 ]; then export CUDA_VISIBLE_DEVICES='
            + all_gpus
            + "; else export CUDA_VISIBLE_DEVICES="
            + trainer_gpus
            + "; fi; "
            if gpus_per_node
            else ""  # CPU nodes: no GPUs to hand out
        )
        + "exec "
        + " ".join(shlex.quote(a) for a in launch)
        + ' --node-rank="$SLURM_NODEID" --master-addr="$HEAD"'
        + "'",
    ]
    return "\n".join(line for line in lines if line) + "\n"


def submit(script_path: str) -> str:
    """``sbatch SCRIPT``; returns sbatch's answer (``Submitted batch job N``)."""
    out = subprocess.run(["sbatch", script_path], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"sbatch {script_path} failed: {out.stderr.strip() or out.stdout}")
    return out.stdout.strip()
