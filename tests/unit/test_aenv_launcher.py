"""AenvServerLauncher: real aenvironment server processes on loopback addresses."""

from __future__ import annotations

import socket

import httpx
import pytest

from areal_env.envs.aenv import launcher as launcher_module
from areal_env.envs.aenv.launcher import AenvServerLauncher, free_loopback_hosts, port_in_use


def test_servers_on_distinct_addresses_with_logs_and_clean_stop(tmp_path, aenv_tools_path):
    a = AenvServerLauncher(aenv_tools_path, num_servers=2, first_host=110, log_dir=tmp_path / "a")
    b = AenvServerLauncher(aenv_tools_path, num_servers=1, first_host=110, log_dir=tmp_path / "b")
    with a, b:
        hosts = a.hosts + b.hosts
        assert len(set(hosts)) == 3
        for url in a.urls + b.urls:
            assert httpx.get(f"{url}:8081/functions/list").json()["success"] is True
        assert all(s.log_path.exists() for s in a.servers + b.servers)
        procs = [s.process for s in a.servers + b.servers]
    assert all(p.poll() is not None for p in procs)  # stopped
    assert not any(port_in_use(h) for h in hosts)
    assert a.servers == [] and not set(hosts) & launcher_module._claimed  # addresses freed


def test_fixed_address_in_use_is_refused(tmp_path, aenv_tools_path):
    (host,) = free_loopback_hosts(1, 130)
    with socket.socket() as sock:
        sock.bind((host, 8081))
        sock.listen()
        launcher = AenvServerLauncher(aenv_tools_path, hosts=[host], log_dir=tmp_path)
        with pytest.raises(RuntimeError, match="already in use"):
            launcher.start()


def test_address_taken_after_the_check_moves_to_another(tmp_path, aenv_tools_path):
    launcher = AenvServerLauncher(aenv_tools_path, first_host=140, log_dir=tmp_path)
    (host,) = free_loopback_hosts(1, 140)
    with socket.socket() as sock:  # another process wins the race for this address
        sock.bind((host, 8081))
        sock.listen()
        launcher.servers = [launcher._spawn(host)]
        try:
            launcher._wait_ready_or_move(0)
            assert launcher.hosts[0] != host
            assert httpx.get(f"{launcher.urls[0]}:8081/functions/list").status_code == 200
        finally:
            launcher.stop()


def test_broken_environment_reports_its_log(tmp_path):
    bad = tmp_path / "bad_env.py"
    bad.write_text("raise SystemExit('cannot load this environment')\n")
    launcher = AenvServerLauncher(bad, first_host=150, log_dir=tmp_path, startup_timeout=60)
    with pytest.raises(RuntimeError, match="exited with code"):
        launcher.start()
    assert launcher.servers == []


def test_servers_run_from_their_own_interpreter(tmp_path, aenv_tools_path, monkeypatch):
    """The core venv has no aenvironment SDK; the servers run from .venv-aenv (or the one named
    by the config key / environment variable), and a wrong one is a clear error."""
    import importlib.util
    import sys

    from areal_env.envs.aenv.launcher import (
        AENV_PYTHON_ENV,
        AenvPythonError,
        ensure_aenv_python,
        find_aenv_python,
    )

    python = find_aenv_python()
    assert python is not None and python != sys.executable
    assert importlib.util.find_spec("aenv") is None  # not in the core's venv
    with AenvServerLauncher(aenv_tools_path, first_host=140, log_dir=tmp_path) as servers:
        assert servers.python == python
        assert "-m aenv.main" in " ".join(servers.servers[0].process.args)
    monkeypatch.setenv(AENV_PYTHON_ENV, sys.executable)
    with pytest.raises(AenvPythonError, match="cannot import aenv.*pip install aenvironment"):
        ensure_aenv_python()
    monkeypatch.delenv(AENV_PYTHON_ENV)
    with pytest.raises(AenvPythonError, match="cannot import aenv"):
        ensure_aenv_python(sys.executable)  # the config key (aenv_config.server_python)
