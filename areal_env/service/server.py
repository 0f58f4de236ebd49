"""``areal-env serve-training CONFIG.yaml [section.key=value ...]``: the any-agent training service.

Starts the inference engine, ``service.num_proxies`` proxies on it, the public gateway and a
``PPOTrainer`` whose batches come from sessions that external agents finalize (an
``ExternalTrajectorySource`` passed as its executor instead of a dataset), then prints one line with the URL users
point ``OPENAI_BASE_URL`` at (plus ``/v1``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import yaml

from areal_env.api.config import (
    ConfigError,
    ExperimentConfig,
    config_from_dict,
    load_config,
    parse_overrides,
)
from areal_env.api.service_config import ServiceConfig
from areal_env.service.lifecycle import ServiceStack

logger = logging.getLogger(__name__)

LISTENING = "areal-env any-agent server listening at {url}"


@dataclasses.dataclass
class _ServiceSection:
    service: ServiceConfig = dataclasses.field(default_factory=ServiceConfig)


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = (
            _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out


def load_service_config(
    path: str | None, overrides: list[str] | None = None
) -> tuple[ExperimentConfig, ServiceConfig]:
    """The experiment config and its ``service:`` section (also before the section is attached
    to ``ExperimentConfig``: then it is split off the YAML and the overrides here)."""
    if any(f.name == "service" for f in dataclasses.fields(ExperimentConfig)):
        cfg = load_config(ExperimentConfig, path, overrides)
        return cfg, cfg.service  # type: ignore[attr-defined]
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        loaded = yaml.safe_load(p.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level")
        data = loaded
    data = _deep_merge(data, parse_overrides(overrides or []))
    service = data.pop("service", None) or {}
    if not isinstance(service, dict):
        raise ConfigError("service must be a mapping of fields")
    wrapped = config_from_dict(_ServiceSection, {"service": service})  # errors say "service.x"
    return config_from_dict(ExperimentConfig, data), wrapped.service


def _tokenizer_of(engine: Any, cfg: ExperimentConfig) -> Any:
    tok = getattr(engine, "tokenizer", None)
    if tok is not None:
        return tok
    from transformers import AutoTokenizer

    from areal_env.engine.models import resolve_model_path

    return AutoTokenizer.from_pretrained(
        str(resolve_model_path(cfg.model.path, cfg.model.cache_dir))
    )


def create_engine(cfg: ExperimentConfig) -> Any:
    """The configured engine (uninitialized), on the resolved model folder."""
    from areal_env.engine.models import resolve_model_path

    model_path = str(resolve_model_path(cfg.model.path, cfg.model.cache_dir))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=model_path))
    try:
        from areal_env.engine.factory import create_engine as factory
    except ImportError:
        from areal_env.engine.local import LocalEngine

        return LocalEngine.from_config(cfg.model, cfg.engine)
    return factory(cfg)


class TrainingService(ServiceStack):
    """Engine + proxies + gateway + trajectory source, started and stopped together."""

    def __init__(
        self, cfg: ExperimentConfig, service: ServiceConfig, *, engine: Any = None
    ) -> None:
        self.cfg = cfg
        self.service = service
        self.engine = engine
        self._own_engine = engine is None
        self.proxies: list[Any] = []
        self.gateway: Any = None
        self.source: Any = None

    def _start_parts(self) -> None:
        from areal_env.proxy.server import ProxyServer
        from areal_env.service.gateway import GatewayServer
        from areal_env.service.source import ExternalTrajectorySource

        if self.engine is None:
            self.engine = create_engine(self.cfg)
            self.engine.initialize()
        tokenizer = _tokenizer_of(self.engine, self.cfg)
        for _ in range(self.service.num_proxies):
            pcfg = dataclasses.replace(self.cfg.proxy, host="127.0.0.1", port=0)
            self.proxies.append(ProxyServer(self.engine, tokenizer, pcfg).start())
        self.source = ExternalTrajectorySource(
            self.cfg.rollout,
            group_timeout=self.service.group_timeout,
            admission_control=self.service.admission_control,
        )
        self.gateway = GatewayServer(
            self.service,
            backends=[(p.base_url, p.admin_key) for p in self.proxies],
            source=self.source,
            discount=self.cfg.rollout.discount,
            export_style=self.cfg.rollout.export_style,
        ).start()

    def _stop_backends(self) -> None:
        if self.source is not None:
            self.source.close()
        for p in self.proxies:
            p.stop()
        self.proxies = []


async def _train(cfg: ExperimentConfig, svc: TrainingService) -> dict[str, Any] | None:
    """``PPOTrainer`` on the service's trajectory source and engine, until ``total_train_steps``
    or a signal: the first SIGINT/SIGTERM closes the source (the current step finishes and is
    checkpointed), a second one cancels at once. Returns the final metrics (None if cancelled).
    """
    from areal_env.trainer.ppo import PPOTrainer

    trainer = PPOTrainer(cfg, executor=svc.source, engine=svc.engine)
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(trainer.atrain())
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            logger.info("interrupted: finishing the current step, then shutting down")
            svc.source.close()
        else:
            task.cancel()

    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal)
            installed.append(sig)
        except (NotImplementedError, RuntimeError):  # not the main thread / platform
            pass
    try:
        return await task
    except asyncio.CancelledError:
        logger.info("interrupted: shutting down")
        return None
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        trainer.close()  # metrics files; the engine stays with the service


def _write_secret(path: Path, value: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")


async def serve_training(cfg: ExperimentConfig, service: ServiceConfig) -> int:
    svc = await asyncio.to_thread(TrainingService(cfg, service).start)
    try:
        if service.admin_key is None:
            key_path = cfg.run_dir / "service_admin_key"
            _write_secret(key_path, svc.gateway.admin_key)
        print(LISTENING.format(url=svc.base_url), flush=True)
        if service.admin_key is None:
            print(f"service admin key (issues user keys) written to {key_path}", flush=True)
        if svc.gateway.gateway.open_mode:
            print("no user keys configured: any API key is accepted (loopback only)", flush=True)
        result = await _train(cfg, svc)
        if result is not None:
            logger.info(
                "training finished: step %s, version %s", result.get("step"), result.get("version")
            )
        return 0
    finally:
        await asyncio.to_thread(svc.stop)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="areal-env serve-training",
        description="Any-agent training service: external agents train the model over HTTP. "
        "Point OPENAI_BASE_URL at the printed URL + /v1.",
    )
    p.add_argument("config", nargs="?", help="experiment YAML (with an optional service: section)")
    p.add_argument("overrides", nargs="*", help="section.key=value (e.g. service.port=8000)")
    p.add_argument("--host", help="shortcut for service.host")
    p.add_argument("--port", type=int, help="shortcut for service.port")
    args = p.parse_args(argv)
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).is_file():
        overrides.insert(0, config)
        config = None
    if args.host:
        overrides.append(f"service.host={args.host}")
    if args.port is not None:
        overrides.append(f"service.port={args.port}")
    try:
        cfg, service = load_service_config(config, overrides)
    except ConfigError as e:
        print(f"areal-env serve-training: {e}", file=sys.stderr)
        return 2
    return asyncio.run(serve_training(cfg, service))


if __name__ == "__main__":
    sys.exit(main())
