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
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_env.api.config import ConfigError, ExperimentConfig, load_config
from areal_env.api.service_config import ServiceConfig

if TYPE_CHECKING:
    from areal_env.trainer.ppo import PPOTrainer

logger = logging.getLogger(__name__)

LISTENING = "areal-env any-agent server listening at {url}"


def load_service_config(
    path: str | None, overrides: list[str] | None = None
) -> tuple[ExperimentConfig, ServiceConfig]:
    """The experiment config and its ``service:`` section."""
    cfg = load_config(ExperimentConfig, path, overrides)
    return cfg, cfg.service


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


def resume_point(cfg: ExperimentConfig) -> tuple[int, int]:
    """``(step, version)`` the trainer will resume from (``trainer.recover``), read from the
    newest checkpoint without loading it."""
    if cfg.trainer.recover != "auto":
        return 0, 0
    from areal_env.trainer.checkpoint import latest_checkpoint, load_trainer_state

    found = latest_checkpoint(cfg.run_dir / "checkpoints")
    if found is None:
        return 0, 0
    state = load_trainer_state(found)
    step = int(state["step"])
    return step, int(state.get("version", step))


class TrainingService:
    """Store + trajectory source + gateway + engine + proxies, started and stopped together
    (``with`` works too).

    The gateway's port is taken first (a busy port fails before the model loads), and the
    source reloads every acknowledged trajectory the store holds before agents connect.
    """

    def __init__(
        self, cfg: ExperimentConfig, service: ServiceConfig, *, engine: Any = None
    ) -> None:
        """``engine``: train on this (uninitialized) engine, left running at stop; by default
        the configured one is made and destroyed at stop."""
        self.cfg = cfg
        self.service = service
        self.engine = engine
        self.engines: Any = None
        """With ``policies:``: every policy's engine (``PolicyEngines``; ``engine`` is their
        base); the proxies route each request's ``model`` to its policy."""
        self.proxies: list[Any] = []
        self.gateway: Any = None
        self.source: Any = None
        self.store: Any = None
        self.store_summary: Any = None
        """What the store held at start (``StoreSummary``)."""
        self.resumed_step = 0
        self._started = ExitStack()
        """How to stop what started, run in reverse order by ``stop()``."""

    @property
    def base_url(self) -> str:
        return self.gateway.base_url

    def start(self) -> TrainingService:
        """Start every part; a failure half-way stops what did start (servers hold ports and
        threads, the store its lock) and raises."""
        with ExitStack() as started:
            self._start(started)
            self._started = started.pop_all()
        return self

    def stop(self) -> None:
        """Stop in the reverse order of the start: the gateway first, so no new request
        reaches a stopped proxy, then the proxies, the engines, the source and the store."""
        self._started.close()

    def __enter__(self) -> TrainingService:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _start(self, started: ExitStack) -> None:
        from areal_env.proxy.server import ProxyServer
        from areal_env.service.gateway import GatewayServer
        from areal_env.service.source import ExternalTrajectorySource
        from areal_env.service.store import open_store, redact_url

        run = f"{self.cfg.experiment_name}/{self.cfg.trial_name}"
        self.store = open_store(self.service.store, self.cfg.run_dir, run=run)
        started.callback(self._close_store)
        self.store_summary = self.store.summary()
        logger.info("service store: %s", redact_url(self.store.url))
        self.source = ExternalTrajectorySource(
            self.cfg.rollout,
            group_timeout=self.service.group_timeout,
            admission_control=self.service.admission_control,
            store=self.store,
            stale_trajectories=self.service.stale_trajectories,
        )
        started.callback(self.source.close)
        self.gateway = GatewayServer(
            self.service,
            source=self.source,
            discount=self.cfg.rollout.discount,
            export_style=self.cfg.rollout.export_style,
            store=self.store,
            max_new_tokens=self.cfg.gconfig.max_new_tokens,
        ).check_port()
        step, version = resume_point(self.cfg)
        self.resumed_step = step
        self.source.load(step, trainer_version=version)
        endpoints = None
        if self.cfg.policies:
            endpoints = self._start_policy_engines(started)
        if self.engine is None:
            self.engine = create_engine(self.cfg)
            started.callback(self._destroy_engine)
            self.engine.initialize()
        tokenizer = _tokenizer_of(self.engine, self.cfg)
        model_name = (
            self.cfg.proxy.model_name or f"{self.cfg.experiment_name}/{self.cfg.trial_name}"
        )
        for _ in range(self.service.num_proxies):
            pcfg = dataclasses.replace(
                self.cfg.proxy, host="127.0.0.1", port=0, model_name=model_name
            )
            proxy = ProxyServer(self.engine, tokenizer, pcfg, policies=endpoints).start()
            started.callback(proxy.stop)
            self.proxies.append(proxy)
            self.gateway.add_backend(proxy.base_url, proxy.admin_key)
        started.callback(self.gateway.stop)
        self.gateway.start()

    def _start_policy_engines(self, started: ExitStack) -> dict[str, Any]:
        """Every policy's engine (the base one made here unless passed in), adapter policies
        answered by the base weights until the trainer pushes their adapters."""
        from areal_env.engine.policies import PolicyEngines
        from areal_env.proxy.policies import PolicyEndpoint

        self.engines = PolicyEngines.from_config(self.cfg, base=self.engine)
        started.callback(self._destroy_engines)
        self.engines.initialize()
        self.engines.load_untrained_adapters()
        self.engine = self.engines.base  # the set stops it
        return {
            name: PolicyEndpoint(engine, self.engines.tokenizer(name))
            for name, engine in self.engines.routes.items()
        }

    def _destroy_engines(self) -> None:
        self.engines.destroy()
        self.engines = self.engine = None

    def _destroy_engine(self) -> None:
        self.engine.destroy()
        self.engine = None

    def _close_store(self) -> None:
        self.store.close()
        self.store = None


def _service_trainer(cfg: ExperimentConfig, svc: TrainingService) -> PPOTrainer:
    """``PPOTrainer`` on the service's trajectory source and engine; each checkpoint commits
    the trajectories trained so far in the store (the source numbers the steps itself)."""
    from areal_env.trainer.ppo import PPOTrainer  # torch loads only when training starts

    source = svc.source
    return PPOTrainer(
        cfg,
        source=source,
        engine=svc.engines if svc.engines is not None else svc.engine,
        on_checkpoint=lambda step, _path: source.commit(step),
    )


class _Shutdown:
    """Signal handling: the first SIGINT/SIGTERM stops training cleanly (no new sessions, the
    current step finishes and is checkpointed, open sessions may finish); a second one exits
    at once with status 130 (within 4 s, even if a step is running in a worker thread)."""

    def __init__(self, drain_timeout: float) -> None:
        self.drain_timeout = drain_timeout
        self.count = 0
        self.task: asyncio.Task | None = None
        """The training task (cancelled by the second signal)."""
        self.svc: TrainingService | None = None

    def attach(self, svc: TrainingService) -> None:
        """The service is up: a signal that came while it started stops it now."""
        self.svc = svc
        if self.count:
            self._stop_intake()

    def _stop_intake(self) -> None:
        assert self.svc is not None
        self.svc.gateway.drain()
        self.svc.source.close()

    def __call__(self) -> None:
        self.count += 1
        if self.count == 1:
            print(
                "shutting down: no new sessions; the current step finishes and is checkpointed, "
                f"open sessions may finish for up to {self.drain_timeout:.0f} s "
                "(Ctrl-C again to exit now)",
                flush=True,
            )
            if self.svc is not None:
                self._stop_intake()
        elif self.count == 2:
            print("exiting now (status 130)", flush=True)
            if self.task is not None:
                self.task.cancel()
            # A step in a worker thread cannot be cancelled: leave anyway. The store is
            # transactional, so nothing acknowledged is lost.
            killer = threading.Timer(4.0, os._exit, args=(EXIT_FORCED,))
            killer.daemon = True
            killer.start()

    def install(self, loop: asyncio.AbstractEventLoop) -> list[signal.Signals]:
        installed = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self)
                installed.append(sig)
            except (NotImplementedError, RuntimeError):  # not the main thread / platform
                pass
        return installed


EXIT_FORCED = 130
"""Exit status after a second Ctrl-C / SIGTERM (the shell's status for SIGINT)."""


async def _drain(svc: TrainingService, shutdown: _Shutdown) -> None:
    """Let open sessions finish (their trajectories are stored) up to ``drain_timeout``."""
    svc.gateway.drain()
    deadline = time.monotonic() + svc.service.drain_timeout
    last_print = 0.0
    while True:
        left = await asyncio.to_thread(lambda: svc.gateway.open_sessions)
        remaining = deadline - time.monotonic()
        if left == 0 or remaining <= 0 or shutdown.count > 1:
            break
        if time.monotonic() - last_print >= 5.0:
            print(
                f"draining: {left} open sessions may still finish ({remaining:.0f} s left)",
                flush=True,
            )
            last_print = time.monotonic()
        await asyncio.sleep(0.5)
    if left:
        print(f"drain deadline reached: {left} open sessions are dropped", flush=True)
    else:
        print("drained: every open session finished", flush=True)


def _stopped_message(step: int, resumed: int) -> str:
    trained = step - resumed
    done = f"{trained} trained in this run" if trained else "no step trained in this run"
    saved = f"; checkpoint step_{step} is saved" if step else ""
    return f"stopped at step {step} ({done}{saved}): run the same command again to resume"


async def _train(cfg: ExperimentConfig, svc: TrainingService, shutdown: _Shutdown) -> int:
    """``PPOTrainer`` on the service's trajectory source and engine, until ``total_train_steps``
    or a signal (see ``_Shutdown``); then the gateway drains. Returns the exit status."""
    trainer = _service_trainer(cfg, svc)
    shutdown.task = task = asyncio.create_task(trainer.atrain())

    def step() -> int:  # before the trainer restored its checkpoint, the step it resumes at
        return max(int(getattr(trainer, "step", 0)), svc.resumed_step)

    try:
        try:
            result = await task
        except asyncio.CancelledError:
            print(
                f"exited at step {step()}: a step in progress is not saved; run the same "
                "command again to resume from the last checkpoint",
                flush=True,
            )
            return EXIT_FORCED
        finally:
            trainer.close()  # metrics files; the engine stays with the service
        total = cfg.trainer.total_train_steps
        if shutdown.count == 0 and total is not None and step() >= total:
            # Before anyone can read "finished": no session starts after it, and sessions
            # waiting for admission are told that training is over.
            svc.gateway.drain(finished=f"{step()} of trainer.total_train_steps={total} steps")
            svc.source.close()
            version = (result or {}).get("version", getattr(trainer, "version", None))
            print(f"training finished: step {step()} of {total}, version {version}", flush=True)
        else:
            svc.gateway.drain()
            print(_stopped_message(step(), svc.resumed_step), flush=True)
        await _drain(svc, shutdown)
        return EXIT_FORCED if shutdown.count > 1 else 0
    finally:
        shutdown.task = None


def _write_secret(path: Path, value: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")


def _admin_key(cfg: ExperimentConfig, service: ServiceConfig) -> ServiceConfig:
    """The configured admin key, else the one a previous start wrote to the run dir (keys
    survive restarts), else a new one written there (mode 0600)."""
    if service.admin_key is not None:
        return service
    from areal_env.service.auth import new_key

    path = cfg.run_dir / "service_admin_key"
    key = path.read_text().strip() if path.is_file() else ""
    if not key:
        key = new_key()
        _write_secret(path, key)
    return dataclasses.replace(service, admin_key=key)


def finished_message(cfg: ExperimentConfig) -> str | None:
    """Why starting is pointless: the trial already trained ``total_train_steps``."""
    total = cfg.trainer.total_train_steps
    if total is None:
        return None
    step, _ = resume_point(cfg)
    if step < total:
        return None
    return (
        f"trial {cfg.experiment_name}/{cfg.trial_name} already finished: it trained {step} of "
        f"trainer.total_train_steps={total} steps ({cfg.run_dir}). Give a new trial_name=..., "
        "raise trainer.total_train_steps to continue, or serve the result with "
        f"`areal-env serve --experiment {cfg.experiment_name} --trial {cfg.trial_name}`"
    )


async def serve_training(cfg: ExperimentConfig, service: ServiceConfig) -> int:
    """Run the service until training finishes (0) or a signal stops it (0 after a clean stop,
    130 after a second signal); 2 when it cannot start (busy port, another run's store, a
    finished trial)."""
    from areal_env.service.gateway import PortInUseError
    from areal_env.service.store import StoreInUseError, redact_url

    done = finished_message(cfg)
    if done is not None:
        print(f"areal-env serve-training: {done}", file=sys.stderr, flush=True)
        return 2
    service = _admin_key(cfg, service)
    loop = asyncio.get_running_loop()
    shutdown = _Shutdown(service.drain_timeout)
    installed = shutdown.install(loop)  # a signal while the model loads stops the start too
    try:
        try:
            svc = await asyncio.to_thread(TrainingService(cfg, service).start)
        except (PortInUseError, StoreInUseError) as e:
            message = e.strerror if isinstance(e, PortInUseError) else str(e)
            print(f"areal-env serve-training: {message}", file=sys.stderr, flush=True)
            return 2
        try:
            shutdown.attach(svc)
            print(LISTENING.format(url=svc.base_url), flush=True)
            print(
                f"service store {redact_url(svc.store.url)}: {svc.store_summary.describe()}",
                flush=True,
            )
            if cfg.service.admin_key is None and service.admin_key is not None:
                print(
                    f"service admin key (issues user keys) in {cfg.run_dir / 'service_admin_key'}",
                    flush=True,
                )
            if svc.gateway.gateway.book.open_mode:
                print(
                    "no user keys configured: any API key is accepted (loopback only)", flush=True
                )
            if shutdown.count:
                print(_stopped_message(svc.resumed_step, svc.resumed_step), flush=True)
                return EXIT_FORCED if shutdown.count > 1 else 0
            return await _train(cfg, svc, shutdown)
        finally:
            await asyncio.to_thread(svc.stop)
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


def parse_command_line(argv: list[str] | None) -> tuple[str | None, list[str]]:
    """``(config path, overrides)``; options may stand anywhere among the overrides."""
    p = argparse.ArgumentParser(
        prog="areal-env serve-training",
        description="Any-agent training service: external agents train the model over HTTP. "
        "Point OPENAI_BASE_URL at the printed URL + /v1.",
    )
    p.add_argument("config", nargs="?", help="experiment YAML (with an optional service: section)")
    p.add_argument("overrides", nargs="*", help="section.key=value (e.g. service.port=8000)")
    p.add_argument("--host", help="shortcut for service.host")
    p.add_argument("--port", type=int, help="shortcut for service.port")
    args = p.parse_intermixed_args(argv)
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).is_file():
        overrides.insert(0, config)
        config = None
    if args.host:
        overrides.append(f"service.host={args.host}")
    if args.port is not None:
        overrides.append(f"service.port={args.port}")
    return config, overrides


def main(argv: list[str] | None = None) -> int:
    config, overrides = parse_command_line(argv)
    try:
        cfg, service = load_service_config(config, overrides)
    except ConfigError as e:
        print(f"areal-env serve-training: {e}", file=sys.stderr)
        return 2
    quiet_http_logs()
    return asyncio.run(serve_training(cfg, service))


def quiet_http_logs() -> None:
    """httpx logs every request at INFO (health probes every few seconds per proxy): WARNING."""
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


if __name__ == "__main__":
    sys.exit(main())
