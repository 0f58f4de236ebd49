"""Client helpers for agents that train through an areal-env training service from anywhere.

Light on purpose (``httpx`` and the standard library; ``tqdm`` for the progress bar): it runs on
the user's machine next to their agent code, without torch or the training stack.

``AgentSession`` groups every OpenAI/Anthropic SDK call made inside its block into one
trajectory without changing the agent code: a ``ContextVar`` holds the active session ids, and
``httpx.Client.send`` / ``httpx.AsyncClient.send`` (which both SDKs use) are wrapped once to add
the ``X-Areal-Session`` header to requests bound for a service with an active session in the
current context. Each asyncio task (and thread) has its own context, so concurrent sessions in
one process stay separate.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import os
import random
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

logger = logging.getLogger(__name__)

SESSION_HEADER = "X-Areal-Session"
"""Header naming the session of a model call (the gateway routes and records by it)."""

TRANSIENT_STATUS = frozenset({429, 502, 503, 504})
"""HTTP statuses worth retrying with a new session (capacity, quota, backend loss)."""

# (service URL, session id) pairs active in the current context, innermost last.
_ACTIVE: contextvars.ContextVar[tuple[tuple[httpx.URL, str], ...]] = contextvars.ContextVar(
    "areal_env_active_sessions", default=()
)
_CURRENT: contextvars.ContextVar[AgentSession | None] = contextvars.ContextVar(
    "areal_env_current_session", default=None
)
_hook_lock = threading.Lock()
_hook_installed = False


class AgentServiceError(RuntimeError):
    """The training service answered an error (``status_code`` is the HTTP status)."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(f"{status_code}: {message}")
        self.status_code = status_code
        self.message = message


def _matches(url: Any, service: httpx.URL) -> bool:
    return (
        url.scheme == service.scheme
        and url.host == service.host
        and url.port == service.port
        and url.path.startswith(service.path.rstrip("/") + "/")
    )


def _tag(request: Any) -> None:
    active = _ACTIVE.get()
    if not active or SESSION_HEADER in request.headers:
        return
    for service, session_id in reversed(active):
        if _matches(request.url, service):
            request.headers[SESSION_HEADER] = session_id
            return


def _http_modules() -> list[Any]:
    """``httpx`` and its forks that SDKs use (the ``anthropic`` SDK ships on ``httpx2``)."""
    import importlib

    modules = [httpx]
    for name in ("httpx2",):
        try:
            modules.append(importlib.import_module(name))
        except ImportError:
            pass
    return modules


def _wrap(cls: type) -> None:
    async_send = cls.send
    if getattr(async_send, "_areal_session_hook", False):
        return
    if asyncio.iscoroutinefunction(async_send):

        @functools.wraps(async_send)
        async def send(self: Any, request: Any, *a: Any, **k: Any) -> Any:
            _tag(request)
            return await async_send(self, request, *a, **k)

    else:

        @functools.wraps(async_send)
        def send(self: Any, request: Any, *a: Any, **k: Any) -> Any:
            _tag(request)
            return async_send(self, request, *a, **k)

    send._areal_session_hook = True  # type: ignore[attr-defined]
    cls.send = send  # type: ignore[method-assign]


def install_session_hook() -> None:
    """Wrap ``send`` of the ``httpx`` clients (and forks) once so that requests carry the
    session header of the current context."""
    global _hook_installed
    with _hook_lock:
        if _hook_installed:
            return
        for module in _http_modules():
            for name in ("AsyncClient", "Client"):
                cls = getattr(module, name, None)
                if cls is not None:
                    _wrap(cls)
        _hook_installed = True


def default_service_url() -> str:
    """``OPENAI_BASE_URL`` without its trailing ``/v1``."""
    base = os.environ.get("OPENAI_BASE_URL")
    if not base:
        raise ValueError("no service_url given and OPENAI_BASE_URL is not set")
    base = base.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def current_session() -> AgentSession | None:
    """The innermost ``AgentSession`` active in this context (for agents that set rewards)."""
    return _CURRENT.get()


def _check(resp: httpx.Response) -> dict[str, Any]:
    if resp.status_code >= 400:
        try:
            data = resp.json()
            err = data.get("error", data)
            message = err.get("message") if isinstance(err, dict) else str(err)
        except ValueError:
            message = resp.text[:200]
        raise AgentServiceError(resp.status_code, message or resp.reason_phrase)
    return resp.json()


class AgentSession:
    """One trajectory on the training service; use as ``async with`` (or plain ``with``).

    Inside the block every request to ``service_url`` made through ``httpx`` (the ``openai``
    and ``anthropic`` SDKs, sync or async) carries this session. ``set_reward`` and
    ``finalize`` are coroutines in an ``async with`` block and plain calls in a ``with`` block.

    Leaving the block:
    - with an exception: the session is finalized as failed (excluded from training) and the
      exception propagates;
    - without ``finalize``: finalized as ok when ``set_reward`` was called, else as failed
      (a trajectory with no reward signal teaches nothing), with a warning.
    """

    def __init__(
        self,
        service_url: str | None = None,
        api_key: str | None = None,
        *,
        group_id: str | None = None,
        task_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        timeout: float = 60.0,
        http_client: httpx.AsyncClient | None = None,
        verify: bool | str = True,
    ) -> None:
        self.service_url = (service_url or default_service_url()).rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY", "")
        self.group_id = group_id
        self.task_id = task_id
        self.metadata = metadata or {}
        self.session_id: str | None = None
        self.finalized: dict[str, Any] | None = None
        self._timeout = timeout
        self._verify = verify
        self._shared_async = http_client
        self._async: httpx.AsyncClient | None = None
        self._sync: httpx.Client | None = None
        self._rewarded = False
        self._tokens: tuple[contextvars.Token, contextvars.Token] | None = None

    # -- properties for agents that cannot rely on the header hook -------------------------

    @property
    def openai_base_url(self) -> str:
        return self.service_url + "/v1"

    @property
    def headers(self) -> dict[str, str]:
        """Headers to add by hand (``default_headers=`` of an SDK client)."""
        return {SESSION_HEADER: self.session_id or ""}

    @property
    def session_api_key(self) -> str:
        """``USER_KEY:SESSION_ID``: an API key that names the session by itself."""
        return f"{self.api_key}:{self.session_id}"

    def _auth(self) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {self.api_key}"}
        if self.session_id:
            headers[SESSION_HEADER] = self.session_id
        return headers

    def _create_payload(self) -> dict[str, Any]:
        return {"group_id": self.group_id, "task_id": self.task_id, "metadata": self.metadata}

    def _activate(self, session_id: str) -> None:
        self.session_id = session_id
        active = _ACTIVE.get() + ((httpx.URL(self.service_url), session_id),)
        self._tokens = (_ACTIVE.set(active), _CURRENT.set(self))

    def _deactivate(self) -> None:
        if self._tokens is not None:
            try:
                _ACTIVE.reset(self._tokens[0])
                _CURRENT.reset(self._tokens[1])
            except ValueError:  # left from another context: drop our entry instead
                _ACTIVE.set(tuple(e for e in _ACTIVE.get() if e[1] != self.session_id))
            self._tokens = None

    def _exit_status(self, failed: bool) -> tuple[str, str | None]:
        if failed:
            return "failed", "the agent raised"
        if self._rewarded:
            return "ok", None
        logger.warning(
            "session %s left without finalize() or set_reward(): finalized as failed",
            self.session_id,
        )
        return "failed", "no reward"

    # -- async -----------------------------------------------------------------------------

    async def __aenter__(self) -> AgentSession:
        install_session_hook()
        if self._shared_async is None:
            self._async = httpx.AsyncClient(timeout=self._timeout, verify=self._verify)
        client = self._shared_async or self._async
        assert client is not None
        try:
            resp = await client.post(
                self.service_url + "/rl/v1/sessions",
                json=self._create_payload(),
                headers=self._auth(),
            )
            data = _check(resp)
        except BaseException:
            await self._close_async()
            raise
        self._activate(data["session_id"])
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._deactivate()
        try:
            if self.finalized is None:
                status, _ = self._exit_status(exc_type is not None)
                try:
                    await self._afinalize(None, status)
                except (httpx.HTTPError, AgentServiceError) as e:
                    if exc_type is None:
                        raise
                    logger.warning("could not finalize failed session %s: %s", self.session_id, e)
        finally:
            await self._close_async()

    async def _close_async(self) -> None:
        if self._async is not None:
            await self._async.aclose()
            self._async = None

    async def _apost(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        client = self._shared_async or self._async
        if client is None:
            raise RuntimeError("the session is not open (use `async with AgentSession(...)`)")
        resp = await client.post(self.service_url + path, json=payload, headers=self._auth())
        return _check(resp)

    async def _aset_reward(self, completion_id: str | None, reward: float) -> dict[str, Any]:
        payload = {"completion_id": completion_id, "reward": float(reward)}
        data = await self._apost("/rl/v1/set_reward", payload)
        self._rewarded = True
        return data

    async def _afinalize(self, final_reward: float | None, status: str) -> dict[str, Any]:
        if self.finalized is not None:
            return self.finalized
        payload = {"final_reward": final_reward, "status": status}
        self.finalized = await self._apost("/rl/v1/finalize", payload)
        return self.finalized

    # -- sync ------------------------------------------------------------------------------

    def __enter__(self) -> AgentSession:
        install_session_hook()
        self._sync = httpx.Client(timeout=self._timeout, verify=self._verify)
        try:
            resp = self._sync.post(
                self.service_url + "/rl/v1/sessions",
                json=self._create_payload(),
                headers=self._auth(),
            )
            data = _check(resp)
        except BaseException:
            self._sync.close()
            self._sync = None
            raise
        self._activate(data["session_id"])
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._deactivate()
        try:
            if self.finalized is None:
                status, _ = self._exit_status(exc_type is not None)
                try:
                    self._sfinalize(None, status)
                except (httpx.HTTPError, AgentServiceError) as e:
                    if exc_type is None:
                        raise
                    logger.warning("could not finalize failed session %s: %s", self.session_id, e)
        finally:
            if self._sync is not None:
                self._sync.close()
                self._sync = None

    def _spost(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        if self._sync is None:
            raise RuntimeError("the session is not open (use `with AgentSession(...)`)")
        return _check(self._sync.post(self.service_url + path, json=payload, headers=self._auth()))

    def _sfinalize(self, final_reward: float | None, status: str) -> dict[str, Any]:
        if self.finalized is None:
            payload = {"final_reward": final_reward, "status": status}
            self.finalized = self._spost("/rl/v1/finalize", payload)
        return self.finalized

    # -- public, both modes ----------------------------------------------------------------

    def set_reward(self, completion_id: str | None, reward: float) -> Any:
        """Reward one completion (``None`` = the latest). Awaitable inside ``async with``."""
        if self._sync is not None:
            data = self._spost(
                "/rl/v1/set_reward", {"completion_id": completion_id, "reward": float(reward)}
            )
            self._rewarded = True
            return data
        return self._aset_reward(completion_id, reward)

    def finalize(self, final_reward: float | None = None, *, status: str = "ok") -> Any:
        """End the trajectory: ``final_reward`` goes to the last completion; ``status="failed"``
        excludes it from training. Idempotent. Awaitable inside ``async with``."""
        if status not in ("ok", "failed"):
            raise ValueError("status must be 'ok' or 'failed'")
        if self._sync is not None:
            return self._sfinalize(final_reward, status)
        return self._afinalize(final_reward, status)


def _status_of(exc: BaseException) -> int | None:
    status = getattr(exc, "status_code", None)
    if status is None:
        status = getattr(getattr(exc, "response", None), "status_code", None)
    return status if isinstance(status, int) else None


def is_transient(exc: BaseException) -> bool:
    """Connection failures and 429/502/503/504 answers (from httpx, openai, anthropic, us)."""
    if isinstance(exc, (httpx.TransportError, asyncio.TimeoutError)):
        return True
    if _status_of(exc) in TRANSIENT_STATUS:
        return True
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(names & {"APIConnectionError", "APITimeoutError"})


@dataclass
class AgentResult:
    """What ``AgentRunner.run`` got for one dataset item (``group_size`` samples)."""

    index: int
    item: Any
    rewards: list[float | None] = field(default_factory=list)
    errors: list[str | None] = field(default_factory=list)
    session_ids: list[str | None] = field(default_factory=list)
    attempts: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(e is None for e in self.errors)

    @property
    def mean_reward(self) -> float | None:
        vals = [r for r in self.rewards if r is not None]
        return sum(vals) / len(vals) if vals else None


AgentFn = Callable[[Any], Awaitable[float | None]]


class AgentRunner:
    """Run an async agent over a dataset through the training service.

    Each item runs ``group_size`` times, each run in its own ``AgentSession`` sharing one
    ``group_id`` (one GRPO group, so ``group_size`` should equal the service's
    ``rollout.n_samples``). ``agent_fn(item)`` returns the reward (finalized for it) or None
    (it finalized or rewarded through ``current_session()`` itself). Transient failures
    (connection errors, 502/503/504) are retried in a new session with backoff, at most
    ``max_retries`` times; "busy" answers (429: quota, or the trainer has enough rollouts in
    flight) are retried for up to ``patience`` seconds.
    """

    def __init__(
        self,
        service_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 60.0,
        verify: bool | str = True,
    ) -> None:
        self.service_url = (service_url or default_service_url()).rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY", "")
        self.timeout = timeout
        self.verify = verify

    async def run(
        self,
        agent_fn: AgentFn,
        dataset: Iterable[Any],
        *,
        concurrency: int = 8,
        group_size: int = 1,
        max_retries: int = 3,
        progress: bool = True,
        backoff: float = 0.5,
        group_prefix: str | None = None,
        patience: float = 3600.0,
    ) -> list[AgentResult]:
        items = list(dataset)
        if concurrency < 1 or group_size < 1 or max_retries < 0:
            raise ValueError("concurrency and group_size must be >= 1, max_retries >= 0")
        prefix = group_prefix or "run-" + secrets.token_hex(4)
        results = [
            AgentResult(
                index=i,
                item=item,
                rewards=[None] * group_size,
                errors=[None] * group_size,
                session_ids=[None] * group_size,
                attempts=[0] * group_size,
            )
            for i, item in enumerate(items)
        ]
        semaphore = asyncio.Semaphore(concurrency)
        bar = _progress(len(items) * group_size, progress)
        async with httpx.AsyncClient(timeout=self.timeout, verify=self.verify) as http:

            async def one(index: int, sample: int) -> None:
                res = results[index]
                async with semaphore:
                    failures = 0  # transient failures other than "busy" (429)
                    started = time.monotonic()
                    while True:
                        res.attempts[sample] += 1
                        try:
                            reward, sid = await self._episode(
                                http, agent_fn, res.item, f"{prefix}-{index}"
                            )
                            res.rewards[sample], res.session_ids[sample] = reward, sid
                            res.errors[sample] = None
                            break
                        except Exception as e:  # noqa: BLE001 - reported per item
                            res.errors[sample] = f"{type(e).__name__}: {e}"
                            busy = _status_of(e) == 429
                            if busy:  # quota or trainer backlog: wait it out, up to patience
                                give_up = time.monotonic() - started > patience
                            else:
                                failures += 1
                                give_up = not is_transient(e) or failures > max_retries
                            if give_up:
                                logger.warning("item %d sample %d failed: %s", index, sample, e)
                                break
                            step = min(res.attempts[sample] - 1, 8)
                            delay = min(backoff * 2**step, 10.0) * (0.5 + random.random())
                            await asyncio.sleep(delay)
                if bar is not None:
                    bar.update(1)

            try:
                await asyncio.gather(
                    *(one(i, s) for i in range(len(items)) for s in range(group_size))
                )
            finally:
                if bar is not None:
                    bar.close()
        return results

    async def _episode(
        self, http: httpx.AsyncClient, agent_fn: AgentFn, item: Any, group_id: str
    ) -> tuple[float | None, str | None]:
        session = AgentSession(
            self.service_url,
            self.api_key,
            group_id=group_id,
            http_client=http,
            timeout=self.timeout,
        )
        async with session:
            reward = await agent_fn(item)
            if reward is not None and session.finalized is None:
                await session.finalize(float(reward))
            if session.finalized is not None and session.finalized.get("status") == "failed":
                raise AgentServiceError(
                    422, f"session failed: {session.finalized.get('reason', 'unknown')}"
                )
        return (None if reward is None else float(reward)), session.session_id

    def run_sync(
        self, agent_fn: AgentFn, dataset: Iterable[Any], **kwargs: Any
    ) -> list[AgentResult]:
        """``run`` for scripts without an event loop."""
        return asyncio.run(self.run(agent_fn, dataset, **kwargs))


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional on the client side
        return None
    return tqdm(total=total, desc="agent sessions", unit="session")
