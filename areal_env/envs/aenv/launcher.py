"""Start and stop local aenvironment servers (``python -m aenv.main``) for training and tests.

The servers run from the aenvironment SDK (``aenvironment==0.1.7``) installed in a virtualenv of
its own, not in areal-env's: that SDK pins ``pydantic<2.12``, ``mcp<2`` and ``fastmcp<3``, which
would hold the core's SDKs back. ``find_aenv_python`` picks the interpreter (an explicit path,
``$AREAL_ENV_AENV_PYTHON``, ``.venv-aenv/bin/python`` in the project, or the current interpreter
if it has ``aenv``) and ``ensure_aenv_python`` creates ``.venv-aenv`` on first use.

The SDK hard-codes the data-plane port 8081, so each server gets its own loopback address
(127.0.0.N:8081; all of 127/8 is loopback on Linux). ``AenvServerLauncher`` picks free addresses,
waits until each server answers ``GET /functions/list``, writes each server's output to a log
file, and stops everything at ``stop()``, at ``with`` exit, and at interpreter exit.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import httpx
from filelock import FileLock

from areal_env.http.net import port_is_free

logger = logging.getLogger(__name__)

DATA_PORT = 8081
AENV_REQUIREMENT = "aenvironment==0.1.7"
AENV_PYTHON_ENV = "AREAL_ENV_AENV_PYTHON"
PROJECT_ROOT = Path(__file__).resolve().parents[3]
# a source checkout keeps it next to .venv; an installed package in the user's cache
DEFAULT_AENV_VENV = (
    PROJECT_ROOT / ".venv-aenv"
    if (PROJECT_ROOT / "pyproject.toml").exists()
    else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "areal-env" / "venv-aenv"
)
_live: weakref.WeakSet[AenvServerLauncher] = weakref.WeakSet()
_claimed: set[str] = set()
_claim_lock = threading.Lock()


def _stop_all_at_exit() -> None:
    for launcher in list(_live):
        launcher.stop()


atexit.register(_stop_all_at_exit)


class AenvPythonError(RuntimeError):
    """No interpreter with the aenvironment SDK; the message says how to get one."""


def _has_aenv(python: str) -> bool:
    try:
        out = subprocess.run(
            [python, "-c", "import aenv.main"], capture_output=True, timeout=120, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0


def _venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def find_aenv_python(python: str | os.PathLike | None = None) -> str | None:
    """The interpreter that runs ``python -m aenv.main``, or None if there is none yet.

    Order: ``python`` (a config key), ``$AREAL_ENV_AENV_PYTHON``, ``.venv-aenv/bin/python``
    beside the running venv, in the project and in the current directory (each only once it is
    complete: ``.installed``), the current interpreter if it has ``aenv``.
    """
    if python:
        return str(python)
    if os.environ.get(AENV_PYTHON_ENV):
        return os.environ[AENV_PYTHON_ENV]
    # beside the running venv first (a checkout's .venv and .venv-aenv), then the defaults
    for venv in (
        Path(sys.prefix).parent / ".venv-aenv",
        DEFAULT_AENV_VENV,
        Path.cwd() / ".venv-aenv",
    ):
        candidate = _venv_python(venv)
        if candidate.exists() and (venv / ".installed").exists():
            return str(candidate)
    if importlib.util.find_spec("aenv") is not None:
        return sys.executable
    return None


def ensure_aenv_python(
    python: str | os.PathLike | None = None, *, venv: str | os.PathLike | None = None
) -> str:
    """``find_aenv_python(python)``, creating ``.venv-aenv`` (``aenvironment==0.1.7`` from the
    package index, about a minute) when nothing is found. An explicit ``python`` must work."""
    found = find_aenv_python(python)
    if found is not None:
        if (python or os.environ.get(AENV_PYTHON_ENV)) and not _has_aenv(found):
            raise AenvPythonError(
                f"{found} cannot import aenv; install it there with "
                f"'{found} -m pip install {AENV_REQUIREMENT}' or unset the setting"
            )
        return found
    target = Path(venv) if venv else DEFAULT_AENV_VENV
    with FileLock(str(target) + ".lock"):
        py = _venv_python(target)
        if py.exists() and (target / ".installed").exists():
            return str(py)
        logger.info(
            "creating %s with %s for the environment servers (once; about a minute)",
            target,
            AENV_REQUIREMENT,
        )
        base = os.environ.get("PYTHON", "python3")
        steps = [
            [base, "-m", "venv", str(target)],
            [str(py), "-m", "pip", "install", "-q", AENV_REQUIREMENT],
        ]
        for cmd in steps:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise AenvPythonError(
                    f"setting up {target} failed at {' '.join(cmd)}:\n{done.stderr[-2000:]}\n"
                    f"Create it yourself with 'make venv-aenv', or point {AENV_PYTHON_ENV} at "
                    f"a Python that has {AENV_REQUIREMENT}."
                )
        (target / ".installed").touch()
        logger.info("%s is ready", target)
        return str(py)


def port_in_use(host: str, port: int = DATA_PORT) -> bool:
    """True when something accepts connections (or holds the port) on ``host:port``."""
    return not port_is_free(host, port)


def free_loopback_hosts(n: int, start: int = 50, stop: int = 250) -> list[str]:
    """``n`` addresses 127.0.0.K (K from ``start``) whose port 8081 is free and not claimed
    by another launcher in this process."""
    hosts: list[str] = []
    with _claim_lock:
        for k in range(start, stop):
            host = f"127.0.0.{k}"
            if host in _claimed or port_in_use(host):
                continue
            hosts.append(host)
            if len(hosts) == n:
                break
        if len(hosts) < n:
            raise RuntimeError(
                f"only {len(hosts)} free loopback addresses in 127.0.0.{start}-{stop}"
            )
        _claimed.update(hosts)
    return hosts


@dataclass
class AenvServer:
    """One running server."""

    host: str
    process: subprocess.Popen
    log_path: Path

    @property
    def url(self) -> str:
        """What ``AenvConfig.aenv_url`` takes (the SDK adds :8081 itself)."""
        return f"http://{self.host}"

    @property
    def data_url(self) -> str:
        return f"http://{self.host}:{DATA_PORT}"

    def alive(self) -> bool:
        return self.process.poll() is None


class AenvServerLauncher:
    """Run ``num_servers`` copies of an environment (a tools ``.py`` file or folder).

    ``with AenvServerLauncher("examples/aenv/env_tools.py", num_servers=2) as servers:
    urls = servers.urls``.
    """

    def __init__(
        self,
        tools_path: str | os.PathLike,
        *,
        num_servers: int = 1,
        hosts: list[str] | None = None,
        first_host: int = 50,
        log_dir: str | os.PathLike | None = None,
        startup_timeout: float = 60.0,
        name: str = "aenv-server",
        python: str | None = None,
        env: dict[str, str] | None = None,
    ):
        self.tools_path = Path(tools_path).resolve()
        if not self.tools_path.exists():
            raise FileNotFoundError(f"environment tools not found: {self.tools_path}")
        if num_servers < 1:
            raise ValueError(f"num_servers={num_servers} must be >= 1")
        self.num_servers = len(hosts) if hosts else num_servers
        self._fixed_hosts = list(hosts) if hosts else None
        self.first_host = first_host
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="aenv-logs-"))
        self.startup_timeout = startup_timeout
        self.name = name
        self.python = ensure_aenv_python(python)
        self.extra_env = dict(env or {})
        self.servers: list[AenvServer] = []

    # ------------------------------------------------------------------
    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def hosts(self) -> list[str]:
        return [s.host for s in self.servers]

    def __enter__(self) -> AenvServerLauncher:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> AenvServerLauncher:
        """Start every server and wait until all are ready (stops them all on failure)."""
        if self.servers:
            return self
        hosts = self._fixed_hosts or free_loopback_hosts(self.num_servers, self.first_host)
        if self._fixed_hosts:
            busy = [h for h in hosts if port_in_use(h)]
            if busy:
                raise RuntimeError(f"port {DATA_PORT} already in use on {', '.join(busy)}")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        _live.add(self)
        try:
            for host in hosts:
                self.servers.append(self._spawn(host))
            for i in range(len(self.servers)):
                self._wait_ready_or_move(i)
        except BaseException:
            self.stop()
            raise
        logger.info(
            "started %d aenv server(s) for %s at %s (logs in %s)",
            len(self.servers),
            self.tools_path.name,
            ", ".join(self.urls),
            self.log_dir,
        )
        return self

    def _spawn(self, host: str) -> AenvServer:
        log_path = self.log_dir / f"aenv-{host}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - handed to the child
        cmd = [self.python, "-m", "aenv.main", str(self.tools_path), "--host", host]
        cmd += ["--port", str(DATA_PORT), "--name", self.name, "--log-level", "WARNING"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.extra_env}
        env.pop("DUMMY_INSTANCE_IP", None)
        try:
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # a Ctrl-C to the trainer must not kill it mid-episode
            )
        finally:
            log.close()
        return AenvServer(host=host, process=proc, log_path=log_path)

    def _wait_ready(self, server: AenvServer) -> None:
        deadline = time.monotonic() + self.startup_timeout
        url = f"{server.data_url}/functions/list"
        while True:
            if not server.alive():
                raise RuntimeError(
                    f"aenv server on {server.host} exited with code {server.process.returncode}; "
                    f"log: {server.log_path}\n{_tail(server.log_path)}"
                )
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"aenv server on {server.host} not ready after {self.startup_timeout}s; "
                    f"log: {server.log_path}\n{_tail(server.log_path)}"
                )
            time.sleep(0.1)

    def _wait_ready_or_move(self, index: int, tries: int = 3) -> None:
        """Wait for server ``index``; if another process took its address meanwhile (the
        server exits with "address already in use"), start it on the next free address."""
        for attempt in range(tries):
            server = self.servers[index]
            try:
                self._wait_ready(server)
                return
            except RuntimeError:
                lost_race = "address already in use" in _tail(server.log_path).lower()
                if self._fixed_hosts or not lost_race or attempt == tries - 1:
                    raise
            logger.info("address %s was taken meanwhile; trying another", server.host)
            (new_host,) = free_loopback_hosts(1, self.first_host)
            with _claim_lock:
                _claimed.discard(server.host)
            self.servers[index] = self._spawn(new_host)

    def stop_server(self, index: int, *, kill: bool = False) -> None:
        """Stop one server (tests use ``kill=True`` to simulate a crash)."""
        _terminate(self.servers[index].process, kill=kill)

    def restart_server(self, index: int) -> AenvServer:
        """Start server ``index`` again on the same address (after ``stop_server``)."""
        old = self.servers[index]
        _terminate(old.process)
        deadline = time.monotonic() + 10
        while port_in_use(old.host) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.servers[index] = self._spawn(old.host)
        self._wait_ready(self.servers[index])
        return self.servers[index]

    def stop(self) -> None:
        """Stop every server (SIGTERM, then SIGKILL after 5 s) and free the addresses."""
        for server in self.servers:
            _terminate(server.process)
        with _claim_lock:
            for server in self.servers:
                _claimed.discard(server.host)
        if self.servers:
            logger.info("stopped %d aenv server(s)", len(self.servers))
        self.servers = []
        _live.discard(self)


def _terminate(proc: subprocess.Popen, *, kill: bool = False, grace: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        proc.kill() if kill else proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        _force_kill(proc)


def _force_kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait(timeout=5)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
