"""``AenvEnvironmentAdapter``: one aenvironment instance for one episode, used safely.

It speaks aenvironment's wire protocol itself (no import of the ``aenv`` SDK, whose pins would
hold the core's SDKs back): the data plane is MCP streamable HTTP at ``http://HOST:8081/mcp``
(official ``mcp`` SDK), the reward is ``POST /task/reward``, functions are
``POST /functions/<name>`` (answers ``{"success": true, "data": ...}`` or
``{"success": false, "error": ...}``), readiness is ``GET /functions/list``; scheduler mode
creates and deletes instances on the control plane (``control.py``). Contracts are pinned by the
tests against real ``python -m aenv.main`` servers.

What an RL loop needs on top:

* readiness is our own ``GET /functions/list`` probe (the server's ``/health`` always probes
  ``localhost:8081``, whatever its own address);
* release happens on every exit path, cancellation included;
* retries happen only where the tool can not have run (see ``mcp_session``); a timeout or a
  broken connection after the request was sent is *not* retried, and a tool that ran and
  reported an error is a result, not a failure;
* a dead server is noticed in milliseconds (a cheap probe before each call);
* URLs are logged without credentials.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import httpx
from tenacity import RetryError

from areal_env.envs.adapter_base import McpAdapterBase, RetrySafe, retry_cause
from areal_env.envs.aenv.config import AenvConfig, redact_url
from areal_env.envs.aenv.control import (
    CONTROL_PORT,
    ControlPlaneClient,
    Instance,
    routing_headers,
)
from areal_env.envs.base import (
    EnvCallError,
    EnvError,
    EnvUnavailableError,
)
from areal_env.envs.mcp_session import HttpTarget, McpSession, SessionDead
from areal_env.http.client import default_ssl_context

logger = logging.getLogger(__name__)

RETRY_STATUS = frozenset({502, 503, 504})


def is_retry_safe(exc: BaseException) -> bool:
    """True when ``exc`` proves an HTTP request never ran on the environment: the connection
    was refused, or a gateway answered 502/503/504 (decided from types and status codes)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, SessionDead):
            return e.retry_safe
        if isinstance(e, httpx.ConnectError):
            return True
        if isinstance(e, httpx.HTTPStatusError) and e.response.status_code in RETRY_STATUS:
            return True
        e = e.__cause__ or e.__context__
    return False


class AenvEnvironmentAdapter(McpAdapterBase):
    """Async context manager over one aenvironment instance for one episode.

    ``async with AenvEnvironmentAdapter(cfg) as env: tools = await env.list_tools()``.
    Implements ``areal_env.envs.ToolEnvironment``.
    """

    config: AenvConfig

    has_reward = True

    def __init__(self, config: AenvConfig | dict[str, Any]):
        self.config = config if isinstance(config, AenvConfig) else AenvConfig.from_dict(config)
        self._http: httpx.AsyncClient | None = None
        self._control: ControlPlaneClient | None = None
        self._session: McpSession | None = None
        self.instance: Instance | None = None
        self.headers: dict[str, str] = {}
        """Data-plane routing headers (scheduler mode: the gateway routes by them)."""
        self._tools: list[dict[str, Any]] | None = None
        self._openai: tuple[list[dict[str, Any]], dict[str, str]] | None = None
        self._lock = asyncio.Lock()
        self._session_lock = asyncio.Lock()
        self._initialized = False
        self.where = f"environment {self.config.env_name} at {redact_url(self.config.aenv_url)}"

    @property
    def data_plane_url(self) -> str:
        return self.config.data_plane_url

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
        cfg = self.config
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(min(5.0, cfg.timeout)), verify=default_ssl_context()
        )
        try:
            async with asyncio.timeout(cfg.startup_timeout):
                if cfg.mode == "scheduler":
                    await self._create_instance()
                if not cfg.skip_health_check:
                    await self.wait_ready(cfg.startup_timeout)
            self._initialized = True
            logger.debug("attached to %s", self.where)
        except TimeoutError as e:
            await self.release()
            raise EnvUnavailableError(
                f"{self.where} not ready after {cfg.startup_timeout:.1f}s"
            ) from e
        except EnvError:
            await self.release()
            raise
        except Exception as e:
            await self.release()
            raise EnvUnavailableError(
                f"{self.where} could not be initialized: {type(e).__name__}: {e}"
            ) from e
        except BaseException:
            await self.release()
            raise

    async def _create_instance(self) -> None:
        cfg = self.config
        self._control = ControlPlaneClient(
            f"http://{cfg.host}:{CONTROL_PORT}", api_key=cfg.api_key, timeout=cfg.timeout
        )
        name, _, version = cfg.env_name.partition("@")
        request: dict[str, Any] = {
            "envName": cfg.env_name,
            "datasource": cfg.datasource,
            "ttl": cfg.ttl,
            "environment_variables": {
                **cfg.environment_variables,
                "envNAME": name,
                "envversion": version,
            },
            "arguments": list(cfg.arguments),
        }
        for key in ("owner", "labels", "mount_points"):
            if getattr(cfg, key) is not None:
                request[key] = getattr(cfg, key)
        async for attempt in self._retrying(reraise=True):
            with attempt:
                try:
                    self.instance = await self._control.create(request)
                except httpx.ConnectError as e:
                    raise RetrySafe(e) from e
        assert self.instance is not None
        self.instance = await self._control.wait_running(self.instance, cfg.startup_timeout)
        self.headers = routing_headers(self.instance)

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
                raise EnvUnavailableError(
                    f"{self.where} not ready after {timeout:.1f}s (last: {last})"
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def release(self) -> None:
        """Close the MCP session and delete the instance (scheduler mode); never raises.

        Runs to completion even when the calling task is cancelled meanwhile (the cancellation
        is re-raised afterwards), so instances do not leak.
        """
        session, http, control, instance = self._session, self._http, self._control, self.instance
        self._session = self._http = self._control = self.instance = None
        self._initialized = False
        self._tools = self._openai = None  # a new instance may have other tools
        if session is None and http is None and control is None:
            return
        task = asyncio.ensure_future(self._release(session, http, control, instance))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, self.config.timeout)
            raise

    async def _release(
        self,
        session: McpSession | None,
        http: httpx.AsyncClient | None,
        control: ControlPlaneClient | None,
        instance: Instance | None,
    ) -> None:
        if session is not None:
            await session.close()
        if control is not None:
            if instance is not None:
                try:
                    await asyncio.wait_for(control.delete(instance.id), self.config.timeout)
                except BaseException as e:  # noqa: BLE001 - release must not fail the episode
                    logger.warning(
                        "deleting instance %s of %s failed: %s: %s",
                        instance.id,
                        self.where,
                        type(e).__name__,
                        e,
                    )
            with contextlib.suppress(Exception):
                await control.aclose()
        if http is not None:
            with contextlib.suppress(Exception):
                await http.aclose()

    # ---------------------------------------------------------------- helpers
    def _check_ready(self) -> None:
        if not self._initialized:
            raise EnvError(f"{self.where} is not initialized (use 'async with' or initialize())")

    async def _probe(self) -> httpx.Response:
        assert self._http is not None
        return await self._http.get(f"{self.data_plane_url}/functions/list", headers=self.headers)

    async def _preflight(self) -> None:
        """Cheap reachability check before a call: a refused connection is safe to retry."""
        try:
            r = await self._probe()
        except httpx.ConnectError as e:
            await self._drop_session()
            raise RetrySafe(e) from e
        except httpx.HTTPError:
            return  # inconclusive: let the real call decide
        if r.status_code in RETRY_STATUS:
            raise RetrySafe(
                httpx.HTTPStatusError(f"HTTP {r.status_code}", request=r.request, response=r)
            )

    async def _session_for_call(self) -> McpSession:
        """The open MCP session (opened on first use, re-opened after a server restart)."""
        async with self._session_lock:
            if self._session is not None and self._session.alive:
                return self._session
            if self._session is not None:
                await self._session.close()
            session = McpSession(
                HttpTarget(f"{self.data_plane_url}/mcp", dict(self.headers)),
                timeout=self.config.timeout,
                where=self.where,
            )
            try:
                await session.open(self.config.timeout)
            except SessionDead as e:
                raise RetrySafe(e) from e
            self._session = session
            return session

    async def _drop_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def _recover(self, e: BaseException, *, read_only: bool) -> bool:
        await self._drop_session()
        return read_only or (isinstance(e, SessionDead) and e.retry_safe)

    def _cause(self, e: RetryError) -> BaseException:
        cause = retry_cause(e)
        if isinstance(cause, SessionDead) and cause.cause is not None:
            inner = cause.cause
            for c in (inner, inner.__cause__, inner.__context__):
                if isinstance(c, httpx.ConnectError):
                    return c
        return cause

    # ---------------------------------------------------------------- tools
    def _wire_name(self, name: str) -> str:
        """Tools are listed as ``env@ver/tool``; the server knows the bare name."""
        prefix, sep, bare = name.rpartition("/")
        if sep and prefix != self.config.env_name:
            return name  # refused by the server as an unknown tool
        return bare if sep else name

    def _listed(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``name`` as ``env@ver/tool`` (the aenvironment convention)."""
        return [{**t, "name": f"{self.config.env_name}/{t['name']}"} for t in tools]

    # ---------------------------------------------------------------- reward / functions
    async def _post_once(
        self, what: str, url: str, arguments: dict[str, Any], attempts: int
    ) -> Any:
        assert self._http is not None
        try:
            r = await self._http.post(
                url, json=arguments, headers=self.headers, timeout=self.config.timeout
            )
            if r.status_code in RETRY_STATUS:
                r.raise_for_status()
        except httpx.HTTPError as e:
            if is_retry_safe(e):
                raise RetrySafe(e) from e
            raise
        try:
            body = r.json()
        except ValueError:
            error: Any = r.text[:200]
        else:
            if isinstance(body, dict) and body.get("success", False):
                return body.get("data", {})
            error = body.get("error") if isinstance(body, dict) else body
        raise EnvCallError(
            what, attempts, RuntimeError(f"HTTP {r.status_code}: {error}"), self.where
        ) from None

    async def _post(self, what: str, path: str, arguments: dict[str, Any]) -> Any:
        self._check_ready()
        url = f"{self.data_plane_url}{path}"
        return await self._with_retries(
            lambda n: self._post_once(what, url, arguments, n),
            lambda n, cause: EnvCallError(what, n, cause, self.where),
            wrap_errors=True,
        )

    async def call_reward(self, arguments: dict[str, Any]) -> Any:
        """POST ``arguments`` to the environment's ``@register_reward`` function; its result."""
        return await self._post("reward", "/task/reward", arguments)

    async def call_function(self, name: str, arguments: dict[str, Any] | None = None) -> Any:
        """POST ``arguments`` to ``/functions/<name>`` (``@register_function``); its result."""
        return await self._post(f"function {name!r}", f"/functions/{name}", arguments or {})
