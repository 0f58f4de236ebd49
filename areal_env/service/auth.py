"""User API keys of the service: configured or issued, stored hashed, with per-key quotas.

Keys are only ever kept as SHA-256 digests, so neither logs nor a memory dump of the registry
reveal them; a short digest prefix (``key_id``) names a key in logs and metrics.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from dataclasses import dataclass

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
    open_sessions: int = 0
    issued: bool = False


class QuotaExceededError(RuntimeError):
    """The key already holds its maximum number of open sessions (HTTP 429)."""


class KeyStore:
    """Thread-safe registry of user keys (digest → ``UserKey``) and the admin key."""

    def __init__(
        self, keys: list[str], *, admin_key: str | None = None, max_sessions_per_key: int = 64
    ) -> None:
        self._lock = threading.Lock()
        self._keys: dict[str, UserKey] = {}
        self.max_sessions_per_key = max_sessions_per_key
        self.admin_key = admin_key or new_key()
        self._admin_digest = digest(self.admin_key)
        for k in keys:
            self.add(k)

    def add(self, key: str, *, name: str | None = None, max_sessions: int | None = None) -> UserKey:
        d = digest(key)
        user = UserKey(
            key_id=d[:12],
            name=name,
            max_sessions=max_sessions or self.max_sessions_per_key,
        )
        with self._lock:
            existing = self._keys.get(d)
            if existing is not None:
                return existing
            self._keys[d] = user
        return user

    def issue(
        self, *, name: str | None = None, max_sessions: int | None = None
    ) -> tuple[str, UserKey]:
        key = new_key()
        user = self.add(key, name=name, max_sessions=max_sessions)
        user.issued = True
        return key, user

    def lookup(self, key: str | None) -> UserKey | None:
        if not key:
            return None
        with self._lock:
            return self._keys.get(digest(key))

    def is_admin(self, key: str | None) -> bool:
        return bool(key) and hmac.compare_digest(digest(key), self._admin_digest)

    def acquire(self, user: UserKey) -> None:
        """Count one more open session for ``user`` or raise ``QuotaExceededError``."""
        with self._lock:
            if user.open_sessions >= user.max_sessions:
                raise QuotaExceededError(
                    f"key {user.key_id} already has {user.open_sessions} open sessions "
                    f"(quota {user.max_sessions}); finalize some first"
                )
            user.open_sessions += 1

    def release(self, user: UserKey) -> None:
        with self._lock:
            user.open_sessions = max(0, user.open_sessions - 1)

    def __len__(self) -> int:
        with self._lock:
            return len(self._keys)
