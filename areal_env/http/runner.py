"""Run an ASGI app under uvicorn: in a daemon thread (:class:`ServerThread`) or in the
foreground until killed (:func:`serve_forever`).

The thread has its own event loop (uvicorn's loop factory: uvloop when installed), so a trainer
or a test keeps its own loop free. The socket is bound before the thread starts, so ``port=0``
yields a free port without a race, and ``start()`` returns only once the server accepts
connections (and, with ``health_path``, answers it with 200).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import httpx
import uvicorn

from areal_env.http.net import bind_socket, url_host

logger = logging.getLogger(__name__)

Background = Callable[[], Coroutine[Any, Any, Any]]


def uvicorn_config(
    app: Any,
    *,
    log_level: str = "warning",
    timeout_keep_alive: int = 30,
    ssl_keyfile: str | None = None,
    ssl_certfile: str | None = None,
) -> uvicorn.Config:
    """The one uvicorn configuration of the package's servers."""
    return uvicorn.Config(
        app,
        log_config=None,  # leave the host application's logging alone
        access_log=False,
        log_level=log_level,
        lifespan="on",
        timeout_keep_alive=timeout_keep_alive,
        backlog=2048,
        ssl_keyfile=ssl_keyfile,
        ssl_certfile=ssl_certfile,
    )


async def _serve(server: uvicorn.Server, sock: socket.socket, background: Background | None):
    task = asyncio.create_task(background()) if background is not None else None
    try:
        await server.serve(sockets=[sock])
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


@dataclass
class ServerThread:
    """``app`` served on ``host:port`` from a daemon thread: ``start()``, ``stop()``, ``port``.

    ``background``: a coroutine function run on the server's loop while it serves (cancelled at
    stop), e.g. a maintenance loop. ``health_path``: ``start()`` also waits for a 200 there.
    ``before_start``: called once the socket is bound, before the thread starts.
    ``ssl_keyfile``/``ssl_certfile``: serve https. ``options``: more :func:`uvicorn_config`
    keywords (``log_level``, ``timeout_keep_alive``).
    """

    app: Any
    host: str = "127.0.0.1"
    port: int = 0
    _: KW_ONLY
    name: str = "http"
    scheme: str = "http"
    health_path: str | None = None
    background: Background | None = None
    before_start: Callable[[], None] | None = None
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    _server: uvicorn.Server | None = field(default=None, init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)
    _sock: socket.socket | None = field(default=None, init=False, repr=False)
    _error: BaseException | None = field(default=None, init=False, repr=False)

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://{url_host(self.host)}:{self.port}"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, timeout: float = 30.0) -> None:
        if self._thread is not None:
            return
        self._sock = sock = bind_socket(self.host, self.port)
        self.port = sock.getsockname()[1]
        self._server = server = uvicorn.Server(
            uvicorn_config(
                self.app,
                ssl_keyfile=self.ssl_keyfile,
                ssl_certfile=self.ssl_certfile,
                **self.options,
            )
        )
        # Signals belong to the host application, not to a server in a helper thread.
        server.install_signal_handlers = lambda: None  # type: ignore[attr-defined]
        if self.before_start is not None:
            self.before_start()
        loop_factory = server.config.get_loop_factory()

        def run() -> None:
            try:
                with asyncio.Runner(loop_factory=loop_factory) as runner:
                    runner.run(_serve(server, sock, self.background))
            except BaseException as e:  # surfaced by start()
                self._error = e
                logger.exception("%s server thread crashed", self.name)

        self._thread = threading.Thread(target=run, name=f"{self.name}-{self.port}", daemon=True)
        self._thread.start()
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        assert self._server is not None and self._thread is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._thread.is_alive():
                raise RuntimeError(f"{self.name} server failed to start: {self._error!r}")
            if self._server.started:
                if self.health_path is None:
                    return
                try:
                    verify = False if self.scheme == "https" else True
                    r = httpx.get(self.base_url + self.health_path, timeout=2.0, verify=verify)
                    if r.status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.02)
        raise TimeoutError(f"{self.name} server did not start within {timeout} s")

    def stop(self, timeout: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        if self._sock is not None:
            self._sock.close()
        self._server = self._thread = self._sock = None


def serve_forever(
    app: Any,
    sock: socket.socket,
    *,
    on_ready: Callable[[], None] | None = None,
    **config: Any,
) -> None:
    """Serve ``app`` on the bound ``sock`` in this thread until the process is told to stop
    (uvicorn's own SIGINT/SIGTERM handling). ``on_ready`` runs once the server accepts."""
    server = uvicorn.Server(uvicorn_config(app, **config))

    def announce() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.02)
        if server.started and on_ready is not None:
            on_ready()

    threading.Thread(target=announce, daemon=True).start()
    server.run(sockets=[sock])
