"""``McpEnvironmentAdapter``: any MCP server as the tool environment of one episode.

A stdio server is a command this adapter spawns (a fresh process per episode, or one lent by a
``StdioServerPool``); an HTTP server is a streamable-HTTP URL (every episode opens its own MCP
session). Plain MCP servers have no reward endpoint: the agent's ``reward_fn`` scores the
episode from the item, the final answer and the tool log.

Failure policy, the same as for aenvironment servers: a tool that ran and failed is a result
(``is_error``); a request that provably did not run (connection refused, 502/503/504, a
restarted server that did not know the session) is retried on a new session; anything else
(the server died mid-call, a timeout) raises, which rejects the episode: the tool may have run,
and a stateful server's state is gone. The next episode gets a new server process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Any
from urllib.parse import urlsplit

from areal_env.api.config_load import find_command
from areal_env.envs.adapter_base import McpAdapterBase, RetrySafe
from areal_env.envs.base import EnvError, EnvUnavailableError, ToolCallResult
from areal_env.envs.mcp.config import McpConfig
from areal_env.envs.mcp_session import HttpTarget, McpSession, SessionDead, StdioTarget

logger = logging.getLogger(__name__)


def _new_session(config: McpConfig, url: str | None = None) -> McpSession:
    if config.command:
        target: HttpTarget | StdioTarget = StdioTarget(
            find_command(config.command) or config.command,
            list(config.args),
            dict(config.env) or None,
            config.cwd,
        )
    else:
        assert url is not None
        target = HttpTarget(url, dict(config.headers))
    return McpSession(target, timeout=config.timeout, where=config.describe())


class StdioServerPool:
    """Long-lived stdio server processes lent to one episode at a time (``isolation: pool``).

    Sessions belong to the event loop that opened them, so the pool keeps one set per loop.
    A session that died is dropped when handed back or lent out, and a new process takes its
    place on demand.
    """

    def __init__(self, config: McpConfig):
        self.config = config
        self._per_loop: dict[int, tuple[Any, list[McpSession], list[int], asyncio.Condition]] = {}
        self._lock = threading.Lock()
        self.started = 0
        """Server processes started so far (a dead one is replaced by a new one)."""

    def __getstate__(self) -> dict[str, Any]:  # picklable (subprocess rollout workers)
        return {"config": self.config}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["config"])  # type: ignore[misc]

    def _state(self) -> tuple[list[McpSession], list[int], asyncio.Condition]:
        loop = asyncio.get_running_loop()
        with self._lock:
            owner, idle, count, cond = self._per_loop.get(id(loop), (None, [], [0], None))
            if owner is not loop or cond is None:
                idle, count, cond = [], [0], asyncio.Condition()
                self._per_loop[id(loop)] = (loop, idle, count, cond)
            return idle, count, cond

    async def acquire(self) -> McpSession:
        idle, count, cond = self._state()
        async with cond:
            while True:
                while idle:
                    session = idle.pop()
                    if session.alive:
                        return session
                    count[0] -= 1
                    await session.close()
                if count[0] < self.config.pool_size:
                    count[0] += 1
                    break
                await cond.wait()
        session = _new_session(self.config)
        try:
            await session.open(self.config.startup_timeout)
        except BaseException:
            async with cond:
                count[0] -= 1
                cond.notify()
            raise
        self.started += 1
        return session

    async def release(self, session: McpSession) -> None:
        idle, count, cond = self._state()
        if not session.alive:
            await session.close()
        async with cond:
            if session.alive:
                idle.append(session)
            else:
                count[0] -= 1
            cond.notify()

    async def aclose(self) -> None:
        """Stop this loop's idle server processes."""
        idle, count, cond = self._state()
        async with cond:
            sessions, idle[:] = list(idle), []
            count[0] -= len(sessions)
        for s in sessions:
            await s.close()


class McpEnvironmentAdapter(McpAdapterBase):
    """``async with McpEnvironmentAdapter(cfg) as env:`` — a ``ToolEnvironment`` on an MCP
    server for one episode (see the module docstring for the failure policy)."""

    config: McpConfig

    has_reward = False

    def __init__(
        self,
        config: McpConfig | dict[str, Any],
        *,
        url: str | None = None,
        pool: StdioServerPool | None = None,
    ):
        self.config = config if isinstance(config, McpConfig) else McpConfig.from_dict(config)
        self.url = url or (self.config.all_urls[0] if self.config.all_urls else None)
        self.pool = pool
        self.where = self.config.describe()
        self._session: McpSession | None = None
        self._tools: list[dict[str, Any]] | None = None
        self._openai: tuple[list[dict[str, Any]], dict[str, str]] | None = None
        self._lock = asyncio.Lock()
        self._ever_opened = False

    @property
    def initialized(self) -> bool:
        return self._session is not None

    async def __aenter__(self) -> McpEnvironmentAdapter:
        await self.initialize()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.release()

    async def initialize(self) -> None:
        """Spawn/connect and run the MCP handshake (retried while nothing ran)."""
        if self._session is not None:
            return
        self._session = await self._with_retries(
            lambda n: self._open(),
            lambda n, cause: EnvUnavailableError(
                f"{self.where} could not be opened after {n} attempt(s): {cause}"
            ),
        )
        self._ever_opened = True

    async def _open(self) -> McpSession:
        try:
            if self.pool is not None:
                return await self.pool.acquire()
            session = _new_session(self.config, self.url)
            await session.open(self.config.startup_timeout)
            return session
        except SessionDead as e:
            if self.config.command:  # a command that does not start will not start next time
                raise EnvUnavailableError(str(e)) from e
            raise RetrySafe(e) from e

    async def release(self) -> None:
        """Close the session (stdio: stop the process, or hand it back to the pool); never
        raises, also when the episode is being cancelled."""
        session, self._session = self._session, None
        self._tools = self._openai = None
        self._ever_opened = False
        if session is None:
            return
        task = asyncio.ensure_future(
            self.pool.release(session) if self.pool is not None else session.close()
        )
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, 10.0)
            raise
        except Exception as e:  # noqa: BLE001 - release must not fail the episode
            logger.warning("releasing %s failed: %s: %s", self.where, type(e).__name__, e)

    def _check_ready(self) -> None:
        if self._session is None and not self._ever_opened:
            raise EnvError(f"{self.where} is not initialized (use 'async with' or initialize())")

    async def _preflight(self) -> None:
        """HTTP only: a cheap TCP connect before a call. A refused connection means the call
        cannot run (and our session is gone with the server): drop it, the retry opens anew."""
        if self.config.command or not self.url:
            return
        parts = urlsplit(self.url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(parts.hostname, port), self.config.timeout
            )
        except (OSError, TimeoutError) as e:
            old, self._session = self._session, None
            if old is not None:
                await old.close()
            raise RetrySafe(e) from e
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()

    async def _session_for_call(self) -> McpSession:
        session = self._session
        if session is not None and (session.alive or self.config.command):
            return session  # a dead stdio session fails the call: its state is gone
        return await self._replace_session()

    async def _replace_session(self) -> McpSession:
        """A new session after a refused request (http only: a stdio process is never
        silently replaced inside an episode, its state would be gone)."""
        old, self._session = self._session, None
        if old is not None:
            await old.close()
        self._session = await self._open()
        return self._session

    async def _recover(self, e: BaseException, *, read_only: bool) -> bool:
        """Only a refused request is retried, on a new session; a stdio process is replaced
        only while listing (before the episode gave it any state)."""
        safe = isinstance(e, SessionDead) and e.retry_safe
        if safe and (read_only or not self.config.command):
            await self._replace_session()
            return True
        return False

    def _listed(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Only ``config.tools`` when set (each must exist)."""
        wanted = self.config.tools
        if wanted is None:
            return tools
        missing = sorted(set(wanted) - {t["name"] for t in tools})
        if missing:
            raise EnvUnavailableError(
                f"{self.where} has no tool(s) {', '.join(missing)} (mcp.tools); it has: "
                f"{', '.join(t['name'] for t in tools)}"
            )
        return [t for t in tools if t["name"] in wanted]

    async def call_tool(
        self, name: str, arguments: dict[str, Any] | None = None, *, timeout: float | None = None
    ) -> ToolCallResult:
        """A tool outside ``config.tools`` is an error result; else see the base class."""
        self._check_ready()
        if self.config.tools is not None and name not in self.config.tools:
            return ToolCallResult(f"unknown tool {name!r}", True)
        return await super().call_tool(name, arguments, timeout=timeout)

    async def call_reward(self, arguments: dict[str, Any]) -> Any:
        raise EnvError(
            f"{self.where} has no reward endpoint (plain MCP): give the agent a reward_fn"
        )
