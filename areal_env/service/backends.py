"""The proxy backends behind the gateway: selection (least sessions, round robin) and health."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class Backend:
    """One proxy instance (usually one per inference group)."""

    name: str
    base_url: str
    """e.g. ``http://127.0.0.1:PORT`` (no ``/v1``)."""
    admin_key: str = field(repr=False)
    healthy: bool = True
    consecutive_failures: int = 0
    open_sessions: int = 0
    last_error: str | None = None
    down_since: float | None = None

    def describe(self) -> dict:
        """Public status (no keys)."""
        return {
            "name": self.name,
            "base_url": self.base_url,
            "healthy": self.healthy,
            "open_sessions": self.open_sessions,
            "consecutive_failures": self.consecutive_failures,
            "last_error": self.last_error,
        }


class NoBackendError(RuntimeError):
    """No healthy backend is left (HTTP 503)."""


class BackendPool:
    """Thread-safe set of backends. ``pick`` prefers the least loaded healthy one."""

    def __init__(self, failures_to_down: int = 2) -> None:
        self._lock = threading.Lock()
        self._backends: list[Backend] = []
        self._rr = itertools.count()
        self.failures_to_down = failures_to_down

    def add(self, base_url: str, admin_key: str, name: str | None = None) -> Backend:
        with self._lock:
            backend = Backend(
                name=name or f"proxy{len(self._backends)}",
                base_url=base_url.rstrip("/"),
                admin_key=admin_key,
            )
            self._backends.append(backend)
        logger.info("backend %s at %s added", backend.name, backend.base_url)
        return backend

    def all(self) -> list[Backend]:
        with self._lock:
            return list(self._backends)

    def healthy(self) -> list[Backend]:
        with self._lock:
            return [b for b in self._backends if b.healthy]

    def candidates(self) -> list[Backend]:
        """Healthy backends, least open sessions first; ties rotate round robin."""
        with self._lock:
            healthy = [b for b in self._backends if b.healthy]
            if not healthy:
                raise NoBackendError("no healthy proxy backend is available")
            shift = next(self._rr) % len(healthy)
            rotated = healthy[shift:] + healthy[:shift]
            return sorted(rotated, key=lambda b: b.open_sessions)

    def mark_ok(self, backend: Backend) -> bool:
        """Record a good probe; True when the backend came back into rotation."""
        with self._lock:
            backend.consecutive_failures = 0
            revived = not backend.healthy
            backend.healthy = True
            backend.down_since = None
            backend.last_error = None if revived else backend.last_error
        if revived:
            logger.warning("backend %s is healthy again and back in rotation", backend.name)
        return revived

    def mark_failure(self, backend: Backend, error: str, *, conclusive: bool = False) -> bool:
        """Record a failed probe or call; True when this takes the backend out of rotation."""
        with self._lock:
            backend.consecutive_failures += 1
            backend.last_error = error
            if not backend.healthy:
                return False
            if conclusive or backend.consecutive_failures >= self.failures_to_down:
                backend.healthy = False
                backend.down_since = time.time()
                down = True
            else:
                down = False
        if down:
            logger.warning("backend %s removed from rotation: %s", backend.name, error)
        return down
