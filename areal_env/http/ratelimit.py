"""A token bucket: per-key request rates for the HTTP apps (issue 15).

``rate`` tokens are added per second up to ``burst``; each request takes one. A client may send
``burst`` requests at once, then ``rate`` per second on average. When the bucket is empty the
caller answers 429 with the seconds until the next token (``Retry-After``), so a well-behaved
client (the openai and anthropic SDKs retry 429s after that header) waits exactly as long as
needed instead of hammering the server.

Sliding windows (the service's tokens-per-minute quota) suit budgets of work; a bucket suits
request rates: O(1) state per key, no history, and bursts stay bounded.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field


@dataclass
class TokenBucket:
    """``take()`` -> 0.0 when a request may go, else the seconds until one may."""

    rate: float
    """Tokens added per second (> 0)."""
    burst: float
    """Capacity of the bucket, and the tokens it starts with (>= 1)."""
    tokens: float = field(init=False)
    stamp: float = field(init=False, default_factory=time.monotonic)
    _lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"rate={self.rate!r} must be a finite number > 0")
        if not self.burst >= 1:
            raise ValueError(f"burst={self.burst!r} must be >= 1")
        self.tokens = float(self.burst)

    def take(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
            if self.tokens >= 1.0:
                self.tokens -= 1.0
                return 0.0
            return (1.0 - self.tokens) / self.rate


def retry_after_headers(seconds: float) -> dict[str, str]:
    """``Retry-After`` (whole seconds, rounded up, >= 1: the HTTP standard's form) and
    ``retry-after-ms`` (exact; the openai and anthropic SDKs prefer it), for a 429 or 503."""
    return {
        "Retry-After": str(max(1, math.ceil(seconds))),
        "retry-after-ms": str(max(1, math.ceil(seconds * 1000))),
    }
