"""``ServiceConfig``: the any-agent training service (gateway, auth, backends, trajectory export).

Kept apart from ``areal_env.api.config`` so the service can evolve on its own; the experiment
config attaches it as its ``service:`` section. It lives in ``api`` (the bottom layer) because
that config holds it; it imports only ``api.errors`` and ``http.net``, so no cycle. Plain
dataclass, loaded by the same loader (``config_from_dict(ServiceConfig, {...})``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from areal_env.api.config_load import path_field
from areal_env.api.errors import ConfigError, check_port, check_rate_limit
from areal_env.http.net import is_loopback

__all__ = ["ServiceConfig"]


@dataclass
class ServiceConfig:
    """The public gateway users point ``OPENAI_BASE_URL`` at."""

    host: str = "127.0.0.1"
    """Bind address. A non-loopback address needs user keys (``api_keys`` or ``key_file``)."""
    port: int = 0
    """0 = pick a free port."""
    api_keys: list[str] = field(default_factory=list)
    """User API keys accepted as ``Authorization: Bearer KEY`` (or ``x-api-key``)."""
    key_file: str | None = path_field("file", default=None)
    """A file with one user key per line (``#`` comments allowed), read at start."""
    admin_key: str | None = None
    """Service admin key (issues user keys via ``POST /admin/keys``); None = generated."""
    max_sessions_per_key: int = 64
    """Concurrent open sessions per user key; past it ``POST /rl/v1/sessions`` answers 429."""
    session_ttl: float = 3600.0
    """Seconds an idle session lives before it is failed and closed."""
    health_interval: float = 5.0
    """Seconds between health probes of each proxy backend."""
    health_timeout: float = 5.0
    """Seconds a backend health probe may take."""
    health_failures: int = 2
    """Consecutive failed probes before a backend leaves the rotation (a refused connection
    while forwarding removes it at once)."""
    num_proxies: int = 1
    """Proxy instances started by ``serve-training`` (one per inference group)."""
    discount: float | None = None
    """Reward discount along the conversation tree at export; None = ``rollout.discount``."""
    export_style: Literal["individual", "concat"] | None = None
    """Export style; None = ``rollout.export_style``."""
    group_timeout: float = 1800.0
    """Seconds an incomplete GRPO group may wait for members before it is used as it is."""
    admission_control: bool = True
    """``serve-training``: start a session only while the trainer can still use it within
    ``rollout.max_head_offpolicyness`` versions (otherwise it waits, then answers 429)."""
    stale_trajectories: Literal["train", "drop"] = "train"
    """A trajectory more than ``rollout.max_head_offpolicyness`` versions behind the trainer when
    its batch is formed. Admission keeps sessions within that bound, but a group that waited
    for a member retried after a failure or a restart can pass it. ``train``: trained all the
    same (it was acknowledged; the PPO ratio uses its recorded logprobs), counted in
    ``staleness/over_bound``. ``drop``: dropped, counted in ``rejected/stale``."""
    admission_timeout: float = 30.0
    """Seconds ``POST /rl/v1/sessions`` waits for an admission slot before answering 429."""
    request_timeout: float = 3600.0
    """Read timeout of forwarded model calls (generation can be slow)."""
    store: str | None = path_field("store", default=None)
    """Durable service state (keys, sessions, acknowledged trajectories): a SQLite file path
    or ``sqlite:///path``, or ``postgresql://user:pass@host/db`` (``pip install
    'areal-env[postgres]'``) for gateways on several hosts. None = ``RUN_DIR/service.db``."""
    instance: str = "main"
    """This gateway's name in a shared store: on start it fails only the sessions it left
    open. Give each host sharing one PostgreSQL store its own name."""
    tokens_per_minute: int | None = None
    """Default per-key limit of tokens (prompt + completion) per minute; None = no limit."""
    max_tokens_per_key: int | None = None
    """Default per-key limit of tokens in total (kept across restarts); None = no limit."""
    requests_per_second: float | None = None
    """Default per-key request rate of model calls (``/v1/...``): a token bucket per user key
    (configured or admin-issued), refilled at this rate; past it, 429 with ``Retry-After``.
    None = no limit."""
    requests_burst: int | None = None
    """Model calls a key may send at once before ``requests_per_second`` applies. None = one
    second's worth."""
    drain_timeout: float = 60.0
    """On shutdown: seconds open sessions may still finish (and be kept) before the exit."""
    drain_retry_after: float = 30.0
    """Retry-After (seconds) of the 503 that refuses new sessions while shutting down."""
    ssl_keyfile: str | None = path_field("file", default=None)
    """TLS private key (PEM) passed to uvicorn; with ``ssl_certfile`` the service speaks https."""
    ssl_certfile: str | None = path_field("file", default=None)
    """TLS certificate file (with ssl_keyfile) for HTTPS."""

    def request_rate(self) -> tuple[float, int] | None:
        """``(requests per second, burst)`` per user key, or None (``ConfigError`` if bad)."""
        return check_rate_limit(
            "service",
            "requests_per_second",
            self.requests_per_second,
            "requests_burst",
            self.requests_burst,
        )

    def validate(self) -> None:
        check_port("service", self.port)
        if self.max_sessions_per_key < 1:
            raise ConfigError(
                f"service.max_sessions_per_key={self.max_sessions_per_key!r} must be >= 1"
            )
        if self.num_proxies < 1:
            raise ConfigError(f"service.num_proxies={self.num_proxies!r} must be >= 1")
        for name in (
            "session_ttl",
            "health_interval",
            "health_timeout",
            "group_timeout",
            "admission_timeout",
            "drain_retry_after",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"service.{name}={getattr(self, name)!r} must be > 0")
        if self.stale_trajectories not in ("train", "drop"):
            raise ConfigError(
                f"service.stale_trajectories={self.stale_trajectories!r}: use 'train' or 'drop'"
            )
        if self.drain_timeout < 0:
            raise ConfigError(f"service.drain_timeout={self.drain_timeout!r} must be >= 0")
        for name in ("tokens_per_minute", "max_tokens_per_key"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"service.{name}={value!r} must be >= 1 (or null: no limit)")
        self.request_rate()
        if not self.instance or "/" in self.instance:
            raise ConfigError(f"service.instance={self.instance!r} must be a non-empty name")
        if self.health_failures < 1:
            raise ConfigError(f"service.health_failures={self.health_failures!r} must be >= 1")
        if self.discount is not None and not (0.0 <= self.discount <= 1.0):
            raise ConfigError(f"service.discount={self.discount!r} must be in [0, 1]")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ConfigError("service.ssl_keyfile and service.ssl_certfile go together")
        if self.key_file is not None and not Path(self.key_file).is_file():
            raise ConfigError(f"service.key_file={self.key_file!r} does not exist")
        if not is_loopback(self.host) and not (self.api_keys or self.key_file):
            raise ConfigError(
                f"service.host={self.host!r} is not a loopback address: configure user keys "
                "(service.api_keys or service.key_file) before serving on a network"
            )

    def load_keys(self) -> list[str]:
        """The configured user keys: ``api_keys`` plus the lines of ``key_file``."""
        keys = [k for k in self.api_keys if k]
        if self.key_file:
            for line in Path(self.key_file).read_text().splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    keys.append(line)
        return keys

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"
