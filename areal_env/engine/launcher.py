"""Launch inference servers as subprocesses and make sure they never outlive us.

By default each server is ``python -m sglang.launch_server --model-path ... --tp-size ...
--host ... --port ...`` (plus extra args); ``command`` replaces the ``python -m
sglang.launch_server`` part, e.g. ``["areal-env", "serve"]`` for the embedded engine on CPU
machines (it accepts the same flags).

Every server runs in its own process group with its output in a log file. They are torn down:

- by ``ServerGroup.stop()`` (SIGTERM to the group, SIGKILL after a grace period);
- at interpreter exit, including Ctrl-C (``atexit``) and SIGTERM (a handler that exits cleanly,
  installed when the main thread launches and no handler was set);
- when this process dies without cleaning up (SIGKILL, crash): the kernel sends the server
  SIGTERM (``PR_SET_PDEATHSIG`` on Linux) and a small watchdog process kills the whole group.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from areal_env.http import routes
from areal_env.http.net import port_is_free

if TYPE_CHECKING:
    from areal_env.api.config import ExperimentConfig

logger = logging.getLogger(__name__)

SGLANG_COMMAND = (sys.executable, "-m", "sglang.launch_server")
PORT_STRIDE = 10  # SGLang takes a few ports next to --port for its internal channels


class LaunchError(RuntimeError):
    """A server exited or did not become healthy; the message has its log's last lines."""


@dataclass
class ServerProcess:
    """One launched server."""

    address: str
    proc: subprocess.Popen
    log_path: Path
    command: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


_LIVE_GROUPS: weakref.WeakSet[ServerGroup] = weakref.WeakSet()
_HOOKS_INSTALLED = False
_HOOKS_LOCK = threading.Lock()


class ServerGroup:
    """Servers launched together; ``stop()`` (idempotent) tears all of them down."""

    def __init__(self, servers: list[ServerProcess], watchdog: subprocess.Popen | None = None):
        self.servers = servers
        self._watchdog = watchdog
        self._stopped = False
        _LIVE_GROUPS.add(self)

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers]

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM every server's process group; SIGKILL what is left after ``grace`` seconds."""
        if self._stopped:
            return
        self._stopped = True
        for s in self.servers:
            _signal_group(s.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for s in self.servers:
            try:
                s.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("server %s ignored SIGTERM; killing it", s.address)
            _signal_group(s.proc, signal.SIGKILL)  # also reaps the group's stragglers
            with contextlib.suppress(subprocess.TimeoutExpired):
                s.proc.wait(timeout=5)
        if self._watchdog is not None and self._watchdog.poll() is None:
            self._watchdog.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._watchdog.wait(timeout=5)
        _LIVE_GROUPS.discard(self)
        logger.info("stopped %d server(s)", len(self.servers))

    def __enter__(self) -> ServerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal the server's process group (it leads its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _stop_all() -> None:
    for group in list(_LIVE_GROUPS):
        with contextlib.suppress(Exception):
            group.stop(grace=5.0)


def _install_exit_hooks() -> None:
    """atexit always; a SIGTERM handler only from the main thread and if none was set."""
    global _HOOKS_INSTALLED
    with _HOOKS_LOCK:
        if _HOOKS_INSTALLED:
            return
        _HOOKS_INSTALLED = True
    atexit.register(_stop_all)
    if threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):

            def on_sigterm(signum: int, frame: object) -> None:
                _stop_all()
                raise SystemExit(128 + signum)

            signal.signal(signal.SIGTERM, on_sigterm)


def _parent_death_preexec() -> None:
    """In the child: SIGTERM when the launching thread dies (Linux ``PR_SET_PDEATHSIG``)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


def _start_watchdog(pids: list[int]) -> subprocess.Popen | None:
    """A tiny process that kills the servers' groups if we die without stopping them."""
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "areal_env.engine.launcher", "--watch", str(os.getpid())]
            + [str(p) for p in pids],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError as e:
        logger.warning("could not start the server watchdog: %s", e)
        return None


def _watch(parent: int, pgids: list[int]) -> int:
    """Watchdog loop: once ``parent`` is gone, SIGTERM then SIGKILL every group; exit when done."""

    def exists(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def group_exists(pgid: int) -> bool:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    while os.getppid() == parent and exists(parent):  # reparented once the parent is gone
        if not any(group_exists(g) for g in pgids):
            return 0
        time.sleep(0.5)
    for g in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(g, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(group_exists(g) for g in pgids):
        time.sleep(0.2)
    for g in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(g, signal.SIGKILL)
    return 0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _pick_ports(host: str, base_port: int, n: int) -> list[int]:
    ports: list[int] = []
    candidate = base_port
    while len(ports) < n:
        if base_port == 0:
            port = free_port(host)
            if port not in ports:
                ports.append(port)
            continue
        if candidate > 65535:
            raise LaunchError(f"no free port at or above {base_port}")
        if port_is_free(host, candidate):
            ports.append(candidate)
            candidate += PORT_STRIDE
        else:
            candidate += 1
    return ports


def wait_healthy(
    server: ServerProcess, timeout: float, *, path: str = routes.HEALTH_GENERATE, poll: float = 0.5
) -> None:
    """Poll ``GET path`` until HTTP 200; fail fast (with the log tail) if the process exits."""
    deadline = time.monotonic() + timeout
    url = f"http://{server.address}{path}"
    with httpx.Client(trust_env=False, timeout=httpx.Timeout(30.0, connect=2.0)) as client:
        while True:
            if not server.alive():
                raise LaunchError(
                    f"server {server.address} exited with code {server.proc.returncode} during "
                    f"startup; log {server.log_path}:\n{server.log_tail()}"
                )
            try:
                if client.get(url).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"server {server.address} not healthy after {timeout:.0f} s; "
                    f"log {server.log_path}:\n{server.log_tail()}"
                )
            time.sleep(poll)


def launch_servers(
    model_path: str,
    *,
    num_servers: int = 1,
    tp_size: int = 1,
    host: str = "127.0.0.1",
    base_port: int = 30000,
    extra_args: Sequence[str] = (),
    log_dir: str | os.PathLike[str] | None = None,
    startup_timeout: float = 600.0,
    command: Sequence[str] | None = None,
    env: dict[str, str] | None = None,
    assign_gpus: bool | None = None,
    health_path: str = routes.HEALTH_GENERATE,
) -> ServerGroup:
    """Start ``num_servers`` servers, wait until all are healthy, return their ``ServerGroup``.

    ``command`` replaces ``python -m sglang.launch_server``. With ``assign_gpus`` (default: when
    launching real SGLang with several servers), server ``i`` sees GPUs ``i*tp .. i*tp+tp-1`` of
    ``CUDA_VISIBLE_DEVICES``. On any failure every server already started is stopped.
    """
    if num_servers < 1 or tp_size < 1:
        raise ValueError("num_servers and tp_size must be >= 1")
    prefix = list(command) if command else list(SGLANG_COMMAND)
    if assign_gpus is None:
        assign_gpus = command is None and num_servers > 1
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="areal-env-servers-"))
    logs.mkdir(parents=True, exist_ok=True)
    base_env = dict(os.environ if env is None else env)
    visible = [g for g in base_env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    ports = _pick_ports(host, base_port, num_servers)
    _install_exit_hooks()
    use_pdeathsig = threading.current_thread() is threading.main_thread()
    servers: list[ServerProcess] = []
    group = ServerGroup(servers)
    try:
        for i, port in enumerate(ports):
            cmd = prefix + [
                "--model-path",
                str(model_path),
                "--tp-size",
                str(tp_size),
                "--host",
                host,
                "--port",
                str(port),
                *extra_args,
            ]
            child_env = dict(base_env)
            if assign_gpus:
                ids = [str(g) for g in range(i * tp_size, (i + 1) * tp_size)]
                if visible:
                    if len(visible) < (i + 1) * tp_size:
                        raise LaunchError(
                            f"{num_servers} servers x tp {tp_size} need "
                            f"{num_servers * tp_size} GPUs; CUDA_VISIBLE_DEVICES has {len(visible)}"
                        )
                    ids = visible[i * tp_size : (i + 1) * tp_size]
                child_env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
            log_path = logs / f"server-{i}-{port}.log"
            log_file = open(log_path, "ab")  # noqa: SIM115 - the child owns it from here
            logger.info("launching server %d: %s (log %s)", i, shlex.join(cmd), log_path)
            try:
                proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    env=child_env,
                    start_new_session=True,  # own process group: stop() signals the whole tree
                    # pdeathsig fires when the launching *thread* exits: only from the main thread.
                    preexec_fn=_parent_death_preexec if use_pdeathsig else None,  # noqa: PLW1509
                )
            finally:
                log_file.close()
            servers.append(ServerProcess(f"{host}:{port}", proc, log_path, cmd))
        group._watchdog = _start_watchdog([s.pid for s in servers])
        deadline = time.monotonic() + startup_timeout
        for s in servers:
            wait_healthy(s, max(1.0, deadline - time.monotonic()), path=health_path)
    except BaseException:
        group.stop(grace=5.0)
        raise
    logger.info("%d server(s) healthy: %s", len(servers), group.addresses)
    return group


def lora_serving_args(cfg: ExperimentConfig) -> list[str]:
    """SGLang's flags for serving the run's adapter policies by name (none without them):
    LoRA on, memory sized for the largest rank, the union of their target modules, and room
    for every adapter in one batch."""
    shapes = [cfg.policy_actor(n).lora for n, p in cfg.policies.items() if p.is_adapter]
    loras = [lora for lora in shapes if lora is not None]
    if not loras:
        return []
    modules = sorted({m for lora in loras for m in lora.target_modules})
    return [
        "--enable-lora",
        "--max-lora-rank",
        str(max(lora.r for lora in loras)),
        "--lora-target-modules",
        *modules,
        "--max-loras-per-batch",
        str(max(8, len(loras))),
    ]


def launch_from_config(cfg: ExperimentConfig) -> ServerGroup:
    """Launch the servers described by ``cfg.engine.sglang`` for ``cfg.model``."""
    from areal_env.engine.models import ModelNotFoundError, resolve_model_path

    sg = cfg.engine.sglang
    try:
        model_path = str(resolve_model_path(cfg.model.path, cfg.model.cache_dir))
    except ModelNotFoundError:
        model_path = cfg.model.path  # e.g. a hub id: SGLang downloads it on the GPU machine
    args: list[str] = []
    dtype = cfg.engine.served_dtype(cfg.model)
    if dtype != "auto":
        args += ["--dtype", dtype]
    if cfg.model.max_context_len:
        args += ["--context-length", str(cfg.model.max_context_len)]
    if sg.mem_fraction_static is not None:
        args += ["--mem-fraction-static", str(sg.mem_fraction_static)]
    args += lora_serving_args(cfg)
    args += list(sg.extra_args)
    return launch_servers(
        model_path,
        num_servers=sg.num_servers,
        tp_size=sg.tp_size,
        host=sg.host,
        base_port=sg.base_port,
        extra_args=args,
        log_dir=sg.log_dir or (cfg.run_dir / "logs" / "servers"),
        startup_timeout=sg.startup_timeout,
        command=list(sg.launch_command) or None,
    )


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--watch":
        sys.exit(_watch(int(sys.argv[2]), [int(p) for p in sys.argv[3:]]))
    print("usage: python -m areal_env.engine.launcher --watch PARENT_PID PGID...", file=sys.stderr)
    sys.exit(2)
