"""One MCP client session (official ``mcp`` SDK) over stdio or streamable HTTP.

The SDK's transports are anyio context managers: a transport failure cancels the task that
entered them, and they must be exited by that same task. An episode's tool calls may come from
other tasks (the Agents SDK runs tools in tasks of its own) and an episode may be cancelled at
any point, so the session lives in an *owner task* of its own: callers send requests through it
and race them against the session's death. A dead session never takes the caller down with it;
the caller gets an error that says whether the request can have run.

Retry safety is decided from facts the transport observed, never from message strings:

* the HTTP connection was refused (``ConnectError`` in the death's cause chain): nothing was sent;
* the server answered a request of ours with 404 while we sent a session id (a restarted server
  that does not know the session: the MCP spec says it must refuse it), or with 502/503/504 (a
  gateway that did not reach the server): the request did not run.

Everything else after a request was sent (a broken connection, a dead stdio process, a timeout)
may have run the tool, so it is not retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_env.http.client import default_ssl_context

logger = logging.getLogger(__name__)

REFUSED_STATUS = frozenset({502, 503, 504})


class SessionDead(Exception):
    """The session is gone. ``retry_safe``: the failed request provably did not run."""

    def __init__(self, message: str, *, retry_safe: bool, cause: BaseException | None = None):
        super().__init__(message)
        self.retry_safe = retry_safe
        self.cause = cause


@dataclass
class HttpTarget:
    """A streamable-HTTP MCP endpoint (``url`` ends with the MCP path, e.g. ``/mcp``)."""

    url: str
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class StdioTarget:
    """A command that speaks MCP on stdin/stdout; spawned by the session, killed at close."""

    command: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None
    cwd: str | None = None


def _chain(exc: BaseException | None):
    """``exc``, its causes/contexts and the members of exception groups."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        while e is not None and id(e) not in seen:
            seen.add(id(e))
            yield e
            if isinstance(e, BaseExceptionGroup):
                todo.extend(e.exceptions)
            e = e.__cause__ or e.__context__


def connection_refused(exc: BaseException | None) -> bool:
    """True when ``exc`` (or what caused it) is a refused/unreachable TCP connection."""
    import httpx
    import httpx2

    return any(
        isinstance(e, (httpx2.ConnectError, httpx.ConnectError, ConnectionRefusedError))
        for e in _chain(exc)
    )


def _connection_closed(exc: BaseException) -> bool:
    """The SDK's own "Connection closed" error (JSON-RPC code -32000 raised client-side when the
    transport ends while a request waits), as opposed to an error the server answered."""
    from mcp.shared.exceptions import MCPError
    from mcp_types.jsonrpc import CONNECTION_CLOSED

    return isinstance(exc, MCPError) and exc.code == CONNECTION_CLOSED


def describe(exc: BaseException | None) -> str:
    """The innermost meaningful error of a chain (exception groups hide the real one)."""
    best: BaseException | None = None
    for e in _chain(exc):
        if isinstance(e, (BaseExceptionGroup, asyncio.CancelledError)):
            continue
        if best is None or not str(best):
            best = e
        if isinstance(e, OSError) or type(e).__module__.startswith(("httpx", "httpcore")):
            best = e
            break
    if best is None:
        return type(exc).__name__ if exc is not None else "unknown error"
    return f"{type(best).__name__}: {best}"


class McpSession:
    """An initialized MCP ``ClientSession`` kept alive by an owner task until ``close()``."""

    def __init__(
        self,
        target: HttpTarget | StdioTarget,
        *,
        timeout: float = 30.0,
        where: str = "MCP server",
        stderr_dir: str | os.PathLike | None = None,
    ):
        self.target = target
        self.timeout = timeout
        self.where = where
        self._stderr_dir = stderr_dir
        self._session: Any = None
        self._owner: asyncio.Task | None = None
        self._ready = asyncio.Event()
        self._dead = asyncio.Event()
        self._closing = asyncio.Event()
        self._death: BaseException | None = None
        self._refused: int | None = None  # status of a refused request (see module docstring)
        self._broken: BaseException | None = None  # the transport closed under a request
        self._stderr_path: Path | None = None
        self.server_info: Any = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def alive(self) -> bool:
        return self._session is not None and not self._dead.is_set() and self._broken is None

    @property
    def stderr_tail(self) -> str:
        if self._stderr_path is None:
            return ""
        try:
            return "\n".join(self._stderr_path.read_text(errors="replace").splitlines()[-15:])
        except OSError:
            return ""

    async def open(self, timeout: float | None = None) -> None:
        """Start the transport and run the MCP handshake; ``SessionDead`` if that fails."""
        if self._owner is not None:
            return
        self._owner = asyncio.create_task(self._run(), name=f"mcp-session {self.where}")
        waiter = asyncio.ensure_future(self._ready.wait())
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout or self.timeout)
        except TimeoutError:
            await self.close()
            raise SessionDead(
                f"{self.where}: no MCP handshake after {timeout or self.timeout:.1f}s",
                retry_safe=True,
            ) from None
        except BaseException:
            await self.close()
            raise
        finally:
            waiter.cancel()
        if self._session is None:
            death = self._death
            tail = self.stderr_tail
            await self.close()
            raise SessionDead(
                f"{self.where}: could not open an MCP session: {describe(death)}"
                + (f"\nserver stderr:\n{tail}" if tail else ""),
                retry_safe=True,  # nothing but the handshake was sent
                cause=death,
            )

    async def close(self) -> None:
        """End the session (DELETE for HTTP, terminate the process for stdio); never raises."""
        self._closing.set()
        owner, self._owner = self._owner, None
        if owner is None:
            return
        if not owner.done():
            try:
                await asyncio.wait_for(asyncio.shield(owner), 5.0)
            except (TimeoutError, asyncio.CancelledError, Exception):
                owner.cancel()
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(owner, 5.0)
        self._session = None
        if self._stderr_path is not None:
            self._stderr_path.unlink(missing_ok=True)

    async def _run(self) -> None:
        from mcp.client.session import ClientSession

        try:
            async with contextlib.AsyncExitStack() as stack:
                if isinstance(self.target, HttpTarget):
                    read, write = await self._open_http(stack)
                else:
                    read, write = await self._open_stdio(stack)
                session = await stack.enter_async_context(
                    ClientSession(read, write, read_timeout_seconds=self.timeout)
                )
                init = await session.initialize()
                self.server_info = getattr(init, "server_info", None)
                self._session = session
                self._ready.set()
                await self._closing.wait()
        except BaseException as e:  # noqa: BLE001 - recorded; callers get SessionDead
            if not self._closing.is_set():
                self._death = e
                logger.debug("MCP session to %s ended: %s", self.where, describe(e))
            if isinstance(e, asyncio.CancelledError) and self._closing.is_set():
                return
        finally:
            self._dead.set()
            self._ready.set()

    async def _open_http(self, stack: contextlib.AsyncExitStack) -> Any:
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        target = self.target
        assert isinstance(target, HttpTarget)

        async def on_response(response: httpx2.Response) -> None:
            status = response.status_code
            sent_session = "mcp-session-id" in response.request.headers
            if status in REFUSED_STATUS or (status == 404 and sent_session):
                self._refused = status

        http = httpx2.AsyncClient(
            headers=dict(target.headers),
            timeout=httpx2.Timeout(self.timeout, read=max(self.timeout, 300.0)),
            event_hooks={"response": [on_response]},
            verify=default_ssl_context(),
        )
        await stack.enter_async_context(http)
        return await stack.enter_async_context(streamable_http_client(target.url, http_client=http))

    async def _open_stdio(self, stack: contextlib.AsyncExitStack) -> Any:
        from mcp.client.stdio import StdioServerParameters, stdio_client

        target = self.target
        assert isinstance(target, StdioTarget)
        fd, path = tempfile.mkstemp(prefix="mcp-stderr-", suffix=".log", dir=self._stderr_dir)
        os.close(fd)
        self._stderr_path = Path(path)
        errlog = stack.enter_context(open(path, "w", encoding="utf-8"))  # noqa: SIM115
        params = StdioServerParameters(
            command=target.command, args=list(target.args), env=target.env, cwd=target.cwd
        )
        return await stack.enter_async_context(stdio_client(params, errlog=errlog))

    # ------------------------------------------------------------------ requests
    async def request(
        self, fn: Callable[[Any], Awaitable[Any]], *, timeout: float | None = None
    ) -> Any:
        """Run ``fn(session)`` unless the session dies or ``timeout`` passes first.

        Raises ``SessionDead`` (with ``retry_safe``) if the session is or goes away, and
        ``TimeoutError`` when the request takes longer than ``timeout`` (the call is abandoned;
        it may still run on the server).
        """
        if not self.alive:
            raise SessionDead(
                f"{self.where}: the MCP session is closed ({describe(self._death or self._broken)})",
                retry_safe=connection_refused(self._death) or self._refused is not None,
                cause=self._death,
            )
        self._refused = None
        call = asyncio.ensure_future(fn(self._session))
        died = asyncio.ensure_future(self._dead.wait())
        try:
            done, _ = await asyncio.wait(
                {call, died}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        except BaseException:
            call.cancel()
            died.cancel()
            raise
        died.cancel()
        if call in done:
            try:
                return call.result()
            except asyncio.CancelledError:
                pass  # the session's task group went down under it
            except Exception as e:
                if _connection_closed(e):
                    # the transport went away under the request (a stdio server that exited
                    # leaves the session object up, so mark it broken ourselves)
                    self._broken = e
                elif self._refused is not None:
                    raise SessionDead(
                        f"{self.where}: the server refused the request (HTTP {self._refused})",
                        retry_safe=True,
                        cause=e,
                    ) from e
                elif not self._dead.is_set():
                    raise
        else:
            call.cancel()
            with contextlib.suppress(BaseException):
                await call
            if not self._dead.is_set():
                raise TimeoutError(f"{self.where}: no answer after {timeout}s")
        # the session died during the request
        if self._broken is None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self._dead.wait(), 2.0)
        death = self._death
        if death is None and call.done() and not call.cancelled():
            death = call.exception()
        safe = self._refused is not None or connection_refused(death)
        tail = self.stderr_tail
        raise SessionDead(
            f"{self.where}: the MCP session died during the request: {describe(death)}"
            + (f"\nserver stderr:\n{tail}" if tail else ""),
            retry_safe=safe,
            cause=death,
        )

    async def list_tools(self, *, timeout: float | None = None) -> list[dict[str, Any]]:
        """Every tool (all pages) as ``{"name", "description", "inputSchema"}``."""

        async def fn(session: Any) -> list[dict[str, Any]]:
            from mcp_types import PaginatedRequestParams

            tools: list[dict[str, Any]] = []
            cursor = None
            while True:
                params = PaginatedRequestParams(cursor=cursor) if cursor else None
                page = await session.list_tools(params=params)
                for t in page.tools:
                    tools.append(
                        {
                            "name": t.name,
                            "description": t.description or "",
                            "inputSchema": dict(t.input_schema or {}),
                        }
                    )
                cursor = page.next_cursor
                if not cursor:
                    return tools

        return await self.request(fn, timeout=timeout or self.timeout)

    async def call_tool(
        self, name: str, arguments: dict[str, Any], *, timeout: float
    ) -> tuple[list[dict[str, Any]], bool]:
        """``(content blocks as wire-format dicts, is_error)`` of one ``tools/call``."""

        async def fn(session: Any) -> Any:
            # our own deadline decides (TimeoutError, never retried); the SDK's is a backstop
            return await session.call_tool(name, arguments, read_timeout_seconds=timeout + 30.0)

        result = await self.request(fn, timeout=timeout)
        content = [
            b.model_dump(mode="json", by_alias=True, exclude_none=True)
            if hasattr(b, "model_dump")
            else dict(b)
            for b in (result.content or [])
        ]
        return content, bool(result.is_error)
