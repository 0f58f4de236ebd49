"""User API keys of the service: configured or issued, stored hashed, with per-key quotas.

Keys are only ever kept as SHA-256 digests (in memory and in the service store), so neither
logs, a memory dump nor the database reveal them; a short digest prefix (``key_id``) names a key
in logs, metrics and the admin API. Quotas per key: concurrent open sessions, tokens per minute
(a sliding 60 s window) and total tokens (kept in the store, so a restart does not reset it).

Mutating methods write through to the store and block: the gateway calls them through
``asyncio.to_thread``. Lookups read memory only.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from areal_env.api.records import field_dict
from areal_env.http.ratelimit import TokenBucket
from areal_env.service.store import KeyRecord, ServiceStore

KEY_PREFIX = "ak-"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    """A random user key (never contains ':' so it can be joined with a session id)."""
    return KEY_PREFIX + secrets.token_urlsafe(24).replace(":", "")


@dataclass
class UserKey:
    key_id: str
    """First 12 hex digits of the key's digest: safe to log."""
    name: str | None
    max_sessions: int
    tokens_per_minute: int | None = None
    max_tokens: int | None = None
    open_sessions: int = 0
    issued: bool = False
    revoked: bool = False
    tokens_used: int = 0
    digest: str = field(default="", repr=False)
    window: deque = field(default_factory=deque, repr=False)
    """(monotonic time, tokens) of the last 60 s."""

    def tokens_last_minute(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        while self.window and now - self.window[0][0] > 60.0:
            self.window.popleft()
        return sum(t for _, t in self.window)

    def describe(self) -> dict[str, Any]:
        """Public view for the admin API (no digest, no key)."""
        view = field_dict(self, exclude=("digest", "window"))
        view["tokens_last_minute"] = self.tokens_last_minute()
        return view

    def record(self) -> KeyRecord:
        """What the store keeps of this key (its counters and limits; no live state)."""
        return KeyRecord(**field_dict(self, exclude=("open_sessions", "window")))


class QuotaExceededError(RuntimeError):
    """A per-key limit is reached (HTTP 429); ``retry_after`` seconds, when waiting helps."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class KeyStore:
    """Thread-safe registry of user keys (digest → ``UserKey``) and the admin key."""

    def __init__(
        self,
        keys: list[str],
        *,
        admin_key: str | None = None,
        max_sessions_per_key: int = 64,
        tokens_per_minute: int | None = None,
        max_tokens: int | None = None,
        store: ServiceStore | None = None,
        request_rate: tuple[float, int] | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._keys: dict[str, UserKey] = {}
        self.request_rate = request_rate
        self._buckets: dict[str, TokenBucket] = {}  # per key digest: live state, not stored
        self.max_sessions_per_key = max_sessions_per_key
        self.tokens_per_minute = tokens_per_minute
        self.max_tokens = max_tokens
        self.store = store
        self.admin_key = admin_key or new_key()
        self._admin_digest = digest(self.admin_key)
        if store is not None:
            for rec in store.load_keys():
                self._keys[rec.digest] = self._from_record(rec)
        for k in keys:
            self.add(k)

    @staticmethod
    def _from_record(rec: KeyRecord) -> UserKey:
        return UserKey(**field_dict(rec, exclude=("created",)))

    def add(
        self,
        key: str,
        *,
        name: str | None = None,
        max_sessions: int | None = None,
        tokens_per_minute: int | None = None,
        max_tokens: int | None = None,
        issued: bool = False,
        persist: bool = True,
    ) -> UserKey:
        """Register ``key`` (a configured key keeps the limits of the ``service`` section)."""
        d = digest(key)
        with self._lock:
            existing = self._keys.get(d)
            if existing is not None:
                if not existing.issued and not issued:  # configured keys follow the config
                    existing.max_sessions = max_sessions or self.max_sessions_per_key
                    existing.tokens_per_minute = tokens_per_minute or self.tokens_per_minute
                    existing.max_tokens = max_tokens or self.max_tokens
                    existing.revoked = False
                user = existing
            else:
                user = UserKey(
                    key_id=d[:12],
                    name=name,
                    max_sessions=max_sessions or self.max_sessions_per_key,
                    tokens_per_minute=tokens_per_minute or self.tokens_per_minute,
                    max_tokens=max_tokens or self.max_tokens,
                    issued=issued,
                    digest=d,
                )
                self._keys[d] = user
        if persist and self.store is not None:
            self.store.upsert_key(user.record())
        return user

    def issue(
        self,
        *,
        name: str | None = None,
        max_sessions: int | None = None,
        tokens_per_minute: int | None = None,
        max_tokens: int | None = None,
    ) -> tuple[str, UserKey]:
        key = new_key()
        user = self.add(
            key,
            name=name,
            max_sessions=max_sessions,
            tokens_per_minute=tokens_per_minute,
            max_tokens=max_tokens,
            issued=True,
        )
        return key, user

    def revoke(self, key_id: str) -> UserKey | None:
        with self._lock:
            user = next((u for u in self._keys.values() if u.key_id == key_id), None)
            if user is not None:
                user.revoked = True
        if user is not None and self.store is not None:
            self.store.revoke_key(key_id)
        return user

    def list(self) -> list[UserKey]:
        with self._lock:
            return list(self._keys.values())

    def lookup(self, key: str | None) -> UserKey | None:
        """The live key for ``key`` (None for unknown or revoked keys). Memory only."""
        if not key:
            return None
        with self._lock:
            user = self._keys.get(digest(key))
        return None if user is None or user.revoked else user

    def reload(self, key: str) -> UserKey | None:
        """Look ``key`` up in the store (issued by another gateway host sharing it). Blocks."""
        if self.store is None or not key:
            return None
        rec = self.store.get_key(digest(key))
        if rec is None or rec.revoked:
            return None
        with self._lock:
            user = self._keys.setdefault(rec.digest, self._from_record(rec))
        return user

    def is_admin(self, key: str | None) -> bool:
        return (
            key is not None and bool(key) and hmac.compare_digest(digest(key), self._admin_digest)
        )

    def acquire(self, user: UserKey) -> None:
        """Count one more open session for ``user`` or raise ``QuotaExceededError``."""
        with self._lock:
            if user.open_sessions >= user.max_sessions:
                raise QuotaExceededError(
                    f"key {user.key_id} already has {user.open_sessions} open sessions "
                    f"(quota {user.max_sessions}); finalize some first",
                    retry_after=5.0,
                )
            user.open_sessions += 1

    def release(self, user: UserKey) -> None:
        with self._lock:
            user.open_sessions = max(0, user.open_sessions - 1)

    def check_rate(self, user: UserKey) -> None:
        """Take one model call from ``user``'s request bucket (``service.requests_per_second``)
        or raise ``QuotaExceededError`` with the seconds until the next one is allowed."""
        if self.request_rate is None:
            return
        with self._lock:
            bucket = self._buckets.get(user.digest)
            if bucket is None:
                bucket = self._buckets[user.digest] = TokenBucket(*self.request_rate)
        wait = bucket.take()
        if wait > 0:
            rps, burst = self.request_rate
            raise QuotaExceededError(
                f"key {user.key_id} may make {rps:g} model requests per second (burst {burst}); "
                f"retry after {wait:.2f}s",
                retry_after=wait,
            )

    def check_tokens(self, user: UserKey) -> None:
        """Raise ``QuotaExceededError`` when ``user`` is past a token quota."""
        with self._lock:
            if user.max_tokens is not None and user.tokens_used >= user.max_tokens:
                raise QuotaExceededError(
                    f"key {user.key_id} used its {user.max_tokens} tokens "
                    f"({user.tokens_used} used); ask the service admin for more"
                )
            if user.tokens_per_minute is not None:
                now = time.monotonic()
                used = user.tokens_last_minute(now)
                if used >= user.tokens_per_minute:
                    wait = 60.0 - (now - user.window[0][0]) if user.window else 1.0
                    raise QuotaExceededError(
                        f"key {user.key_id} used {used} tokens in the last minute "
                        f"(quota {user.tokens_per_minute}/min)",
                        retry_after=max(1.0, wait),
                    )

    def count_tokens(self, user: UserKey, tokens: int, *, persist: bool = True) -> None:
        """Record ``tokens`` used by ``user`` in memory (at once, so the next call sees them)
        and, with ``persist``, in the store (blocks: see ``persist_tokens``)."""
        if tokens <= 0:
            return
        with self._lock:
            user.tokens_used += tokens
            user.window.append((time.monotonic(), tokens))
        if persist:
            self.persist_tokens(user, tokens)

    def persist_tokens(self, user: UserKey, tokens: int) -> None:
        """Add ``tokens`` to ``user``'s usage in the store. Blocks."""
        if self.store is not None and tokens > 0:
            self.store.add_key_usage(user.digest, tokens)

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)
