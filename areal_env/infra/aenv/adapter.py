"""``AenvEnvironmentAdapter``: one environment instance for one episode, used safely.

It wraps ``aenv.Environment`` (aenvironment 0.1.7) and fixes what an RL loop needs:

* readiness is our own ``GET /functions/list`` probe: the SDK's ``/health`` probe always asks
  ``localhost:8081`` whatever the environment's address, so it may hang or report another server;
* release happens on every exit path, cancellation included;
* retries happen only where the tool can not have run: the connection was refused, the server
  answered 502/503/504, or a restarted server did not know our MCP session. A timeout or a broken
  connection after the request was sent is *not* retried (tools need not be idempotent), and a
  tool that ran and reported an error is a result, not a failure;
* a dead server is noticed in milliseconds (a cheap probe before each call) instead of after the
  MCP client's full request timeout;
* URLs are logged without credentials.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from tenacity import (
    AsyncRetrying,
    RetryError,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)

from areal_env.infra.aenv.config import AenvConfig, redact_url
from areal_env.infra.aenv.schema import normalize_openai_tools

logger = logging.getLogger(__name__)

RETRY_STATUS = frozenset({502, 503, 504})


class AenvError(RuntimeError):
    """Base class of the adapter's errors."""


class AenvUnavailableError(AenvError):
    """The environment did not become ready, or could not be reached after the safe retries."""


class AenvToolCallError(AenvError):
    """A tool call failed in transport (not a tool error result): names tool, attempts, cause."""

    def __init__(self, tool_name: str, attempts: int, cause: BaseException, where: str):
        self.tool_name = tool_name
        self.attempts = attempts
        self.cause = cause
        super().__init__(
            f"tool {tool_name!r} on {where} failed after {attempts} attempt(s): "
            f"{type(cause).__name__}: {cause}"
        )


class AenvCallError(AenvError):
    """A reward or function call failed (after the safe retries)."""

    def __init__(self, what: str, attempts: int, cause: BaseException, where: str):
        self.what = what
        self.attempts = attempts
        self.cause = cause
        super().__init__(
            f"{what} on {where} failed after {attempts} attempt(s): {type(cause).__name__}: {cause}"
        )


class _RetrySafe(Exception):
    """Internal: the request provably did not run; ``cause`` is why it failed."""

    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


@dataclass
class ToolCallResult:
    """What a tool returned. ``is_error`` = the tool ran (or was refused) and reported an error."""

    text: str
    is_error: bool = False
    content: list[dict[str, Any]] = field(default_factory=list)


_sdk_logging_configured = False


def configure_sdk_logging(level: str | int = "WARNING") -> None:
    """Route the SDK's loggers through standard logging at ``level``.

    The SDK installs its own colour handler on stdout and logs every call at INFO; we drop that
    handler (records still propagate to the application's handlers) and raise the level.
    """
    global _sdk_logging_configured
    import aenv.core.logging  # noqa: F401  (installs the SDK handler and level we then replace)

    sdk_logger = logging.getLogger("aenv")
    sdk_logger.setLevel(level if isinstance(level, int) else level.upper())
    if not _sdk_logging_configured:
        for handler in list(sdk_logger.handlers):
            if isinstance(handler, logging.StreamHandler):
                sdk_logger.removeHandler(handler)
        _sdk_logging_configured = True


def _chain(exc: BaseException | None):
    """``exc`` and its causes/contexts (the SDK wraps transport errors several levels deep)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        if isinstance(exc, BaseExceptionGroup):
            for sub in exc.exceptions:
                yield from _chain(sub)
        exc = exc.__cause__ or exc.__context__


def is_retry_safe(exc: BaseException) -> bool:
    """True when ``exc`` proves the request never ran on the environment."""
    for e in _chain(exc):
        if isinstance(e, httpx.ConnectError):
            return True
        if isinstance(e, httpx.HTTPStatusError) and e.response.status_code in RETRY_STATUS:
            return True
        if type(e).__name__ == "McpError" and "session terminated" in str(e).lower():
            return True  # 404: a restarted server did not know our session; nothing ran
        if "Failed to establish session" in str(e) or "Failed to establish MCP session" in str(e):
            return True  # the SDK never sent the tool call
    return False


def _result_text(content: list[dict[str, Any]]) -> str:
    parts = []
    for item in content:
        if isinstance(item, dict) and item.get("type") == "text" and "text" in item:
            parts.append(str(item["text"]))
        else:
            parts.append(json.dumps(item, ensure_ascii=False, default=str))
    return "\n".join(parts)


class AenvEnvironmentAdapter:
    """Async context manager over ``aenv.Environment`` for one episode.

    ``async with AenvEnvironmentAdapter(cfg) as env: tools = await env.list_tools()``.
    """

    def __init__(self, config: AenvConfig | dict[str, Any]):
        self.config = config if isinstance(config, AenvConfig) else AenvConfig.from_dict(config)
        configure_sdk_logging(self.config.sdk_log_level)
        self._env: Any = None
        self._http: httpx.AsyncClient | None = None
        self._tools: list[dict[str, Any]] | None = None
        self._openai: tuple[list[dict[str, Any]], dict[str, str]] | None = None
        self._lock = asyncio.Lock()
        self._initialized = False
        self.where = f"environment {self.config.env_name} at {redact_url(self.config.aenv_url)}"

    # ---------------------------------------------------------------- lifecycle
    async def __aenter__(self) -> AenvEnvironmentAdapter:
        await self.initialize()
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        if self.config.auto_release:
            await self.release()

    @property
    def initialized(self) -> bool:
        return self._initialized

    async def initialize(self) -> None:
        """Create (scheduler mode) or attach to (direct mode) the instance and wait until ready."""
        if self._initialized:
            return
        from aenv import Environment

        cfg = self.config
        self._env = Environment(
            cfg.env_name,
            aenv_url=cfg.aenv_url,
            api_key=cfg.api_key,
            ttl=cfg.ttl,
            environment_variables=dict(cfg.environment_variables),
            timeout=cfg.timeout,
            startup_timeout=cfg.startup_timeout,
            max_retries=cfg.max_retries,
            skip_for_healthy=True,  # the SDK probe is broken (see module docstring)
        )
        # The SDK's local mode is switched by the DUMMY_INSTANCE_IP environment variable; set the
        # attribute instead so that several environments (and modes) coexist in one process.
        self._env.dummy_instance_ip = cfg.host if cfg.mode == "direct" else None
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(min(5.0, cfg.timeout)))
        try:
            await asyncio.wait_for(self._env.initialize(), cfg.startup_timeout)
            if cfg.mode == "scheduler" and not self._env.proxy_headers and self._env._instance:
                # With skip_for_healthy the SDK never sets its gateway routing headers.
                from aenv.core.environment import make_mcp_url

                inst = self._env._instance
                self._env.proxy_headers = {
                    "AEnvCore-MCPProxy-URL": make_mcp_url(inst.ip, 8081),
                    "AEnvCore-EnvInstance-ID": inst.id,
                }
            if not cfg.skip_health_check:
                await self.wait_ready(cfg.startup_timeout)
            self._initialized = True
            logger.debug("attached to %s", self.where)
        except AenvError:
            await self.release()
            raise
        except Exception as e:
            await self.release()
            raise AenvUnavailableError(
                f"{self.where} could not be initialized: {type(e).__name__}: {e}"
            ) from e
        except BaseException:
            await self.release()
            raise

    async def wait_ready(self, timeout: float) -> None:
        """Poll ``GET /functions/list`` until the server answers 200 (or raise)."""
        deadline = time.monotonic() + timeout
        delay = 0.05
        last: BaseException | str = "no answer"
        while True:
            try:
                r = await self._probe()
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                last = e
            if time.monotonic() + delay > deadline:
                raise AenvUnavailableError(
                    f"{self.where} not ready after {timeout:.1f}s (last: {last})"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def release(self) -> None:
        """Close the MCP session and delete the instance (scheduler mode); never raises.

        Runs to completion even when the calling task is cancelled meanwhile (the cancellation
        is re-raised afterwards), so instances do not leak.
        """
        env, http = self._env, self._http
        self._env, self._http, self._initialized = None, None, False
        self._tools = self._openai = None  # a new instance may have other tools
        if env is None and http is None:
            return
        task = asyncio.ensure_future(self._release(env, http))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, self.config.timeout)
            raise

    async def _release(self, env: Any, http: httpx.AsyncClient | None) -> None:
        if env is not None:
            try:
                await asyncio.wait_for(env.release(), self.config.timeout)
            except BaseException as e:  # noqa: BLE001 - release must not fail the episode
                logger.warning("releasing %s failed: %s: %s", self.where, type(e).__name__, e)
        if http is not None:
            with contextlib.suppress(Exception):
                await http.aclose()

    # ---------------------------------------------------------------- helpers
    def _require(self) -> Any:
        if self._env is None or not self._initialized:
            raise AenvError(f"{self.where} is not initialized (use 'async with' or initialize())")
        return self._env

    async def _probe(self) -> httpx.Response:
        assert self._http is not None and self._env is not None
        return await self._http.get(
            f"{self.config.data_plane_url}/functions/list", headers=self._env.proxy_headers
        )

    async def _preflight(self) -> None:
        """Cheap reachability check before a call: a refused connection is safe to retry."""
        try:
            r = await self._probe()
        except httpx.ConnectError as e:
            await self._reset_session()
            raise _RetrySafe(e) from e
        except httpx.HTTPError:
            return  # inconclusive: let the real call decide
        if r.status_code in RETRY_STATUS:
            raise _RetrySafe(
                httpx.HTTPStatusError(f"HTTP {r.status_code}", request=r.request, response=r)
            )

    async def _reset_session(self) -> None:
        """Drop the SDK's MCP session so the next call opens a new one (server restarted)."""
        env = self._env
        if env is None or env._mcp_client is None:
            return
        client, env._mcp_client, env._mcp_session_active = env._mcp_client, None, False
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(client.close(), 2.0)

    def _retrying(self) -> AsyncRetrying:
        cfg = self.config
        return AsyncRetrying(
            stop=stop_after_attempt(cfg.max_retries + 1),
            wait=wait_exponential(multiplier=cfg.retry_delay, max=cfg.retry_delay * 16)
            + wait_random(0, cfg.retry_delay),
            retry=retry_if_exception_type(_RetrySafe),
            reraise=False,
            before_sleep=lambda rs: logger.info(
                "retrying on %s after attempt %d: %s",
                self.where,
                rs.attempt_number,
                rs.outcome.exception() if rs.outcome else "?",
            ),
        )

    @staticmethod
    def _raise_if_cancelled() -> None:
        # The SDK catches CancelledError (turning it into ToolError, or retrying a session
        # set-up); a cancelled task must still stop, so check after every SDK call.
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise asyncio.CancelledError()

    # ---------------------------------------------------------------- tools
    async def list_tools(self) -> list[dict[str, Any]]:
        """The environment's tools as MCP descriptions (``name``, ``description``,
        ``inputSchema``); fetched once per instance. Listing is read-only, so any transport
        failure is retried."""
        env = self._require()
        async with self._lock:
            if self._tools is not None:
                return self._tools
            attempts = 0
            try:
                async for attempt in self._retrying():
                    with attempt:
                        attempts += 1
                        await self._preflight()
                        try:
                            async with asyncio.timeout(self.config.timeout + 5.0):
                                self._tools = await env.list_tools()
                            self._raise_if_cancelled()
                        except Exception as e:
                            self._raise_if_cancelled()
                            await self._reset_session()
                            raise _RetrySafe(e) from e
            except RetryError as e:
                cause = e.last_attempt.exception()
                cause = cause.cause if isinstance(cause, _RetrySafe) else cause
                raise AenvUnavailableError(
                    f"listing tools of {self.where} failed after {attempts} attempt(s): "
                    f"{type(cause).__name__}: {cause}"
                ) from cause
            return self._tools  # type: ignore[return-value]

    async def openai_tools(self) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """``normalize_openai_tools(await list_tools())``, cached."""
        if self._openai is None:
            self._openai = normalize_openai_tools(await self.list_tools())
        return self._openai

    async def call_tool(
        self, name: str, arguments: dict[str, Any] | None = None, *, timeout: float | None = None
    ) -> ToolCallResult:
        """Run tool ``name`` (bare or ``env@ver/name``) and return its result.

        A tool error (exception inside the tool, unknown tool, invalid arguments) comes back as
        ``ToolCallResult(is_error=True)``. Transport failures are retried only when the call
        cannot have run; otherwise, or after the last try, ``AenvToolCallError`` is raised.
        """
        env = self._require()
        limit = timeout or self.config.tool_call_timeout
        arguments = arguments or {}
        attempts = 0
        try:
            async for attempt in self._retrying():
                with attempt:
                    attempts += 1
                    await self._preflight()
                    try:
                        # asyncio.timeout, not wait_for: the SDK turns cancellation into
                        # ToolError, and a wait_for child task would leak that exception.
                        async with asyncio.timeout(limit + 5.0):
                            result = await env.call_tool(name, arguments, timeout=limit)
                        self._raise_if_cancelled()
                    except Exception as e:
                        self._raise_if_cancelled()
                        if is_retry_safe(e):
                            await self._reset_session()
                            raise _RetrySafe(e) from e
                        raise
                    content = list(result.content or [])
                    return ToolCallResult(
                        text=_result_text(content), is_error=bool(result.is_error), content=content
                    )
        except RetryError as e:
            cause = e.last_attempt.exception()
            cause = cause.cause if isinstance(cause, _RetrySafe) else cause
            raise AenvToolCallError(name, attempts, cause, self.where) from cause
        except (asyncio.CancelledError, AenvError):
            raise
        except Exception as e:
            raise AenvToolCallError(name, attempts, e, self.where) from e
        raise AssertionError("unreachable")  # pragma: no cover

    # ---------------------------------------------------------------- reward / functions
    async def _call_http(self, what: str, fn, arguments: dict[str, Any]) -> Any:
        attempts = 0
        try:
            async for attempt in self._retrying():
                with attempt:
                    attempts += 1
                    try:
                        out = await fn(arguments, timeout=self.config.timeout)
                        self._raise_if_cancelled()
                        return out
                    except Exception as e:
                        self._raise_if_cancelled()
                        if is_retry_safe(e):
                            raise _RetrySafe(e) from e
                        raise
        except RetryError as e:
            cause = e.last_attempt.exception()
            cause = cause.cause if isinstance(cause, _RetrySafe) else cause
            raise AenvCallError(what, attempts, cause, self.where) from cause
        except asyncio.CancelledError:
            raise
        except Exception as e:
            raise AenvCallError(what, attempts, e, self.where) from e

    async def call_reward(self, arguments: dict[str, Any]) -> Any:
        """POST ``arguments`` to the environment's ``@register_reward`` function; its result."""
        env = self._require()
        return await self._call_http("reward", env.call_reward, arguments)

    async def call_function(self, name: str, arguments: dict[str, Any] | None = None) -> Any:
        """POST ``arguments`` to ``/functions/<name>`` (``@register_function``); its result."""
        env = self._require()

        async def fn(args: dict[str, Any], timeout: float) -> Any:
            return await env.call_function(name, args, timeout=timeout)

        return await self._call_http(f"function {name!r}", fn, arguments or {})


def reward_value(result: Any) -> float:
    """A float from a reward function's result: a number, or a dict with ``reward``/``score``."""
    if isinstance(result, bool):
        return float(result)
    if isinstance(result, (int, float)):
        return float(result)
    if isinstance(result, str):
        return float(result.strip())
    if isinstance(result, dict):
        for key in ("reward", "score", "value"):
            if key in result:
                return reward_value(result[key])
    raise ValueError(f"cannot read a reward from {result!r} (expected a number or {{'reward': x}})")
