"""``SGLangEngine``'s server set: the addresses, their router and the HTTP to them (per-loop
clients, retried POSTs, broadcasts).

A broadcast reaches every server in parallel; one that stays unreachable through the retries of
a weight update is dropped from the rotation for good (it would serve stale weights).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import httpx
from tenacity import (
    AsyncRetrying,
    RetryError,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from areal_env.api.engine import EngineUnavailableError, PromptTooLongError
from areal_env.engine.routing import ServerRouter
from areal_env.http.client import response_error_message

logger = logging.getLogger(__name__)


class RetryableHTTPError(Exception):
    """A 5xx answer: worth retrying (the server may be restarting or overloaded)."""

    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, (httpx.TransportError, RetryableHTTPError))


class ServerSet:
    """The inference servers one ``SGLangEngine`` talks to, and how it talks to them (no
    generation logic here). ``addresses`` is the router's list: dropping a server removes it
    from both."""

    def __init__(
        self,
        addresses: list[str],
        *,
        request_timeout: float,
        connect_timeout: float,
        control_timeout: float,
        max_retries: int,
        retry_backoff: float,
        retry_max_wait: float,
        down_cooldown: float,
    ) -> None:
        self.router = ServerRouter(addresses, down_cooldown)
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self.control_timeout = control_timeout
        # ``max_retries`` counts retries after the first try, as everywhere in the package.
        self.attempts = max_retries + 1
        self.retry_backoff = retry_backoff
        self.retry_max_wait = retry_max_wait
        self.dropped: list[str] = []
        """Servers taken out for good: they missed a weight update (see ``broadcast``)."""
        self._lock = threading.Lock()
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        self._sync_client: httpx.Client | None = None

    @property
    def addresses(self) -> list[str]:
        return self.router.addresses

    @addresses.setter
    def addresses(self, addresses: list[str]) -> None:
        self.router.addresses = addresses

    # ------------------------------------------------------------------ clients

    def _timeout(self, total: float) -> httpx.Timeout:
        return httpx.Timeout(total, connect=min(self.connect_timeout, total))

    def client(self) -> httpx.AsyncClient:
        """One AsyncClient per event loop: the proxy's loop and the trainer's differ."""
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            with self._lock:
                for old in [lp for lp in self._clients if lp.is_closed()]:
                    self._clients.pop(old, None)  # its sockets died with the loop
                client = self._clients.get(loop)
                if client is None:
                    client = httpx.AsyncClient(
                        timeout=self._timeout(self.request_timeout),
                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
                        trust_env=False,
                    )
                    self._clients[loop] = client
        return client

    def client_sync(self) -> httpx.Client:
        with self._lock:
            if self._sync_client is None:
                self._sync_client = httpx.Client(
                    timeout=self._timeout(self.control_timeout), trust_env=False
                )
            return self._sync_client

    # ------------------------------------------------------------------ HTTP with retries

    def _retry_kwargs(self) -> dict[str, Any]:
        return dict(
            stop=stop_after_attempt(self.attempts),
            wait=wait_exponential(multiplier=self.retry_backoff, max=self.retry_max_wait),
            retry=retry_if_exception(_retryable),
            reraise=False,
        )

    @staticmethod
    def check(resp: httpx.Response, addr: str, path: str) -> Any:
        if resp.status_code >= 500:
            raise RetryableHTTPError(resp.status_code, resp.text)
        if resp.status_code == 413:
            raise PromptTooLongError(response_error_message(resp))
        if resp.status_code >= 400:
            message = response_error_message(resp)
            if "context length" in message or "too long" in message:
                raise PromptTooLongError(message)
            raise ValueError(f"server {addr} rejected {path} (HTTP {resp.status_code}): {message}")
        try:
            return resp.json()
        except ValueError:
            return resp.text

    def unavailable(self, addr: str, exc: BaseException) -> EngineUnavailableError:
        detail = exc
        if isinstance(exc, RetryError):
            detail = exc.last_attempt.exception() or exc
        return EngineUnavailableError(
            f"server {addr} unreachable after {self.attempts} attempts: "
            f"{type(detail).__name__}: {detail}"
        )

    async def apost(self, addr: str, path: str, body: dict, timeout: float | None = None) -> Any:
        client = self.client()
        kwargs: dict[str, Any] = {"json": body}
        if timeout is not None:
            kwargs["timeout"] = self._timeout(timeout)
        try:
            async for attempt in AsyncRetrying(**self._retry_kwargs()):
                with attempt:
                    resp = await client.post(f"http://{addr}{path}", **kwargs)
                    return self.check(resp, addr, path)
        except RetryError as e:
            raise self.unavailable(addr, e) from None
        raise AssertionError("unreachable")  # pragma: no cover

    def post(self, addr: str, path: str, body: dict | None = None) -> Any:
        client = self.client_sync()
        try:
            for attempt in Retrying(**self._retry_kwargs()):
                with attempt:
                    resp = client.post(f"http://{addr}{path}", json=body or {})
                    return self.check(resp, addr, path)
        except RetryError as e:
            raise self.unavailable(addr, e) from None
        raise AssertionError("unreachable")  # pragma: no cover

    def broadcast(
        self, path: str, body: dict | None = None, *, drop_unreachable: bool = False
    ) -> list[Any]:
        """POST to every server (in parallel threads: a slow weight load must not serialise).

        ``drop_unreachable`` (weight updates and the pause/continue around them): servers that stay unreachable through the retries
        (killed, crashed) while at least one other server succeeded are dropped from the
        rotation for good, by address, and the call succeeds with the rest: a dead server
        serves nothing, and one that comes back would serve stale weights, so it never gets
        traffic again. A server that answers but fails to load, or all servers failing, raise.
        """
        addresses = list(self.addresses)
        results: list[Any] = [None] * len(addresses)
        errors: list[BaseException | None] = [None] * len(addresses)

        def one(i: int, addr: str) -> None:
            try:
                results[i] = self.post(addr, path, body)
            except BaseException as e:  # noqa: BLE001 - collected and re-raised below
                errors[i] = e

        threads = [
            threading.Thread(target=one, args=(i, a), daemon=True) for i, a in enumerate(addresses)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failed = [(a, e) for a, e in zip(addresses, errors, strict=True) if e is not None]
        if (
            drop_unreachable
            and failed
            and len(failed) < len(addresses)
            and all(type(e) is EngineUnavailableError for _, e in failed)
        ):
            for addr, e in failed:
                self.drop(addr, f"{path} failed: {e}")
            return [r for r, e in zip(results, errors, strict=True) if e is None]
        if len(failed) == 1:
            raise failed[0][1]  # type: ignore[misc]
        if failed:
            # Every failing server by address, as the first failure's type when all agree.
            detail = "; ".join(f"{a}: {type(e).__name__}: {e}" for a, e in failed)
            message = f"{path} failed on {len(failed)} of {len(addresses)} servers: {detail}"
            kinds = {type(e) for _, e in failed}
            kind = kinds.pop() if len(kinds) == 1 else EngineUnavailableError
            if kind not in (ValueError, RuntimeError, EngineUnavailableError):
                kind = EngineUnavailableError
            raise kind(message)
        return results

    def drop(self, addr: str, why: str) -> None:
        """Out of the rotation for good (see ``_broadcast``); loud, by address."""
        self.router.drop(addr)  # also removes it from self.addresses (the router's list)
        self.dropped.append(addr)
        logger.error(
            "inference server %s dropped: it missed a weight update (%s); %d server(s) left: %s",
            addr,
            why,
            len(self.addresses),
            self.addresses,
        )

    def close(self) -> None:
        """Close the HTTP clients, each on its own event loop."""
        with self._lock:
            clients, self._clients = dict(self._clients), {}
            sync_client, self._sync_client = self._sync_client, None
        for loop, client in clients.items():
            if loop.is_closed():
                continue
            try:
                if loop.is_running():
                    asyncio.run_coroutine_threadsafe(client.aclose(), loop)
                else:
                    loop.run_until_complete(client.aclose())
            except RuntimeError:
                pass
        if sync_client is not None:
            sync_client.close()
