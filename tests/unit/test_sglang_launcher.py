"""Launcher process handling with real processes (real SGLang needs a GPU machine).

The "servers" here are a tiny HTTP server script that takes SGLang's flags; it is a real
process, so start-up, health-waiting, logs and teardown (stop, Ctrl-C, SIGTERM, parent crash)
are exercised exactly as with ``python -m sglang.launch_server``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from areal_env.engine.launcher import LaunchError, launch_servers

FAKE_SERVER = textwrap.dedent(
    """
    import argparse, http.server, sys, time
    p = argparse.ArgumentParser()
    p.add_argument("--model-path"); p.add_argument("--tp-size"); p.add_argument("--host")
    p.add_argument("--port", type=int); p.add_argument("--delay", type=float, default=0)
    a, _ = p.parse_known_args()
    print("fake server for", a.model_path, "tp", a.tp_size, "args", sys.argv[1:], flush=True)
    time.sleep(a.delay)

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
        def log_message(self, *args):
            pass

    http.server.HTTPServer((a.host, a.port), H).serve_forever()
    """
)

TRAINER = textwrap.dedent(
    """
    import signal, sys, threading, time
    # Ctrl-C as in a terminal: a job started in the background (`cmd &`) inherits SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, {root!r})
    from areal_env.engine.launcher import launch_servers
    out = []
    def launch():
        out.append(launch_servers("m", num_servers=2, base_port=0,
                                  command=[sys.executable, {fake!r}], log_dir={logs!r},
                                  startup_timeout=60))
    if {threaded!r}:  # no parent-death signal from a thread: only the watchdog protects
        t = threading.Thread(target=launch); t.start(); t.join()
    else:
        launch()
    print("PIDS", *[s.pid for s in out[0].servers], flush=True)
    time.sleep(600)
    """
)


@pytest.fixture
def fake(tmp_path) -> list[str]:
    path = tmp_path / "fake_server.py"
    path.write_text(FAKE_SERVER)
    return [sys.executable, str(path)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still "exists": check its state.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


def wait_dead(pids: list[int], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_launch_health_logs_and_stop(fake, tmp_path):
    group = launch_servers(
        "some/model",
        num_servers=2,
        tp_size=2,
        base_port=0,
        command=fake,
        extra_args=["--delay", "0.5", "--mem-fraction-static", "0.8"],
        log_dir=tmp_path / "logs",
        startup_timeout=30,
        health_path="/health_generate",
    )
    try:
        assert len(group.addresses) == 2 and len(set(group.addresses)) == 2
        for addr in group.addresses:
            assert httpx.get(f"http://{addr}/health", trust_env=False).status_code == 200
        for s in group.servers:
            log = s.log_path.read_text()
            assert "fake server for some/model tp 2" in log and "--mem-fraction-static" in log
            assert s.command[:2] == fake and "--port" in s.command
    finally:
        pids = [s.pid for s in group.servers]
        group.stop()
    assert wait_dead(pids, 5)
    group.stop()  # idempotent


def test_server_that_exits_is_reported_with_its_log(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('boom: no GPU found'); sys.exit(3)"]
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"exited with code 3(.|\n)*boom: no GPU found"):
        launch_servers("m", base_port=0, command=cmd, log_dir=tmp_path, startup_timeout=60)
    assert time.monotonic() - t0 < 15  # fails fast, not at the timeout


def test_startup_timeout_kills_the_server(tmp_path):
    cmd = [
        sys.executable,
        "-c",
        "import os, time; print('pid', os.getpid(), flush=True); time.sleep(120)",
    ]
    with pytest.raises(LaunchError, match="not healthy after"):
        launch_servers("m", base_port=0, command=cmd, log_dir=tmp_path, startup_timeout=2)
    log = next(tmp_path.glob("server-0-*.log")).read_text()
    pid = int(log.split()[1])
    assert wait_dead([pid], 10)


def test_port_in_use_is_skipped(fake, tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        group = launch_servers(
            "m", base_port=port, command=fake, log_dir=tmp_path, startup_timeout=30
        )
        try:
            assert group.addresses[0] != f"127.0.0.1:{port}"
        finally:
            group.stop()


def _start_trainer(tmp_path, fake, threaded=False) -> tuple[subprocess.Popen, list[int]]:
    root = str(Path(__file__).resolve().parents[2])
    script = tmp_path / "trainer.py"
    script.write_text(
        TRAINER.format(root=root, fake=fake[1], logs=str(tmp_path / "logs"), threaded=threaded)
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    line = proc.stdout.readline()
    while line and not line.startswith("PIDS"):
        line = proc.stdout.readline()
    assert line.startswith("PIDS"), "trainer did not launch its servers"
    pids = [int(p) for p in line.split()[1:]]
    assert all(alive(p) for p in pids)
    return proc, pids


@pytest.mark.parametrize("how", ["sigkill", "sigkill-threaded", "sigint", "sigterm"])
def test_servers_die_with_their_trainer(fake, tmp_path, how):
    """Crash (SIGKILL), Ctrl-C (SIGINT) or SIGTERM of the launching process: no orphans."""
    proc, pids = _start_trainer(tmp_path, fake, threaded=how.endswith("threaded"))
    sig = {"sigint": signal.SIGINT, "sigterm": signal.SIGTERM}.get(how, signal.SIGKILL)
    proc.send_signal(sig)
    # stop() may take 15 s of grace, then 5 s per server and 5 s for the watchdog (30 s in all):
    # a 30 s wait failed once on a loaded CI machine
    proc.wait(timeout=60)
    assert wait_dead(pids, 20), f"servers {pids} outlived their trainer ({how})"
