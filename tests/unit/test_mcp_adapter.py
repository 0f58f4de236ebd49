"""McpEnvironmentAdapter against real MCP servers: FastMCP servers the tests write
(tests/fixtures/mcp_server.py), and servers published by others (``mcp-server-time``,
``mcp-server-git`` on a repository the test creates), over stdio and streamable HTTP, including
servers killed in the middle of an episode."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from areal_env.envs.base import (
    EnvServerDiedError,
    EnvToolCallError,
    ToolEnvironment,
    render_tool_output,
)
from areal_env.envs.mcp.adapter import McpEnvironmentAdapter, StdioServerPool
from areal_env.envs.mcp.config import McpConfig, McpConfigError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TEST_SERVER = [str(FIXTURES / "mcp_server.py")]
BIN = Path(sys.executable).parent


def _bin(name: str) -> str:
    path = shutil.which(name) or str(BIN / name)
    if not Path(path).exists():
        pytest.fail(f"{name} is not installed (it is in the dev extra: pip install -e '.[dev]')")
    return path


def _stdio(**kw) -> McpConfig:
    return McpConfig(command=sys.executable, args=TEST_SERVER, **kw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HttpServer:
    """A server process listening on 127.0.0.1:PORT/mcp (started/killed by the test)."""

    def __init__(self, argv: list[str], port: int, tmp: Path):
        self.argv, self.port, self.log = argv, port, tmp / f"server-{port}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def start(self) -> HttpServer:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"server did not start: {self.log.read_text()[-2000:]}"
                    ) from None
                time.sleep(0.1)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def http_servers(tmp_path):
    started: list[HttpServer] = []

    def make(argv_for_port) -> HttpServer:
        port = _free_port()
        server = HttpServer(argv_for_port(port), port, tmp_path).start()
        started.append(server)
        return server

    yield make
    for s in started:
        s.kill()


# ------------------------------------------------------------------ FastMCP server, stdio


async def test_tools_results_errors_truncation_and_images():
    async with McpEnvironmentAdapter(_stdio(max_tool_output_tokens=50)) as env:
        assert isinstance(env, ToolEnvironment)
        names = [t["name"] for t in await env.list_tools()]
        assert {"bump", "fail", "long_text", "picture"} <= set(names)
        tools, name_map = await env.openai_tools()
        assert name_map["bump"] == "bump" and tools[0]["type"] == "function"
        assert (await env.call_tool("bump", {"step": 2})).text == "2"
        failed = await env.call_tool("fail", {"message": "disk full"})
        assert failed.is_error and "disk full" in failed.text
        unknown = await env.call_tool("no_such_tool", {})
        assert unknown.is_error and "no_such_tool" in unknown.text
        bad_args = await env.call_tool("bump", {"step": "many"})
        assert bad_args.is_error
        long = await env.call_tool("long_text", {"chars": 100_000})
        assert long.truncated and len(long.text) < 400
        assert "99800 of 100000 characters omitted" in long.text
        assert len(long.content[0]["text"]) == 100_000  # the raw result is kept for rewards
        pic = await env.call_tool("picture", {})
        assert pic.text == "[image content: image/png, 70 bytes, not shown]"
        assert pic.content[0]["type"] == "image"


async def test_tool_allow_list():
    cfg = _stdio(tools=["bump", "pid"])
    async with McpEnvironmentAdapter(cfg) as env:
        assert sorted(t["name"] for t in await env.list_tools()) == ["bump", "pid"]
        refused = await env.call_tool("die", {})  # not offered, never sent
        assert refused.is_error
        assert (await env.call_tool("bump", {})).text == "1"
    with pytest.raises(Exception, match="no tool.*nope"):
        async with McpEnvironmentAdapter(_stdio(tools=["nope"])) as env:
            await env.list_tools()


async def test_fresh_process_per_episode_keeps_episodes_apart():
    cfg = _stdio()
    seen = []
    for _ in range(2):
        async with McpEnvironmentAdapter(cfg) as env:
            seen.append((await env.call_tool("pid", {})).text)
            assert (await env.call_tool("bump", {})).text == "1"  # no state from the last one
    assert seen[0] != seen[1]


async def test_pool_reuses_processes_and_replaces_dead_ones():
    cfg = _stdio(isolation="pool", pool_size=1)
    pool = StdioServerPool(cfg)
    async with McpEnvironmentAdapter(cfg, pool=pool) as env:
        first = (await env.call_tool("pid", {})).text
        assert (await env.call_tool("bump", {})).text == "1"
    async with McpEnvironmentAdapter(cfg, pool=pool) as env:
        assert (await env.call_tool("pid", {})).text == first  # same process, lent again
        assert (await env.call_tool("bump", {})).text == "2"
        with pytest.raises(EnvServerDiedError) as err:
            await env.call_tool("die", {})  # the server dies mid-call
        assert err.value.rejection_reason == "env_server_died" and err.value.attempts == 1
    async with McpEnvironmentAdapter(cfg, pool=pool) as env:
        assert (await env.call_tool("pid", {})).text != first  # replaced
        assert (await env.call_tool("bump", {})).text == "1"
    assert pool.started == 2
    await pool.aclose()


async def test_killed_mid_episode_rejects_and_next_episode_works():
    cfg = _stdio(tool_call_timeout=20)
    async with McpEnvironmentAdapter(cfg) as env:
        pid = int((await env.call_tool("pid", {})).text)
        call = asyncio.create_task(env.call_tool("slow", {"seconds": 10}))
        await asyncio.sleep(1.0)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EnvServerDiedError, match="slow"):
            await call
        assert time.monotonic() - t0 < 5  # noticed at once, not at the call's timeout
        with pytest.raises(EnvToolCallError):
            await env.call_tool("bump", {})  # the episode cannot go on with a dead server
    async with McpEnvironmentAdapter(cfg) as env:
        assert (await env.call_tool("bump", {})).text == "1"


@pytest.mark.slow  # a few seconds of server processes; run in CI
async def test_timeout_is_not_retried():
    async with McpEnvironmentAdapter(_stdio(max_retries=3)) as env:
        with pytest.raises(EnvToolCallError) as err:
            await env.call_tool("slow", {"seconds": 3}, timeout=0.5)
        assert err.value.attempts == 1 and isinstance(err.value.cause, TimeoutError)


async def test_command_that_does_not_start_is_a_clear_error():
    cfg = McpConfig(command=sys.executable, args=["-c", "import sys; sys.exit('no config file')"])
    with pytest.raises(Exception, match="(?s)could not open an MCP session.*no config file"):
        async with McpEnvironmentAdapter(cfg):
            pass


@pytest.mark.slow  # a few seconds of server processes; run in CI
async def test_release_on_cancellation():
    adapter = McpEnvironmentAdapter(_stdio())
    entered = asyncio.Event()
    pids = []

    async def episode():
        async with adapter as env:
            pids.append(int((await env.call_tool("pid", {})).text))
            entered.set()
            await env.call_tool("slow", {"seconds": 5})

    task = asyncio.create_task(episode())
    await entered.wait()
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not adapter.initialized
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pids[0]) and psutil.Process(pids[0]).status() != "zombie":
        assert time.monotonic() < deadline, "server process left running"
        await asyncio.sleep(0.1)


# ------------------------------------------------------------------ FastMCP server, HTTP


@pytest.mark.slow  # a few seconds of server processes; run in CI
async def test_http_server_killed_and_restarted(http_servers):
    server = http_servers(
        lambda port: [sys.executable, *TEST_SERVER, "http", "127.0.0.1", str(port)]
    )
    cfg = McpConfig(url=server.url, headers={"Authorization": "Bearer s3cret"}, retry_delay=0.05)
    assert "s3cret" not in repr(cfg)
    async with McpEnvironmentAdapter(cfg) as env:
        assert (await env.call_tool("bump", {})).text == "1"
        server.kill()
        with pytest.raises(EnvToolCallError) as err:
            await env.call_tool("bump", {})
        assert err.value.attempts == 3  # refused connections are safe to retry; then give up
        server.start()  # a new process on the same port: it does not know our session
        assert (await env.call_tool("bump", {})).text == "1"  # new session, ran once


def test_config_errors_name_the_field():
    with pytest.raises(McpConfigError, match=r"mcp\.command="):
        McpConfig()
    with pytest.raises(McpConfigError, match=r"mcp\.url=.*not both"):
        McpConfig(command="x", url="http://127.0.0.1:1/mcp")
    with pytest.raises(McpConfigError, match=r"mcp\.isolation="):
        McpConfig(command="x", isolation="shared")
    with pytest.raises(McpConfigError, match=r"mcp\.max_tool_output_tokens="):
        McpConfig(command="x", max_tool_output_tokens=0)
    with pytest.raises(McpConfigError, match="unknown mcp config key 'cmd'"):
        McpConfig.from_dict({"cmd": "x"})
    with pytest.raises(McpConfigError, match=r"mcp\.url='http://\*\*\*@h/mcp'"):
        McpConfig(url="http://user:pw@h/mcp", command="x")


def test_render_tool_output_shapes():
    text, cut = render_tool_output(
        [
            {"type": "text", "text": "a"},
            {"type": "resource", "resource": {"uri": "file:///x.txt", "text": "hello"}},
            {"type": "resource", "resource": {"uri": "file:///x.bin", "blob": "AAAA"}},
            {"type": "audio", "data": "AAAA", "mimeType": "audio/wav"},
        ],
        max_tokens=None,
    )
    assert not cut
    assert text.splitlines() == [
        "a",
        "[resource file:///x.txt]",
        "hello",
        "[resource file:///x.bin: binary]",
        "[audio content: audio/wav, 3 bytes, not shown]",
    ]
    shown, _ = render_tool_output(
        [{"type": "image", "data": "AAAA", "mimeType": "image/png"}], max_tokens=None, images=True
    )
    assert shown == "data:image/png;base64,AAAA"


# ------------------------------------------------------------------ published servers


async def test_mcp_server_time_over_stdio():
    cfg = McpConfig(command=_bin("mcp-server-time"), args=["--local-timezone", "UTC"])
    async with McpEnvironmentAdapter(cfg) as env:
        assert {t["name"] for t in await env.list_tools()} == {"get_current_time", "convert_time"}
        out = await env.call_tool(
            "convert_time",
            {"source_timezone": "UTC", "time": "12:00", "target_timezone": "Asia/Tokyo"},
        )
        assert not out.is_error and "21:00" in out.text
        bad = await env.call_tool(
            "convert_time",
            {"source_timezone": "Nowhere/X", "time": "12:00", "target_timezone": "UTC"},
        )
        assert bad.is_error and "Nowhere/X" in bad.text


@pytest.mark.slow  # a few seconds of server processes; run in CI
async def test_mcp_server_time_over_http(http_servers):
    bridge = str(FIXTURES / "mcp_http_bridge.py")
    time_server = _bin("mcp-server-time")
    server = http_servers(
        lambda port: [sys.executable, bridge, "127.0.0.1", str(port), "--", time_server]
    )
    async with McpEnvironmentAdapter(McpConfig(url=server.url)) as env:
        assert "convert_time" in {t["name"] for t in await env.list_tools()}
        out = await env.call_tool(
            "convert_time",
            {"source_timezone": "UTC", "time": "08:30", "target_timezone": "Europe/Berlin"},
        )
        assert not out.is_error and "09:30" in out.text


@pytest.fixture
def git_repo(tmp_path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    env = {
        **os.environ,
        "GIT_AUTHOR_DATE": "2026-01-02T03:04:05",
        "GIT_COMMITTER_DATE": "2026-01-02T03:04:05",
    }

    def git(*args, who="Ada Lovelace <ada@example.com>"):
        name, email = who[:-1].split(" <")
        subprocess.run(
            ["git", "-c", f"user.name={name}", "-c", f"user.email={email}", *args],
            cwd=repo,
            check=True,
            capture_output=True,
            env=env,
        )

    git("init", "-q", "-b", "main")
    (repo / "notes.txt").write_text("first\n")
    git("add", "notes.txt")
    git("commit", "-q", "-m", "Add notes")
    (repo / "notes.txt").write_text("first\nsecond\n")
    git("commit", "-q", "-am", "Extend notes", who="Alan Turing <alan@example.com>")
    return repo


async def test_mcp_server_git_on_a_repository_the_test_creates(git_repo):
    cfg = McpConfig(command=_bin("mcp-server-git"), args=["--repository", str(git_repo)])
    async with McpEnvironmentAdapter(cfg) as env:
        names = {t["name"] for t in await env.list_tools()}
        assert {"git_log", "git_show", "git_status"} <= names
        log = await env.call_tool("git_log", {"repo_path": str(git_repo), "max_count": 5})
        assert not log.is_error
        assert "Extend notes" in log.text and "Alan Turing" in log.text and "Add notes" in log.text
        bad = await env.call_tool("git_show", {"repo_path": str(git_repo), "revision": "nope123"})
        assert bad.is_error


async def test_mcp_server_git_killed_mid_episode(git_repo):
    cfg = McpConfig(command=_bin("mcp-server-git"), args=["--repository", str(git_repo)])
    async with McpEnvironmentAdapter(cfg) as env:
        await env.list_tools()
        me = psutil.Process()
        (server,) = [
            p for p in me.children(recursive=True) if "mcp-server-git" in " ".join(p.cmdline())
        ]
        server.kill()
        server.wait(10)
        with pytest.raises(EnvServerDiedError):
            await env.call_tool("git_status", {"repo_path": str(git_repo)})
    async with McpEnvironmentAdapter(cfg) as env:  # the next episode gets a new process
        status = await env.call_tool("git_status", {"repo_path": str(git_repo)})
        assert not status.is_error and "main" in status.text
