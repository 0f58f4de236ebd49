"""Client side of the RL session lifecycle (light imports only: httpx, no torch).

``OpenAIProxyClient`` starts a session with the admin key and hands the agent a ``base_url`` and
a session ``api_key`` for any OpenAI/Anthropic SDK; afterwards it sets rewards, ends the session
and exports the captured trajectories::

    await grant_capacity(base_url, admin_key, 1)
    async with OpenAIProxyClient(base_url, admin_key, task_id="q1") as sess:
        client = AsyncOpenAI(base_url=sess.openai_base_url, api_key=sess.api_key)
        reply = await client.chat.completions.create(model="m", messages=[...])
        await sess.set_reward(1.0, reply.id)
        await sess.end()
        data = await sess.export(discount=0.9)

Transport failures and 502/503/504 answers are retried a bounded number of times with
exponential backoff; any other error status raises :class:`ProxyClientError` with the server's
message.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

import httpx

from areal_env.http import routes
from areal_env.http.client import default_ssl_context, response_error_message

logger = logging.getLogger(__name__)

_RETRY_STATUS = {502, 503, 504}


class ProxyClientError(RuntimeError):
    """The proxy refused a call; ``status`` is the HTTP status (0 for transport failures)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"proxy error {status}: {message}")
        self.status = status
        self.message = message


async def _post(
    http: httpx.AsyncClient,
    url: str,
    key: str,
    body: dict[str, Any],
    max_retries: int,
    timeout: float = 60.0,
) -> dict[str, Any]:
    delay = 0.2
    for attempt in range(max_retries + 1):
        try:
            r = await http.post(
                url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=timeout
            )
        except httpx.TransportError as e:
            if attempt >= max_retries:
                raise ProxyClientError(0, f"{type(e).__name__} calling {url}: {e}") from e
        else:
            if r.status_code < 400:
                return r.json()
            if r.status_code not in _RETRY_STATUS or attempt >= max_retries:
                raise ProxyClientError(r.status_code, response_error_message(r))
        await asyncio.sleep(delay * (1 + random.random()))
        delay *= 2
    raise AssertionError("unreachable")


async def grant_capacity(
    base_url: str, admin_key: str, n: int, http_client: httpx.AsyncClient | None = None
) -> None:
    """Allow ``n`` more sessions to start (admin)."""
    own = http_client is None
    http = http_client or httpx.AsyncClient(verify=default_ssl_context())
    try:
        await _post(
            http, base_url.rstrip("/") + routes.GRANT_CAPACITY, admin_key, {"capacity": n}, 3
        )
    finally:
        if own:
            await http.aclose()


class OpenAIProxyClient:
    """One RL session as an async context manager (start on enter, end on exit)."""

    def __init__(
        self,
        base_url: str,
        admin_key: str,
        *,
        http_client: httpx.AsyncClient | None = None,
        task_id: str | None = None,
        group_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        max_retries: int = 3,
        sampling: dict[str, Any] | None = None,
        guide: list[dict[str, Any]] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith(routes.OPENAI_PREFIX):
            self.base_url = self.base_url[:-3]
        self._admin_key = admin_key
        self._http = http_client
        self._own_http = http_client is None
        self.task_id = task_id
        self.group_id = group_id
        self.metadata = metadata
        self.sampling = sampling
        """The session's own sampling parameters (e.g. ``{"greedy": True}`` for evaluation)."""
        self.guide = guide
        """A reference solution the session's sampled replies follow: its calls
        ``{"name", "arguments"}``, optionally then the answer ``{"content"}``
        (``areal_env.proxy.guide``)."""
        self.max_retries = max_retries
        self.session_id: str | None = None
        self.api_key: str | None = None
        self.ended = False

    def __repr__(self) -> str:  # never show the keys
        return f"OpenAIProxyClient(base_url={self.base_url!r}, session_id={self.session_id!r})"

    @property
    def openai_base_url(self) -> str:
        """What to pass as ``base_url`` to ``openai.AsyncOpenAI`` (Anthropic: ``base_url``)."""
        return self.base_url + routes.OPENAI_PREFIX

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(verify=default_ssl_context())
        return self._http

    async def __aenter__(self) -> OpenAIProxyClient:
        await self.start()
        return self

    async def start(self) -> None:
        body: dict[str, Any] = {}
        if self.task_id is not None:
            body["task_id"] = self.task_id
        if self.group_id is not None:
            body["group_id"] = self.group_id
        if self.metadata:
            body["metadata"] = self.metadata
        if self.sampling:
            body["sampling"] = self.sampling
        if self.guide:
            body["guide"] = self.guide
        data = await _post(
            self.http, self.base_url + routes.START_SESSION, self._admin_key, body, self.max_retries
        )
        self.session_id, self.api_key = data["session_id"], data["api_key"]
        self.ended = False

    def _require(self) -> str:
        if self.api_key is None:
            raise RuntimeError("the session is not started (use `async with` or start())")
        return self.api_key

    async def set_reward(
        self, reward: float, completion_id: str | None = None, *, train: bool = True
    ) -> None:
        """Reward a completion (by its response id), or the last one when ``None``.

        ``train=False`` leaves that completion out of the loss (neither rewarded nor blamed);
        ``reward`` still counts in the returns of the turns before it."""
        body: dict[str, Any] = {"reward": reward}
        if completion_id is not None:
            body["completion_id"] = completion_id
        if not train:
            body["train"] = False
        await _post(
            self.http, self.base_url + routes.SET_REWARD, self._require(), body, self.max_retries
        )

    async def end(self) -> None:
        """End the session (idempotent on this client)."""
        if self.ended:
            return
        try:
            await _post(
                self.http, self.base_url + routes.END_SESSION, self._require(), {}, self.max_retries
            )
        except ProxyClientError as e:
            if e.status != 409:  # a retried end that had already succeeded
                raise
        self.ended = True

    async def export(
        self, discount: float = 1.0, style: str = "individual", include_text: bool = True
    ) -> dict:
        """The session's trajectories and interaction summaries (admin)."""
        if self.session_id is None:
            raise RuntimeError("the session is not started")
        body = {
            "session_id": self.session_id,
            "discount": discount,
            "style": style,
            "include_text": include_text,
        }
        return await _post(
            self.http,
            self.base_url + routes.EXPORT_TRAJECTORIES,
            self._admin_key,
            body,
            self.max_retries,
        )

    async def __aexit__(self, *exc: Any) -> None:
        try:
            if self.api_key is not None and not self.ended:
                try:
                    await self.end()
                except (ProxyClientError, RuntimeError) as e:
                    logger.warning("could not end proxy session %s: %s", self.session_id, e)
        finally:
            if self._own_http and self._http is not None:
                await self._http.aclose()
                self._http = None
