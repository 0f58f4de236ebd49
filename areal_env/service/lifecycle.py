"""The start/stop lifecycle shared by the inference and the training service.

Both put a gateway in front of one or more proxies on one engine; a failure half-way through
``start()`` must stop what did start (servers hold ports and threads), and ``stop()`` tears the
parts down gateway first, so no new request reaches a stopped proxy.
"""

from __future__ import annotations

from typing import Any, Self


class ServiceStack:
    """Engine + proxies + gateway, started and stopped together (``with`` works too).

    Subclasses set ``engine``, ``_own_engine`` (destroy the engine on stop) and ``gateway`` and
    implement ``_start_parts`` and ``_stop_backends`` (what stands between gateway and engine).
    """

    engine: Any
    gateway: Any
    _own_engine: bool

    def _start_parts(self) -> None:
        raise NotImplementedError

    def _stop_backends(self) -> None:
        raise NotImplementedError

    def start(self) -> Self:
        try:
            self._start_parts()
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def base_url(self) -> str:
        return self.gateway.base_url

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        self._stop_backends()
        if self._own_engine and self.engine is not None:
            self.engine.destroy()
            self.engine = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
