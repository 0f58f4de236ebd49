"""``AgentSession``: one trajectory on the training service, around unchanged agent code.

Inside ``async with AgentSession():`` (or ``with``), every request the agent sends to the
service belongs to the session, whichever way it is sent:

- through ``httpx`` (the openai and anthropic SDKs), ``aiohttp`` or ``requests``: the session
  hook adds the ``X-Areal-Session`` header (per asyncio task / thread, so concurrent sessions in
  one process stay apart);
- through anything else: the session-scoped URL ``session.base_url``
  (``{service}/s/{session_id}/v1``), which the block also puts into ``OPENAI_BASE_URL`` /
  ``ANTHROPIC_BASE_URL`` (``set_env=True``), so an SDK client created inside the block, or a
  subprocess started there, reaches the session with no code at all.

Rewards may be given through the session object, the module helpers ``set_reward`` /
``finalize`` (the current session), or raw ``POST /rl/v1/set_reward`` / ``/rl/v1/finalize``
calls: when the block ends the session asks the service what happened, so it never finalizes
twice nor drops a reward given another way.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import threading
import time
from typing import Any

import httpx

from areal_env_client.hooks import (
    ACTIVE_SESSIONS,
    SESSION_HEADER,
    SESSION_PATH,
    install_session_hook,
)
from areal_env_client.retry import RetryBudget

logger = logging.getLogger(__name__)

_CURRENT: contextvars.ContextVar[AgentSession | None] = contextvars.ContextVar(
    "areal_env_current_session", default=None
)

ENV_VARS = ("OPENAI_BASE_URL", "ANTHROPIC_BASE_URL", "AREAL_SESSION_URL")
"""Set for the block (``set_env=True``): the session-scoped URL (OpenAI's with ``/v1``)."""

_env_lock = threading.Lock()
_env_stack: list[AgentSession] = []
_env_saved: dict[str, str | None] = {}


class AgentServiceError(RuntimeError):
    """The training service answered an error (``status_code`` is the HTTP status;
    ``retry_after`` the seconds it asked to wait, if it said)."""

    def __init__(self, status_code: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(f"{status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.retry_after = retry_after


def strip_session_path(url: str) -> str:
    """``http://h:p[/prefix]`` from a service URL that may end in ``/v1`` or ``/s/<id>[/v1]``."""
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")]
    head, sep, tail = url.rpartition(SESSION_PATH)
    if sep and tail and "/" not in tail:
        url = head
    return url


def default_service_url() -> str:
    """The service root from ``OPENAI_BASE_URL`` (without ``/v1`` or a session path)."""
    base = os.environ.get("OPENAI_BASE_URL")
    if not base:
        raise ValueError("no service_url given and OPENAI_BASE_URL is not set")
    return strip_session_path(base)


def current_session() -> AgentSession | None:
    """The innermost ``AgentSession`` active in this context (for code deep inside an agent)."""
    return _CURRENT.get()


def _retry_after(resp: httpx.Response) -> float | None:
    value = resp.headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def check_response(resp: httpx.Response) -> dict[str, Any]:
    """The JSON body of a 2xx answer, else ``AgentServiceError`` with the service's message."""
    if resp.status_code >= 400:
        try:
            data = resp.json()
            err = data.get("error", data) if isinstance(data, dict) else data
            message = err.get("message") if isinstance(err, dict) else str(err)
        except ValueError:
            message = resp.text[:200]
        raise AgentServiceError(resp.status_code, message or resp.reason_phrase, _retry_after(resp))
    return resp.json()


def _reward_payload(reward: float, completion_id: str | None, train: bool) -> dict[str, Any]:
    payload: dict[str, Any] = {"completion_id": completion_id, "reward": float(reward)}
    if not train:
        payload["train"] = False
    return payload


def _need_session() -> AgentSession:
    session = current_session()
    if session is None:
        raise RuntimeError("no AgentSession is active here (use `async with AgentSession():`)")
    return session


def set_reward(reward: float, completion_id: str | None = None, *, train: bool = True) -> Any:
    """Reward a completion of the current session (``None`` = its latest completion;
    ``train=False``: leave it out of the loss). Awaitable inside ``async with``, a plain call
    inside ``with``."""
    return _need_session().set_reward(reward, completion_id, train=train)


def finalize(final_reward: float | None = None, *, status: str = "ok") -> Any:
    """Finalize the current session (see ``AgentSession.finalize``)."""
    return _need_session().finalize(final_reward, status=status)


class AgentSession:
    """One trajectory on the training service; use as ``async with`` (or plain ``with``).

    Entering the block opens the session. While the service is busy (429: the trainer has
    enough rollouts in flight, or a key quota), stopping or restarting (503, or unreachable),
    the start is asked again with backoff (honouring ``Retry-After``) within ``retry``'s budget
    (default: 300 s of outage, 3600 s of busy answers); ``retry.waits`` counts those answers.

    Leaving the block:
    - after ``finalize`` (here or by a raw call through the service): nothing more to do;
    - with an exception: finalized as failed (excluded from training); the exception propagates;
    - otherwise: finalized as ok when a reward was set (here or by a raw call), else as failed
      (a trajectory with no reward teaches nothing), with a warning.
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
        set_env: bool = True,
        retry: RetryBudget | None = None,
    ) -> None:
        self.service_url = strip_session_path(service_url or default_service_url())
        self.retry = retry if retry is not None else RetryBudget()
        """How long the start waits out a busy, stopping or unreachable service."""
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY", "")
        self.group_id = group_id
        self.task_id = task_id
        self.metadata = metadata or {}
        self.session_id: str | None = None
        self.finalized: dict[str, Any] | None = None
        self.set_env = set_env
        self.retry_on_failure = True
        """Cleared by ``AgentRunner`` when a failed attempt will not be retried: the service
        then stops waiting for this member of the group."""
        self._timeout = timeout
        self._verify = verify
        self._shared_async = http_client
        self._async: httpx.AsyncClient | None = None
        self._sync: httpx.Client | None = None
        self._rewarded = False
        self._tokens: tuple[contextvars.Token, contextvars.Token] | None = None

    # -- addresses for agents that cannot rely on the header hook --------------------------

    @property
    def session_url(self) -> str:
        """``{service}/s/{session_id}``: every service route below it names this session."""
        if self.session_id is None:
            raise RuntimeError("the session is not open yet")
        return f"{self.service_url}{SESSION_PATH}{self.session_id}"

    @property
    def base_url(self) -> str:
        """OpenAI base URL of this session (``{service}/s/{session_id}/v1``)."""
        return self.session_url + "/v1"

    @property
    def openai_base_url(self) -> str:
        return self.base_url

    @property
    def headers(self) -> dict[str, str]:
        """Headers to add by hand (``default_headers=`` of an SDK client)."""
        return {SESSION_HEADER: self.session_id or ""}

    @property
    def session_api_key(self) -> str:
        """``USER_KEY:SESSION_ID``: an API key that names the session by itself."""
        return f"{self.api_key}:{self.session_id}"

    # -- shared ----------------------------------------------------------------------------

    def _auth(self) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {self.api_key}"}
        if self.session_id:
            headers[SESSION_HEADER] = self.session_id
        return headers

    def _start_delay(self, exc: Exception) -> float:
        """Seconds to wait before asking for the session again; re-raises ``exc`` when the
        failure is final or ``retry``'s budget is spent."""
        if not self.retry.will_retry(exc, before_session=True):
            raise exc
        delay = self.retry.failed(exc, before_session=True)
        logger.info(
            "the service cannot open a session now (%s); asking again in %.1f s", exc, delay
        )
        return delay

    def _create_payload(self) -> dict[str, Any]:
        return {"group_id": self.group_id, "task_id": self.task_id, "metadata": self.metadata}

    def _activate(self, session_id: str) -> None:
        self.session_id = session_id
        active = ACTIVE_SESSIONS.get() + ((httpx.URL(self.service_url), session_id),)
        self._tokens = (ACTIVE_SESSIONS.set(active), _CURRENT.set(self))
        if self.set_env:
            with _env_lock:
                if not _env_stack:
                    _env_saved.clear()
                    _env_saved.update({k: os.environ.get(k) for k in ENV_VARS})
                _env_stack.append(self)
                self._apply_env()

    def _apply_env(self) -> None:
        os.environ["OPENAI_BASE_URL"] = self.base_url
        os.environ["ANTHROPIC_BASE_URL"] = self.session_url
        os.environ["AREAL_SESSION_URL"] = self.session_url

    def _deactivate(self) -> None:
        if self._tokens is not None:
            try:
                ACTIVE_SESSIONS.reset(self._tokens[0])
                _CURRENT.reset(self._tokens[1])
            except ValueError:  # left from another context: drop our entry instead
                ACTIVE_SESSIONS.set(
                    tuple(e for e in ACTIVE_SESSIONS.get() if e[1] != self.session_id)
                )
            self._tokens = None
        if self.set_env:
            with _env_lock:
                if self in _env_stack:
                    _env_stack.remove(self)
                    if _env_stack:
                        _env_stack[-1]._apply_env()
                    else:
                        for k, v in _env_saved.items():
                            if v is None:
                                os.environ.pop(k, None)
                            else:
                                os.environ[k] = v

    def _exit_plan(self, failed: bool, server: dict[str, Any] | None) -> tuple[str, bool]:
        """``(status, send)``: how to finalize on exit, given the service's view of the session
        (``None`` when it could not be asked)."""
        if server is not None and server.get("state") in ("done", "failed", "finalizing"):
            return server["state"], False  # finalized by a raw call: adopt it
        if failed:
            return "failed", True
        rewarded = self._rewarded or bool(server and server.get("rewarded"))
        if rewarded:
            return "ok", True
        logger.warning(
            "session %s left without finalize() or a reward: finalized as failed",
            self.session_id,
        )
        return "failed", True

    def _payload(self, final_reward: float | None, status: str) -> dict[str, Any]:
        payload: dict[str, Any] = {"final_reward": final_reward, "status": status}
        if status == "failed" and not self.retry_on_failure:
            payload["retry"] = False
        return payload

    @staticmethod
    def _adopted(server: dict[str, Any]) -> dict[str, Any]:
        return {
            "session_id": server.get("session_id"),
            "status": "failed" if server.get("state") == "failed" else "ok",
            "reason": server.get("error"),
            "by": "service",
        }

    # -- async -----------------------------------------------------------------------------

    async def __aenter__(self) -> AgentSession:
        install_session_hook()
        if self._shared_async is None:
            self._async = httpx.AsyncClient(timeout=self._timeout, verify=self._verify)
        client = self._shared_async or self._async
        assert client is not None
        try:
            while True:
                try:
                    resp = await client.post(
                        self.service_url + "/rl/v1/sessions",
                        json=self._create_payload(),
                        headers=self._auth(),
                    )
                    data = check_response(resp)
                    break
                except Exception as e:
                    await asyncio.sleep(self._start_delay(e))
        except BaseException:
            await self._close_async()
            raise
        self.retry.got_session()
        self._activate(data["session_id"])
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._deactivate()
        try:
            if self.finalized is None:
                await self._afinish(exc_type is not None)
        finally:
            await self._close_async()

    async def _afinish(self, failed: bool) -> None:
        try:
            server = await self._aget(f"/rl/v1/sessions/{self.session_id}")
        except (httpx.HTTPError, AgentServiceError) as e:
            logger.debug("could not read session %s: %s", self.session_id, e)
            server = None
        status, send = self._exit_plan(failed, server)
        if not send:
            self.finalized = self._adopted(server or {})
            return
        try:
            await self._afinalize(None, status)
        except AgentServiceError as e:
            if e.status_code == 409:  # finalized concurrently by a raw call: adopt it
                self.finalized = {"session_id": self.session_id, "status": "ok", "by": "service"}
                return
            if not failed:
                raise
            logger.warning("could not finalize failed session %s: %s", self.session_id, e)
        except httpx.HTTPError as e:
            if not failed:
                raise
            logger.warning("could not finalize failed session %s: %s", self.session_id, e)

    async def _close_async(self) -> None:
        if self._async is not None:
            await self._async.aclose()
            self._async = None

    def _aclient(self) -> httpx.AsyncClient:
        client = self._shared_async or self._async
        if client is None:
            raise RuntimeError("the session is not open (use `async with AgentSession(...)`)")
        return client

    async def _apost(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        resp = await self._aclient().post(
            self.service_url + path, json=payload, headers=self._auth()
        )
        return check_response(resp)

    async def _aget(self, path: str) -> dict[str, Any]:
        resp = await self._aclient().get(self.service_url + path, headers=self._auth())
        return check_response(resp)

    async def _aset_reward(
        self, reward: float, completion_id: str | None, train: bool
    ) -> dict[str, Any]:
        data = await self._apost("/rl/v1/set_reward", _reward_payload(reward, completion_id, train))
        self._rewarded = True
        return data

    async def _afinalize(self, final_reward: float | None, status: str) -> dict[str, Any]:
        if self.finalized is not None:
            return self.finalized
        self.finalized = await self._apost("/rl/v1/finalize", self._payload(final_reward, status))
        return self.finalized

    # -- sync ------------------------------------------------------------------------------

    def __enter__(self) -> AgentSession:
        install_session_hook()
        self._sync = httpx.Client(timeout=self._timeout, verify=self._verify)
        try:
            while True:
                try:
                    resp = self._sync.post(
                        self.service_url + "/rl/v1/sessions",
                        json=self._create_payload(),
                        headers=self._auth(),
                    )
                    data = check_response(resp)
                    break
                except Exception as e:
                    time.sleep(self._start_delay(e))
        except BaseException:
            self._sync.close()
            self._sync = None
            raise
        self.retry.got_session()
        self._activate(data["session_id"])
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._deactivate()
        try:
            if self.finalized is None:
                self._sfinish(exc_type is not None)
        finally:
            if self._sync is not None:
                self._sync.close()
                self._sync = None

    def _sfinish(self, failed: bool) -> None:
        assert self._sync is not None
        try:
            resp = self._sync.get(
                f"{self.service_url}/rl/v1/sessions/{self.session_id}", headers=self._auth()
            )
            server: dict[str, Any] | None = check_response(resp)
        except (httpx.HTTPError, AgentServiceError):
            server = None
        status, send = self._exit_plan(failed, server)
        if not send:
            self.finalized = self._adopted(server or {})
            return
        try:
            self._sfinalize(None, status)
        except AgentServiceError as e:
            if e.status_code == 409:
                self.finalized = {"session_id": self.session_id, "status": "ok", "by": "service"}
                return
            if not failed:
                raise
            logger.warning("could not finalize failed session %s: %s", self.session_id, e)
        except httpx.HTTPError as e:
            if not failed:
                raise
            logger.warning("could not finalize failed session %s: %s", self.session_id, e)

    def _spost(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        if self._sync is None:
            raise RuntimeError("the session is not open (use `with AgentSession(...)`)")
        return check_response(
            self._sync.post(self.service_url + path, json=payload, headers=self._auth())
        )

    def _sfinalize(self, final_reward: float | None, status: str) -> dict[str, Any]:
        if self.finalized is None:
            self.finalized = self._spost("/rl/v1/finalize", self._payload(final_reward, status))
        return self.finalized

    # -- public, both modes ----------------------------------------------------------------

    def set_reward(
        self, reward: float, completion_id: str | None = None, *, train: bool = True
    ) -> Any:
        """Reward one completion (``completion_id``: the ``id`` of a chat completion or
        message; ``None`` = the latest), in the proxy client's order. ``train=False`` leaves
        that completion out of the loss (neither rewarded nor blamed; ``reward`` still counts
        in the returns of the turns before it). Awaitable inside ``async with``."""
        if self._sync is not None:
            data = self._spost("/rl/v1/set_reward", _reward_payload(reward, completion_id, train))
            self._rewarded = True
            return data
        return self._aset_reward(reward, completion_id, train)

    def finalize(self, final_reward: float | None = None, *, status: str = "ok") -> Any:
        """End the trajectory: ``final_reward`` goes to the last completion; ``status="failed"``
        excludes it from training. Idempotent. Awaitable inside ``async with``."""
        if status not in ("ok", "failed"):
            raise ValueError("status must be 'ok' or 'failed'")
        if self._sync is not None:
            return self._sfinalize(final_reward, status)
        return self._afinalize(final_reward, status)
