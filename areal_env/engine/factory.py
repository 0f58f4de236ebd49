"""``create_engine(cfg)``: the config switch between inference backends.

- ``engine.backend: local`` → the embedded ``LocalEngine`` (transformers, in this process);
- ``engine.backend: sglang`` → ``SGLangEngine`` on ``engine.sglang.addresses`` if given, else on
  servers launched at ``initialize()`` (``python -m sglang.launch_server`` or
  ``engine.sglang.launch_command``) and stopped by ``destroy()``;
- ``engine.backend: remote`` → ``SGLangEngine`` on already-running servers in ``engine.addresses``
  (``areal-env serve`` or SGLang).

The engine is returned uninitialized: call ``initialize()`` (heavy work happens there).
"""

from __future__ import annotations

from typing import Any

from areal_env.api.config import ConfigError, ExperimentConfig


def _sglang_engine(cfg: ExperimentConfig, addresses: list[str], launch: Any = None) -> Any:
    from areal_env.engine.sglang import SGLangEngine

    try:
        return SGLangEngine(
            addresses,
            request_timeout=cfg.engine.request_timeout,
            max_retries=cfg.engine.max_retries,
            startup_timeout=cfg.engine.sglang.startup_timeout,
            launch=launch,
        )
    except ValueError as e:
        raise ConfigError(f"engine: {e}") from e


def create_engine(cfg: ExperimentConfig) -> Any:
    """Build the ``InferenceEngine`` that ``cfg.engine.backend`` names (not yet initialized)."""
    backend = cfg.engine.backend
    if backend == "local":
        from areal_env.engine.local import LocalEngine

        return LocalEngine.from_config(cfg.model, cfg.engine)
    if backend == "sglang":
        sg = cfg.engine.sglang
        if sg.addresses:
            return _sglang_engine(cfg, list(sg.addresses))

        def launch() -> Any:
            from areal_env.engine.launcher import launch_from_config

            return launch_from_config(cfg)

        return _sglang_engine(cfg, [], launch=launch)
    if backend == "remote":
        if not cfg.engine.addresses:
            raise ConfigError("engine.backend=remote needs engine.addresses (host:port list)")
        return _sglang_engine(cfg, list(cfg.engine.addresses))
    raise ConfigError(f"engine.backend={backend!r} is invalid; valid values: local, sglang, remote")
