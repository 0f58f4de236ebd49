"""What the two MCP-speaking adapters share: safe retries and the tool-call loop.

Both ``AenvEnvironmentAdapter`` and ``McpEnvironmentAdapter`` follow one failure policy: a tool
that ran and failed is a result (``is_error``); a request that provably did not run is retried
with backoff; anything else raises. Only where the session comes from and how a dead one is
recovered differ, so those are the hooks (``_preflight``, ``_session_for_call``, ``_recover``);
the retry loop, the error wrapping, the tool-call and listing steps and the OpenAI schema cache
live here once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from tenacity import (
    AsyncRetrying,
    RetryError,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)

from areal_env.envs.base import (
    EnvError,
    EnvServerDiedError,
    EnvToolCallError,
    EnvUnavailableError,
    ToolCallResult,
    render_tool_output,
)
from areal_env.envs.mcp_session import McpSession, SessionDead
from areal_env.envs.schema import normalize_openai_tools

logger = logging.getLogger(__name__)

T = TypeVar("T")


class RetrySafe(Exception):
    """Internal: the request provably did not run; ``cause`` is why it failed."""

    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


class RetryPolicy(Protocol):
    """The config fields the retry loop reads (``AenvConfig`` and ``McpConfig`` have them)."""

    max_retries: int
    retry_delay: float


class AdapterConfig(RetryPolicy, Protocol):
    """The config fields the shared adapter code reads."""

    timeout: float
    tool_call_timeout: float
    tool_error_policy: Any
    max_tool_output_tokens: int | None
    tool_images: bool


def retrying(policy: RetryPolicy, where: str, *, reraise: bool = False) -> AsyncRetrying:
    """Retries of ``RetrySafe`` failures only: ``max_retries`` after the first attempt,
    exponential backoff from ``retry_delay`` (capped at 16x) plus jitter."""
    delay = policy.retry_delay
    return AsyncRetrying(
        stop=stop_after_attempt(policy.max_retries + 1),
        wait=wait_exponential(multiplier=delay, max=delay * 16) + wait_random(0, delay),
        retry=retry_if_exception_type(RetrySafe),
        reraise=reraise,
        before_sleep=lambda rs: logger.info(
            "retrying on %s after attempt %d: %s",
            where,
            rs.attempt_number,
            rs.outcome.exception() if rs.outcome else "?",
        ),
    )


def retry_cause(e: RetryError) -> BaseException:
    """The real failure behind the last attempt (``RetrySafe`` wrappers removed)."""
    cause = e.last_attempt.exception()
    while isinstance(cause, RetrySafe):
        cause = cause.cause
    assert cause is not None
    return cause


class McpAdapterBase:
    """Shared body of the MCP-speaking ``ToolEnvironment`` adapters (see the module doc)."""

    config: AdapterConfig
    where: str
    _tools: list[dict[str, Any]] | None
    _openai: tuple[list[dict[str, Any]], dict[str, str]] | None
    _lock: asyncio.Lock

    @property
    def tool_error_policy(self) -> str:
        return self.config.tool_error_policy

    # ---------------------------------------------------------------- hooks
    def _check_ready(self) -> None:
        """Raise ``EnvError`` when the adapter is not initialized."""
        raise NotImplementedError

    async def _preflight(self) -> None:
        """A cheap reachability check before a call (raise ``RetrySafe`` when refused)."""

    async def _session_for_call(self) -> McpSession:
        raise NotImplementedError

    async def _recover(self, e: BaseException, *, read_only: bool) -> bool:
        """The session failed with ``e``: drop or replace it; True when a retry is safe
        (``read_only``: the request could not have changed anything)."""
        raise NotImplementedError

    def _wire_name(self, name: str) -> str:
        """The tool name the server knows ``name`` by."""
        return name

    def _listed(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The tools this adapter shows, from what the server listed."""
        return tools

    def _cause(self, e: RetryError) -> BaseException:
        return retry_cause(e)

    # ---------------------------------------------------------------- retry loop
    def _retrying(self, reraise: bool = False) -> AsyncRetrying:
        return retrying(self.config, self.where, reraise=reraise)

    async def _with_retries(
        self,
        op: Callable[[int], Awaitable[T]],
        fail: Callable[[int, BaseException], EnvError],
        *,
        wrap_errors: bool = False,
    ) -> T:
        """``await op(attempt_number)`` with the safe retries; an exhausted retry (and, with
        ``wrap_errors``, any other non-``EnvError`` exception) raises ``fail(attempts, cause)``."""
        attempts = 0
        try:
            async for attempt in self._retrying():
                with attempt:
                    attempts += 1
                    return await op(attempts)
        except RetryError as e:
            cause = self._cause(e)
            raise fail(attempts, cause) from cause
        except (asyncio.CancelledError, EnvError):
            raise
        except Exception as e:
            if not wrap_errors:
                raise
            raise fail(attempts, e) from e
        raise AssertionError("unreachable")  # pragma: no cover

    # ---------------------------------------------------------------- tools
    async def _list_once(self, attempts: int) -> list[dict[str, Any]]:
        await self._preflight()
        session = await self._session_for_call()
        try:
            return await session.list_tools(timeout=self.config.timeout)
        except (SessionDead, TimeoutError) as e:
            if await self._recover(e, read_only=True):
                raise RetrySafe(e) from e
            raise EnvUnavailableError(f"listing tools of {self.where} failed: {e}") from e

    async def list_tools(self) -> list[dict[str, Any]]:
        """The environment's tools as MCP descriptions, fetched once per episode. Listing is
        read-only, so a failure where nothing ran is retried."""
        self._check_ready()
        async with self._lock:
            if self._tools is None:
                tools = await self._with_retries(
                    self._list_once,
                    lambda n, cause: EnvUnavailableError(
                        f"listing tools of {self.where} failed after {n} attempt(s): "
                        f"{type(cause).__name__}: {cause}"
                    ),
                )
                self._tools = self._listed(tools)
            return self._tools

    async def openai_tools(self) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """``normalize_openai_tools(await list_tools())``, cached."""
        if self._openai is None:
            self._openai = normalize_openai_tools(await self.list_tools())
        return self._openai

    async def _call_once(
        self, name: str, arguments: dict[str, Any], limit: float, attempts: int
    ) -> ToolCallResult:
        from mcp.shared.exceptions import MCPError

        await self._preflight()
        session = await self._session_for_call()
        try:
            content, is_error = await session.call_tool(
                self._wire_name(name), arguments, timeout=limit
            )
        except SessionDead as e:
            if await self._recover(e, read_only=False):
                raise RetrySafe(e) from e
            raise EnvServerDiedError(name, attempts, e, self.where) from e
        except MCPError as e:  # the server refused the call (JSON-RPC error)
            content, is_error = [{"type": "text", "text": e.error.message}], True
        text, cut = render_tool_output(
            content, max_tokens=self.config.max_tool_output_tokens, images=self.config.tool_images
        )
        return ToolCallResult(text, is_error, content, cut)

    async def call_tool(
        self, name: str, arguments: dict[str, Any] | None = None, *, timeout: float | None = None
    ) -> ToolCallResult:
        """Run tool ``name`` and return its result.

        A tool error (exception inside the tool, unknown tool, invalid arguments, a JSON-RPC
        refusal) comes back as ``ToolCallResult(is_error=True)``. Transport failures are retried
        only when the call cannot have run; otherwise, or after the last try,
        ``EnvToolCallError`` is raised (``EnvServerDiedError`` when the server died mid-call).
        """
        self._check_ready()
        limit = timeout or self.config.tool_call_timeout
        args = arguments or {}
        return await self._with_retries(
            lambda n: self._call_once(name, args, limit, n),
            lambda n, cause: EnvToolCallError(name, n, cause, self.where),
            wrap_errors=True,
        )
