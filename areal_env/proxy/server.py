"""``ProxyServer``: the proxy app served by uvicorn in a background thread, and its CLI.

The server runs in a daemon thread with its own event loop, so a trainer (or a test) keeps its
own loop free; the engine's ``agenerate`` may be awaited from any loop. The socket is bound
before the thread starts, so ``port=0`` yields a free port without a race, and ``start()``
returns only once ``/health`` answers.
"""

from __future__ import annotations

import argparse
import gc
import logging
import secrets
import signal
import sys
import time
from typing import Any

from areal_env.api.config import ProxyConfig
from areal_env.api.engine import InferenceEngine
from areal_env.http import routes
from areal_env.http.net import is_loopback, url_host
from areal_env.http.runner import ServerThread
from areal_env.proxy.app import ProxyState, create_app
from areal_env.proxy.policies import PolicyEndpoint

logger = logging.getLogger(__name__)

# Keys that must never protect a proxy reachable from other machines.
_GC_THRESHOLD0 = 10_000
_WEAK_ADMIN_KEYS = {"", "admin", "changeme", "default", "password", "secret", "test", "areal"}


def check_admin_key(config: ProxyConfig) -> None:
    """Refuse an empty key, and a missing or well-known one off loopback."""
    key = config.admin_key
    if key is not None and not key.strip():
        raise ValueError("proxy.admin_key must not be empty")
    if not is_loopback(config.host) and (
        key is None or key.strip().lower() in _WEAK_ADMIN_KEYS or len(key) < 16
    ):
        raise ValueError(
            f"refusing to serve on non-loopback host {config.host!r} without a strong admin key: "
            "set proxy.admin_key (--admin-key) to a random secret of at least 16 characters"
        )


def freeze_startup_heap() -> None:
    """Move every object alive now out of the cyclic GC's reach (``gc.freeze``).

    A process that loaded torch and transformers holds ~400k GC-tracked objects that live for
    ever. Each full collection walks all of them (100+ ms on a loaded 2-core machine), and the
    proxy's steady stream of surviving objects (recorded interactions) triggers one every few
    hundred requests: without this, garbage collection costs more CPU than serving. Objects
    created later (sessions, the trainer's own) are collected as usual. The youngest
    generation's threshold is raised too (never lowered): a request allocates hundreds of
    short-lived containers, and a collection every 700 of them mostly walks live request state.
    Idempotent.
    """
    gc.collect()
    gc.freeze()
    t0, t1, t2 = gc.get_threshold()
    if 0 < t0 < _GC_THRESHOLD0:
        gc.set_threshold(_GC_THRESHOLD0, t1, t2)


class ProxyServer:
    """The interception proxy on ``engine``: ``with ProxyServer(engine, tok) as p: p.base_url``.

    ``freeze_gc``: call :func:`freeze_startup_heap` when starting (default on).
    ``policies``: a multi-agent run's policies by name; a request's ``model`` picks one
    (``proxy.policies``). Without them ``engine`` answers every model name.
    """

    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer: Any,
        config: ProxyConfig | None = None,
        *,
        model_name: str | None = None,
        renderer: Any = None,
        freeze_gc: bool = True,
        train_gconfig: Any = None,
        policies: dict[str, PolicyEndpoint] | None = None,
    ) -> None:
        self.freeze_gc = freeze_gc
        self.config = config or ProxyConfig()
        self.config.validate()
        check_admin_key(self.config)
        key = self.config.admin_key
        self.admin_key_generated = key is None
        self.admin_key: str = key if key is not None else "ak-" + secrets.token_urlsafe(32)
        self.state = ProxyState(
            engine,
            tokenizer,
            self.config,
            admin_key=self.admin_key,
            model_name=model_name,
            renderer=renderer,
            train_gconfig=train_gconfig,
            policies=policies,
        )
        self.app = create_app(self.state)
        self._runner = ServerThread(
            self.app,
            self.config.host,
            self.config.port,
            name="proxy",
            health_path=routes.HEALTH,
            before_start=freeze_startup_heap if freeze_gc else None,
        )
        self.host = self.config.host

    @property
    def port(self) -> int:
        return self._runner.port

    @property
    def running(self) -> bool:
        return self._runner.running

    @property
    def base_url(self) -> str:
        return f"http://{url_host(self.host)}:{self.port}"

    @property
    def openai_base_url(self) -> str:
        return self.base_url + routes.OPENAI_PREFIX

    def start(self, timeout: float = 30.0) -> ProxyServer:
        if not self._runner.running:
            self._runner.start(timeout)
            logger.info("proxy listening at %s (model %s)", self.base_url, self.state.model_name)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._runner.stop(timeout)

    def __enter__(self) -> ProxyServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """``areal-env proxy --model NAME_OR_PATH [--host H] [--port P] [--admin-key K]``."""
    p = argparse.ArgumentParser(
        prog="areal-env proxy",
        description="Serve a model behind the OpenAI/Anthropic-compatible RL interception proxy.",
    )
    p.add_argument(
        "--model", default=None, help="model name or HF folder (default: the embedded default)"
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (0 = any free port)")
    p.add_argument(
        "--admin-key",
        default=None,
        help="admin key (default: generated and printed once; required off loopback)",
    )
    p.add_argument("--tool-parser", default="auto", help="auto|hermes|qwen|llama3|mistral|none")
    p.add_argument(
        "--initial-capacity",
        type=int,
        default=None,
        help="sessions allowed before any grant (default unlimited)",
    )
    p.add_argument(
        "--session-ttl", type=float, default=3600.0, help="idle session lifetime, seconds"
    )
    p.add_argument(
        "--rate-limit-rps",
        type=float,
        default=None,
        help="model requests per second per session key (default: no limit)",
    )
    p.add_argument(
        "--rate-limit-burst",
        type=int,
        default=None,
        help="requests a session key may send at once (default: one second's worth)",
    )
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-context-len", type=int, default=None)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of the engine's decode loop (model.num_threads; default: torch's "
        "choice). On a busy machine 1 is often fastest: 2-thread regions wait for descheduled "
        "threads",
    )
    args = p.parse_args(argv)

    from areal_env.engine.local import LocalEngine
    from areal_env.engine.models import DEFAULT_MODEL, resolve_model_path

    name = args.model or DEFAULT_MODEL
    path = str(resolve_model_path(name))
    options = (
        "host",
        "port",
        "admin_key",
        "tool_parser",
        "initial_capacity",
        "session_ttl",
        "rate_limit_rps",
        "rate_limit_burst",
    )
    cfg = ProxyConfig(model_name=name, **{k: getattr(args, k) for k in options})
    try:
        cfg.validate()
        check_admin_key(cfg)
    except ValueError as e:
        print(f"areal-env proxy: {e}", file=sys.stderr)
        return 2
    if args.threads is not None and args.threads < 1:
        print(f"areal-env proxy: --threads must be >= 1, got {args.threads}", file=sys.stderr)
        return 2
    engine = LocalEngine(
        path,
        max_batch_size=args.max_batch_size,
        max_context_len=args.max_context_len,
        num_threads=args.threads,
    )
    engine.initialize()
    server = ProxyServer(engine, engine.tokenizer, cfg)
    server.start()
    print(
        f"areal-env proxy serving {name} at {server.base_url}  (OpenAI base_url: {server.openai_base_url})"
    )
    if server.admin_key_generated:
        print(f"admin key (generated, shown once): {server.admin_key}")
    else:
        print("admin key: the one passed with --admin-key")
    sys.stdout.flush()

    def _terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    try:
        while server.running:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        engine.destroy()
    return 0
