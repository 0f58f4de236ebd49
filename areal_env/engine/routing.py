"""``ServerRouter``: which inference server a request goes to (SGLangEngine's routing).

New requests go to the least-loaded server that is not marked down (fewest generations in
flight; ties round-robin); a request whose
``metadata["session_id"]`` (or ``conversation_id``/``sticky_key``) or ``rid`` was seen before
goes to the same server, so multi-turn agents reuse that server's prefix cache. A server marked
down is skipped for new requests for ``down_cooldown`` seconds; a dropped one (it missed a weight
update) for good.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator

from areal_env.api.io import ModelRequest

STICKY_METADATA_KEYS = ("session_id", "conversation_id", "sticky_key")
"""``req.metadata`` keys that pin a request to one server (first present wins), before ``rid``."""


def normalize_address(address: str) -> str:
    """``"host:port"`` or ``"http://host:port/"`` → ``"host:port"`` (what we name in errors)."""
    addr = address.strip()
    for prefix in ("http://", "https://"):
        if addr.startswith(prefix):
            addr = addr[len(prefix) :]
    addr = addr.rstrip("/")
    if not addr or ":" not in addr:
        raise ValueError(f"server address {address!r} must look like host:port")
    return addr


class ServerRouter:
    """Session-affine round-robin over ``addresses`` (thread-safe)."""

    def __init__(self, addresses: list[str], down_cooldown: float, sticky_max: int = 100_000):
        self.addresses = addresses
        self.down_cooldown = down_cooldown
        self._lock = threading.Lock()
        self._rr = 0
        self._sticky: OrderedDict[str, str] = OrderedDict()
        self._sticky_max = sticky_max
        self._down_until: dict[str, float] = {}
        self.inflight: dict[str, int] = {}  # generations in flight per server

    @staticmethod
    def _keys(req: ModelRequest) -> list[str]:
        keys = []
        for key in STICKY_METADATA_KEYS:
            value = req.metadata.get(key) if req.metadata else None
            if value:
                keys.append(f"{key}:{value}")
                break
        return [*keys, f"rid:{req.rid}"]

    def route(self, req: ModelRequest) -> tuple[str, bool]:
        """(address, sticky): sticky = this session or rid was routed before."""
        keys = self._keys(req)
        with self._lock:
            for key in keys:
                addr = self._sticky.get(key)
                if addr is not None and addr in self.addresses:
                    self._sticky.move_to_end(key)
                    self._remember(keys, addr)
                    return addr, True
            addr = self._next_healthy()
            self._remember(keys, addr)
            return addr, False

    def next_healthy(self, exclude: set[str] | None = None) -> str:
        with self._lock:
            return self._next_healthy(exclude)

    def _next_healthy(self, exclude: set[str] | None = None) -> str:
        """The least-loaded server (fewest generations in flight) that is not marked down;
        ties go round-robin."""
        now = time.monotonic()
        n = len(self.addresses)
        order = [self.addresses[(self._rr + i) % n] for i in range(n)]
        healthy = [
            a for a in order if self._down_until.get(a, 0.0) <= now and a not in (exclude or ())
        ]
        if healthy:
            addr = min(healthy, key=lambda a: self.inflight.get(a, 0))
            self._rr = (self.addresses.index(addr) + 1) % n
            return addr
        # Everything looks down: try the next one anyway (it may be back).
        addr = self.addresses[self._rr % n]
        self._rr += 1
        return addr

    def _remember(self, keys: list[str], addr: str) -> None:
        for key in keys:
            self._sticky[key] = addr
            self._sticky.move_to_end(key)
        while len(self._sticky) > self._sticky_max:
            self._sticky.popitem(last=False)

    @contextlib.contextmanager
    def in_flight(self, addr: str) -> Iterator[None]:
        """Count a request against ``addr`` while it runs (least-loaded routing reads it)."""
        with self._lock:
            self.inflight[addr] = self.inflight.get(addr, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self.inflight[addr] -= 1

    def rebind(self, req: ModelRequest, addr: str) -> None:
        """From now on ``req``'s session and rid go to ``addr`` (after a failover)."""
        with self._lock:
            self._remember(self._keys(req), addr)

    def drop(self, addr: str) -> None:
        """Take ``addr`` out of the rotation for good (it missed a weight update: serving from it
        again would mean stale weights). Its sessions' next turns go to another server."""
        with self._lock:
            if addr in self.addresses:
                self.addresses.remove(addr)
            for key in [k for k, a in self._sticky.items() if a == addr]:
                del self._sticky[key]
            self._down_until.pop(addr, None)
            self.inflight.pop(addr, None)
            self._rr = 0

    def mark_down(self, addr: str) -> None:
        with self._lock:
            self._down_until[addr] = time.monotonic() + self.down_cooldown

    def mark_up(self, addr: str) -> None:
        if addr in self._down_until:
            with self._lock:
                self._down_until.pop(addr, None)

    def up(self) -> int:
        """Servers not marked down now."""
        now = time.monotonic()
        return sum(1 for a in self.addresses if self._down_until.get(a, 0.0) <= now)
