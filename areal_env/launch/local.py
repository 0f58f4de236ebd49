"""``areal-env launch CONFIG.yaml``: start the inference servers, wait for them, then run the
trainer ranks under ``torchrun``; stop everything on exit, on Ctrl-C and when a rank fails.

The servers are the config's ``engine.sglang`` servers (real SGLang on GPUs; ``areal-env serve``
when ``engine.sglang.launch_command`` says so, or on a machine without CUDA). The trainer is
``torchrun ... -m areal_env.cli train CONFIG actor.strategy=fsdp`` with the servers' addresses
passed as ``engine.sglang.addresses``, so rank 0 pushes weights to exactly these servers.
Servers come from ``areal_env.engine.launcher`` (own process groups, killed even if this
process is SIGKILLed); torchrun runs in its own process group and is stopped as a group.

Several nodes: run the same command on every node with ``--nnodes N --node-rank R
--master-addr HOST``; node 0 starts the servers (``--no-servers`` elsewhere is implied), every
node starts its torchrun. ``--slurm`` writes (and with ``--submit`` submits) an sbatch script
doing exactly that under ``srun``.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from areal_env.api.cli_args import experiment_parser, load_experiment
from areal_env.api.config import ExperimentConfig

logger = logging.getLogger(__name__)

SERVE_COMMAND = [sys.executable, "-m", "areal_env.cli", "serve"]


@dataclass
class LaunchPlan:
    """What one node runs: its servers (node 0 only) and its torchrun command."""

    config_path: str
    overrides: list[str]
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    start_servers: bool = True
    extra_env: dict[str, str] = field(default_factory=dict)

    def torchrun_command(self, server_addresses: list[str]) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={self.nproc_per_node}",
            f"--nnodes={self.nnodes}",
            f"--node-rank={self.node_rank}",
            f"--master-addr={self.master_addr}",
            f"--master-port={self.master_port}",
            "-m",
            "areal_env.cli",
            "train",
            self.config_path,
            *self.overrides,
            "actor.strategy=fsdp",
        ]
        if server_addresses:
            cmd.append("engine.sglang.addresses=[" + ",".join(server_addresses) + "]")
        return cmd


def _server_command(cfg: ExperimentConfig) -> list[str] | None:
    """The configured launch command, else ``areal-env serve`` where CUDA is missing."""
    if cfg.engine.sglang.launch_command:
        return list(cfg.engine.sglang.launch_command)
    try:
        import torch

        if torch.cuda.is_available():
            return None  # real SGLang
    except ImportError:  # pragma: no cover - torch ships with areal-env
        pass
    return SERVE_COMMAND


def start_servers(cfg: ExperimentConfig):  # -> ServerGroup | None
    """Launch ``cfg.engine.sglang`` servers unless the config lists running ones."""
    import dataclasses

    from areal_env.engine.launcher import launch_from_config

    if cfg.engine.backend != "sglang" or cfg.engine.sglang.addresses:
        return None
    command = _server_command(cfg)
    sg = dataclasses.replace(cfg.engine.sglang, launch_command=command or [])
    if command == SERVE_COMMAND and not sg.extra_args:
        sg = dataclasses.replace(sg, extra_args=["--num-threads", "1"])
    return launch_from_config(
        dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, sglang=sg))
    )


class Launch:
    """Runs a ``LaunchPlan``; ``stop()`` tears down the trainer group, then the servers."""

    def __init__(self, plan: LaunchPlan, cfg: ExperimentConfig) -> None:
        self.plan = plan
        self.cfg = cfg
        self.servers = None
        self.trainer: subprocess.Popen | None = None

    def run(self) -> int:
        if self.plan.start_servers and self.plan.node_rank == 0:
            self.servers = start_servers(self.cfg)
        addresses: list[str] = list(self.servers.addresses) if self.servers else []
        cmd = self.plan.torchrun_command(addresses)
        logger.info("starting the trainer ranks: %s", shlex.join(cmd))
        env = {**os.environ, **self.plan.extra_env}
        visible = [g for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
        if self.servers is not None and visible and _server_command(self.cfg) is None:
            # The servers took the first GPUs; the ranks get the ones after them.
            taken = self.cfg.engine.sglang.num_servers * self.cfg.engine.sglang.tp_size
            env["CUDA_VISIBLE_DEVICES"] = ",".join(visible[taken:])
        self.trainer = subprocess.Popen(cmd, env=env, start_new_session=True)
        while True:
            rc = self.trainer.poll()
            if rc is not None:
                break
            if self.servers is not None:
                dead = [s.address for s in self.servers.servers if not s.alive()]
                if len(dead) == len(self.servers.servers):
                    logger.error("every inference server died (%s): stopping the job", dead)
                    self._stop_trainer()
                    return 1
            time.sleep(0.5)
        if rc != 0:
            logger.error(
                "the trainer exited with code %d (a rank failed: its traceback is above); "
                "servers stopped. Run the same command again to resume from the last checkpoint.",
                rc,
            )
        return rc

    def _stop_trainer(self, grace: float = 20.0) -> None:
        proc = self.trainer
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        self._stop_trainer()
        if self.servers is not None:
            self.servers.stop()
            self.servers = None


def main(argv: list[str] | None = None) -> int:
    prog = "areal-env launch"
    ap = experiment_parser(prog, "Start inference servers, then the torchrun trainer ranks (FSDP).")
    ap.add_argument("--nproc-per-node", type=int, default=1, help="trainer ranks on this node")
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--node-rank", type=int, default=0)
    ap.add_argument("--master-addr", default="127.0.0.1", help="node 0's address")
    ap.add_argument("--master-port", type=int, default=29500)
    ap.add_argument("--no-servers", action="store_true", help="the config lists running servers")
    ap.add_argument("--slurm", metavar="SCRIPT", help="write an sbatch script instead of running")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="with --slurm")
    ap.add_argument("--submit", action="store_true", help="with --slurm: sbatch the script")
    args = ap.parse_args(argv)
    cfg = load_experiment(prog, args)
    if cfg is None:
        return 2
    if args.slurm:
        from areal_env.launch.slurm import sbatch_script, submit

        script = sbatch_script(
            cfg,
            config_path=str(Path(args.config).resolve()),
            overrides=args.overrides,
            nnodes=args.nnodes,
            nproc_per_node=args.nproc_per_node,
            gpus_per_node=args.gpus_per_node,
            master_port=args.master_port,
        )
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)  # Slurm writes its log there
        Path(args.slurm).write_text(script)
        print(f"wrote {args.slurm}")
        if args.submit:
            print(submit(args.slurm))
        return 0
    plan = LaunchPlan(
        config_path=args.config,
        overrides=list(args.overrides),
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        start_servers=not args.no_servers,
    )
    job = Launch(plan, cfg)
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        return job.run()
    except KeyboardInterrupt:
        logger.warning("interrupted: stopping the trainer ranks and the servers")
        return 130
    finally:
        job.stop()
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
