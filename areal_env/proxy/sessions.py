"""Session registry: who may call the proxy, and which conversation tree a call lands in.

Every RL session gets its own random API key (``secrets``), so an agent can only read or reward
its own completions: the key *is* the session. Keys are stored only as SHA-256 digests, so a
memory dump or a debug print of the registry never shows one. The admin key (start sessions,
grant capacity, export) is compared in constant time.

Capacity is a counter the trainer raises with ``/grant_capacity`` and each session start
consumes; ``None`` means "no capacity control". Idle sessions expire after ``ttl`` seconds
(ended ones sooner) so an agent that crashed without ending its session cannot leak memory.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from areal_env.http.errors import HTTPError
from areal_env.http.ratelimit import TokenBucket

logger = logging.getLogger(__name__)

SESSION_KEY_PREFIX = "sk-areal-"
_TOMBSTONES = 4096


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def generate_key(prefix: str = SESSION_KEY_PREFIX) -> str:
    """A fresh random key (192 bits)."""
    return prefix + secrets.token_urlsafe(24)


@dataclass
class SessionStats:
    """Counters per session, reported by export and aggregated by ``/health``."""

    completions: int = 0
    spliced: int = 0
    re_renders: int = 0
    tool_parse_failures: int = 0
    """Replies whose tool-call markup did not parse (each is one of the two below)."""
    tool_calls_raw_arguments: int = 0
    """... returned as tool calls carrying the model's raw (invalid) arguments text."""
    tool_markup_removed: int = 0
    """... returned as plain text with the call markup removed (no readable call name)."""
    parallel_calls_dropped: int = 0
    """Calls after the first in replies to ``parallel_tool_calls: false`` requests (a free reply
    the engine could not stop at its first call): left out of the message."""
    prompt_tokens: int = 0
    output_tokens: int = 0
    errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class Session:
    """One agent episode: a conversation tree (``cache``) reachable with one key."""

    id: str
    key_digest: bytes
    cache: Any
    task_id: str | None = None
    group_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] | None = None
    """This session's own sampling parameters (e.g. greedy for evaluation); see proxy.sampling."""
    guide: list[dict[str, Any]] | None = None
    """A reference solution's steps (calls ``{"name", "arguments"}`` in order, optionally then
    the answer ``{"content"}``) that the sampled replies of this session are made to start with
    while its calls follow them (``/rl/start_session`` ``guide``; docs/training.md, "Guided
    episodes")."""
    created_at: float = field(default_factory=time.time)
    last_active: float = field(default_factory=time.monotonic)
    ended: bool = False
    in_flight: int = 0
    stats: SessionStats = field(default_factory=SessionStats)
    bucket: TokenBucket | None = None
    """This key's request rate (``proxy.rate_limit_rps``); None = unlimited."""

    def touch(self) -> None:
        self.last_active = time.monotonic()


class SessionRegistry:
    """Thread-safe map of sessions by id and by key digest."""

    def __init__(
        self,
        *,
        cache_factory: Callable[[str], Any],
        admin_key: str,
        ttl: float = 3600.0,
        ended_ttl: float = 600.0,
        max_sessions: int = 1024,
        initial_capacity: int | None = None,
        rate_limit: tuple[float, int] | None = None,
    ) -> None:
        if not admin_key:
            raise ValueError("admin_key must be a non-empty string")
        self._cache_factory = cache_factory
        self._admin_digest = _digest(admin_key)
        self.ttl = float(ttl)
        self.ended_ttl = min(float(ended_ttl), self.ttl)
        self.max_sessions = int(max_sessions)
        self.capacity: int | None = initial_capacity
        self.rate_limit = rate_limit
        self.total_rate_limited = 0
        self._by_id: dict[str, Session] = {}
        self._by_key: dict[bytes, Session] = {}
        self._expired: OrderedDict[bytes, str] = OrderedDict()
        self._lock = threading.Lock()
        self.total_started = 0
        self.total_expired = 0
        # Stats of sessions already dropped, so /health totals stay monotonic.
        self._retired = SessionStats()

    # ---- admin -------------------------------------------------------------------------------
    def check_admin(self, key: str | None) -> None:
        if not key:
            raise HTTPError(401, "missing admin key (Authorization: Bearer <admin key>)")
        if not secrets.compare_digest(_digest(key), self._admin_digest):
            raise HTTPError(401, "invalid admin key")

    def grant_capacity(self, n: int) -> int | None:
        """Allow ``n`` more session starts. Returns the new capacity (None = unlimited)."""
        with self._lock:
            if self.capacity is not None:
                self.capacity += n
            return self.capacity

    def start(
        self,
        task_id: str | None = None,
        group_id: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> tuple[Session, str]:
        """Create a session; returns it and its key (the only time the key is visible)."""
        self.expire()
        with self._lock:
            if self.capacity is not None and self.capacity <= 0:
                raise HTTPError(
                    429, "no capacity: the trainer has not granted a new session (grant_capacity)"
                )
            live = sum(1 for s in self._by_id.values() if not s.ended)
            if live >= self.max_sessions:
                raise HTTPError(429, f"too many open sessions (max_sessions={self.max_sessions})")
            if self.capacity is not None:
                self.capacity -= 1
            sid = "sess-" + secrets.token_hex(12)
            key = generate_key()
            session = Session(
                id=sid,
                key_digest=_digest(key),
                cache=self._cache_factory(sid),
                task_id=task_id,
                group_id=group_id,
                metadata=dict(metadata or {}),
                bucket=TokenBucket(*self.rate_limit) if self.rate_limit else None,
            )
            self._by_id[sid] = session
            self._by_key[session.key_digest] = session
            self.total_started += 1
        logger.debug("session %s started (task=%s group=%s)", sid, task_id, group_id)
        return session, key

    # ---- lookup ------------------------------------------------------------------------------
    def by_key(self, key: str | None, *, allow_ended: bool = False) -> Session:
        """The session a key belongs to; 401 unknown, 410 expired, 409 ended."""
        if not key:
            raise HTTPError(401, "missing API key (Authorization: Bearer <session key>)")
        digest = _digest(key)
        session = self._by_key.get(digest)
        if session is None:
            if digest in self._expired:
                raise HTTPError(410, "session expired (idle longer than the TTL)", code="expired")
            raise HTTPError(401, "invalid API key", code="invalid_api_key")
        if session.ended and not allow_ended:
            raise HTTPError(409, f"session {session.id} has ended", code="session_ended")
        session.touch()
        return session

    def admit(self, key: str | None) -> Session:
        """``by_key`` for a model call: also takes one request from the key's rate bucket, or
        refuses with 429 and the seconds to wait (``proxy.rate_limit_rps``). Only model calls
        are limited: an agent past its rate can still set its reward and end its session."""
        session = self.by_key(key)
        if session.bucket is not None:
            wait = session.bucket.take()
            if wait > 0:
                self.total_rate_limited += 1
                rps, burst = self.rate_limit or (0.0, 0)
                raise HTTPError(
                    429,
                    f"rate limit: a session key may make {rps:g} model requests per second "
                    f"(burst {burst}); retry after {wait:.2f}s",
                    code="rate_limit_exceeded",
                    retry_after=wait,
                )
        return session

    def get(self, session_id: str) -> Session:
        session = self._by_id.get(session_id)
        if session is None:
            raise HTTPError(404, f"unknown session {session_id!r}", param="session_id")
        return session

    def end(self, session: Session) -> None:
        with self._lock:
            if session.ended:
                raise HTTPError(409, f"session {session.id} has already ended")
            session.ended = True
            session.touch()

    def __len__(self) -> int:
        return len(self._by_id)

    @property
    def live_sessions(self) -> int:
        return sum(1 for s in list(self._by_id.values()) if not s.ended)

    # ---- expiry ------------------------------------------------------------------------------
    def expire(self, now: float | None = None) -> int:
        """Drop idle sessions (none with a request in flight). Returns how many were dropped."""
        now = time.monotonic() if now is None else now
        dropped = 0
        with self._lock:
            for sid, s in list(self._by_id.items()):
                limit = self.ended_ttl if s.ended else self.ttl
                idle = now - s.last_active
                # A request in flight keeps a session alive, but not forever: a stream whose
                # client vanished before it started may never decrement the counter.
                if idle > limit and (s.in_flight == 0 or idle > 4 * self.ttl):
                    del self._by_id[sid]
                    self._by_key.pop(s.key_digest, None)
                    self._expired[s.key_digest] = sid
                    while len(self._expired) > _TOMBSTONES:
                        self._expired.popitem(last=False)
                    for k, v in s.stats.as_dict().items():
                        setattr(self._retired, k, getattr(self._retired, k) + v)
                    dropped += 1
            self.total_expired += dropped
        if dropped:
            logger.info("expired %d idle session(s)", dropped)
        return dropped

    def aggregate_stats(self) -> dict[str, int]:
        total = self._retired.as_dict()
        for s in list(self._by_id.values()):
            for k, v in s.stats.as_dict().items():
                total[k] += v
        return total
