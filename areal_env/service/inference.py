"""Serving a trained checkpoint through the same OpenAI/Anthropic-compatible API (inference only).

``serve_checkpoint("outputs/EXP/TRIAL")`` (or an HF model folder) loads the newest checkpoint
into an engine, puts one proxy on it and the service gateway in front, in *inference-only*
mode: a model call without a session runs in a throwaway session that is closed right after
the answer, so nothing accumulates and nothing is trained. The same agent code (``OPENAI_BASE_URL``
+ ``/v1``) that trained the model now uses it. Sessions (``AgentSession``) still work, which
keeps multi-turn token-exact prompts for agents that want them.

A checkpoint of a multi-agent run (``policies:``) is served with every policy under its name:
the request's ``model`` picks one (``/v1/models`` lists them, an unknown name is a 404), the
adapter policies on one engine of the base model, each model of its own on its own engine.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_env.api.service_config import ServiceConfig

if TYPE_CHECKING:
    from areal_env.engine.policies import PolicyEngines

logger = logging.getLogger(__name__)

SERVING = "areal-env serving {model} at {url}"


def resolve_checkpoint(target: str | Path) -> Path:
    """What to serve for ``target`` (a run dir: its newest checkpoint, a checkpoint ``step_N``
    folder, or an HF folder itself): the HF model folder, or for a multi-agent run the
    ``step_N`` folder that holds its policies."""
    from areal_env.engine.policies import saved_policies

    path = Path(target)
    if (path / "config.json").is_file():
        return path
    if (path / "model" / "config.json").is_file() or saved_policies(path):
        return path / "model" if (path / "model" / "config.json").is_file() else path
    ckpt_root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    from areal_env.trainer.checkpoint import MODEL_DIR, latest_checkpoint

    latest = latest_checkpoint(ckpt_root)
    if latest is not None and saved_policies(latest):
        return latest
    if latest is None or not (latest / MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"no trained checkpoint under {str(path)!r} (expected checkpoints/step_N/model)"
        )
    return latest / MODEL_DIR


def model_name_of(model_dir: Path) -> str:
    """``EXPERIMENT/TRIAL@step_N`` for a checkpoint folder, else the folder's name."""
    parts = model_dir.resolve().parts
    if len(parts) >= 5 and parts[-1] == "model" and parts[-3] == "checkpoints":
        return f"{parts[-5]}/{parts[-4]}@{parts[-2]}"
    if len(parts) >= 4 and parts[-2] == "checkpoints":  # a multi-agent run's step folder
        return f"{parts[-4]}/{parts[-3]}@{parts[-1]}"
    return model_dir.name


class InferenceService:
    """Engine + one proxy + an inference-only gateway; ``start()`` / ``stop()`` (``with`` works
    too)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        service: ServiceConfig | None = None,
        engine: Any = None,
        max_batch_size: int = 32,
        default_max_tokens: int = 512,
    ) -> None:
        """``engine``: serve on this (initialized) engine, left running at stop; by default
        one is made on ``model_dir`` and destroyed at stop."""
        self.model_dir = Path(model_dir)
        self.service = service or ServiceConfig()
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.default_max_tokens = default_max_tokens
        self.proxy: Any = None
        self.gateway: Any = None
        self.engines: PolicyEngines | None = None
        """A multi-agent checkpoint's engines (every policy's)."""
        self._started = ExitStack()
        """How to stop what started, run in reverse order by ``stop()``."""

    @property
    def base_url(self) -> str:
        return self.gateway.base_url

    def start(self) -> InferenceService:
        """Start engine, proxy and gateway; a failure half-way stops what did start (servers
        hold ports and threads) and raises."""
        with ExitStack() as started:
            self._start(started)
            self._started = started.pop_all()
        return self

    def stop(self) -> None:
        """Stop in the reverse order of the start: the gateway first, so no new request
        reaches a stopped proxy, then the proxy, then the engines this service made."""
        self._started.close()

    def __enter__(self) -> InferenceService:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _start(self, started: ExitStack) -> None:
        from areal_env.api.config import ProxyConfig
        from areal_env.engine.policies import saved_policies
        from areal_env.proxy.policies import PolicyEndpoint
        from areal_env.proxy.server import ProxyServer
        from areal_env.service.gateway import GatewayServer

        policies = None
        if saved_policies(self.model_dir):
            self.engines = _checkpoint_engines(self.model_dir, self.max_batch_size)
            started.callback(self._destroy_engines)
            self.engine = self.engines.base  # the set stops it
            policies = {
                name: PolicyEndpoint(engine, self.engines.tokenizer(name))
                for name, engine in self.engines.routes.items()
            }
        if self.engine is None:
            from areal_env.engine.local import LocalEngine

            self.engine = LocalEngine(str(self.model_dir), max_batch_size=self.max_batch_size)
            started.callback(self._destroy_engine)
            self.engine.initialize()
        pcfg = ProxyConfig(
            host="127.0.0.1",
            port=0,
            default_max_tokens=self.default_max_tokens,
            session_ttl=600.0,
        )
        self.proxy = ProxyServer(
            self.engine,
            self.engine.tokenizer,
            pcfg,
            model_name=model_name_of(self.model_dir),
            policies=policies,
        ).start()
        started.callback(self.proxy.stop)
        self.gateway = GatewayServer(
            self.service,
            backends=[(self.proxy.base_url, self.proxy.admin_key)],
            anonymous_sessions=True,
        )
        started.callback(self.gateway.stop)
        self.gateway.start()

    def _destroy_engines(self) -> None:
        assert self.engines is not None
        self.engines.destroy()
        self.engines = self.engine = None

    def _destroy_engine(self) -> None:
        self.engine.destroy()
        self.engine = None


def _checkpoint_engines(step_dir: Path, max_batch_size: int) -> PolicyEngines:
    """Every policy of a multi-agent checkpoint on the embedded engine: the base model it was
    trained on (its trainer state says which) with the adapters, and the models of their own."""
    import json

    from areal_env.api.config import EngineConfig, ExperimentConfig, ModelConfig
    from areal_env.engine.policies import PolicyEngines

    state = json.loads((step_dir / "trainer_state.json").read_text())
    base = state.get("base_model_path") or state["model_path"]
    cfg = ExperimentConfig(
        model=ModelConfig(path=str(base)), engine=EngineConfig(max_batch_size=max_batch_size)
    )
    engines = PolicyEngines.from_checkpoint(cfg, step_dir)
    try:
        engines.initialize()
    except BaseException:
        engines.destroy()
        raise
    return engines


def serve_checkpoint(
    target: str | Path | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    experiment: str | None = None,
    trial: str | None = None,
    fileroot: str = "./outputs",
    api_keys: list[str] | None = None,
    key_file: str | None = None,
    ssl_keyfile: str | None = None,
    ssl_certfile: str | None = None,
    block: bool = True,
) -> InferenceService:
    """Serve the newest checkpoint of ``target`` (or ``fileroot/experiment/trial``).

    With ``block=False`` the running service is returned (call ``stop()``); otherwise this
    serves until interrupted.
    """
    if target is None:
        if not (experiment and trial):
            raise ValueError("give a run folder / model folder, or both experiment and trial")
        target = Path(fileroot) / experiment / trial
    model_dir = resolve_checkpoint(target)
    service = ServiceConfig(
        host=host,
        port=port,
        api_keys=list(api_keys or []),
        key_file=key_file,
        ssl_keyfile=ssl_keyfile,
        ssl_certfile=ssl_certfile,
    )
    service.validate()
    svc = InferenceService(model_dir, service=service).start()
    print(SERVING.format(model=model_dir, url=svc.base_url), flush=True)
    if not block:
        return svc
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    try:
        done.wait()
    finally:
        svc.stop()
    return svc


def main(argv: list[str] | None = None) -> int:
    """``areal-env serve --experiment NAME --trial TRIAL`` (or ``--checkpoint PATH``)."""
    p = argparse.ArgumentParser(
        prog="areal-env serve",
        description="Serve a trained checkpoint through the OpenAI/Anthropic-compatible API "
        "(inference only). Point OPENAI_BASE_URL at the printed URL + /v1.",
    )
    p.add_argument("--experiment", help="experiment name (with --trial)")
    p.add_argument("--trial", help="trial name")
    p.add_argument("--fileroot", default="./outputs", help="where runs live (default ./outputs)")
    p.add_argument(
        "--checkpoint",
        dest="target",
        metavar="DIR",
        help="a run folder, a step_N folder or an HF model folder",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        dest="api_keys",
        metavar="KEY",
        action="append",
        default=[],
        help="accepted user key (repeat)",
    )
    p.add_argument("--key-file", help="file with one user key per line")
    p.add_argument("--ssl-keyfile")
    p.add_argument("--ssl-certfile")
    args = p.parse_args(argv)
    try:
        serve_checkpoint(**vars(args))  # every option is one of its parameters, same name
    except (ValueError, FileNotFoundError) as e:
        print(f"areal-env serve: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
