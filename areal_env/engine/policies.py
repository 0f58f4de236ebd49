"""``PolicyEngines``: the engines that serve a multi-agent run's policies (``policies:``).

Every LoRA policy is a named adapter of the base model's engine (``engine.adapters``): one set
of base weights, every policy's rows decoded in the same batches. A policy with a model of its
own gets an engine of its own, of the same backend (an embedded engine, servers launched for
it, or ``policies.<name>.addresses``). ``routes`` maps each policy name to the engine that
answers it (an :class:`~areal_env.engine.adapters.AdapterEngine` or its own engine): that is
what the proxy routes requests to and what each policy's weights are pushed to.

All engines of a run share one weight-version clock: the trainer moves every engine to the same
version once per step (while they are paused, so the step's new weights appear at once), so a
token's version says which step's weights made it, whatever policy made it.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from areal_env.api.config import ExperimentConfig
from areal_env.api.engine import InferenceEngine
from areal_env.engine.adapters import AdapterEngine, AdapterHost
from areal_env.engine.factory import create_engine
from areal_env.engine.models import resolve_model_path
from areal_env.engine.sglang import SGLangEngine

logger = logging.getLogger(__name__)


class PolicyEngines:
    """The base engine (host of the adapter policies) and one engine per full-model policy.

    ``own_base``: the base engine was made here (and is destroyed by :meth:`destroy`); the
    engines of full-model policies always are.
    """

    def __init__(
        self,
        config: ExperimentConfig,
        base: InferenceEngine,
        own: dict[str, InferenceEngine],
        *,
        own_base: bool,
    ) -> None:
        self.config = config
        self.base = base
        self.own = own
        self.own_base = own_base
        self.routes: dict[str, InferenceEngine] = {}
        for name, policy in config.policies.items():
            if policy.is_adapter:
                self.routes[name] = AdapterEngine(self._host(), name)
            else:
                self.routes[name] = own[name]
        self._tokenizers: dict[str, Any] = {}

    @classmethod
    def from_config(
        cls, config: ExperimentConfig, base: InferenceEngine | None = None
    ) -> PolicyEngines:
        """The engines of ``config.policies`` (not initialized): ``base`` (made from the config
        unless given) and one per policy with a model of its own."""
        own_base = base is None
        if base is None:
            base = create_engine(_with_model(config, config.model.path))
        own = {
            name: create_engine(_policy_config(config, name, i))
            for i, (name, policy) in enumerate(config.policies.items())
            if not policy.is_adapter
        }
        return cls(config, base, own, own_base=own_base)

    def _host(self) -> AdapterHost:
        """The base engine as the host of the adapter policies."""
        return self.base  # type: ignore[return-value]

    @property
    def engines(self) -> list[InferenceEngine]:
        """Every distinct engine (the base first)."""
        return [self.base, *self.own.values()]

    @property
    def adapter_names(self) -> list[str]:
        return [n for n, p in self.config.policies.items() if p.is_adapter]

    def initialize(self) -> None:
        """Start the engines made here; with adapter policies on SGLang servers, check that
        they serve LoRA adapters (an ``AdapterError`` before anything is trained)."""
        if self.own_base:
            self.base.initialize()
        for engine in self.own.values():
            engine.initialize()
        if self.adapter_names and isinstance(self.base, SGLangEngine):
            self.base.check_lora_serving()

    def tokenizer(self, name: str) -> Any:
        """The tokenizer policy ``name``'s prompts are rendered with."""
        tok = self._tokenizers.get(name)
        if tok is None:
            engine = self.routes[name]
            tok = engine.tokenizer
            if tok is None:  # engines behind HTTP tokenize on their servers
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(str(self.model_path(name)))
            self._tokenizers[name] = tok
        return tok

    def model_path(self, name: str) -> str:
        """The HF folder of the model policy ``name`` runs on (the base model for adapters)."""
        policy = self.config.policies[name]
        path = policy.model if policy.model is not None else self.config.model.path
        return str(resolve_model_path(path, self.config.model.cache_dir))

    # -- the shared clock and the pause around a step's pushes --------------------------------

    def set_version(self, version: int) -> None:
        for engine in self.engines:
            engine.set_version(version)

    def pause(self) -> None:
        for engine in self.engines:
            engine.pause()

    def resume(self) -> None:
        for engine in self.engines:
            engine.resume()

    def destroy(self) -> None:
        """Stop the engines made here (a passed-in base engine stays with its owner)."""
        for name, engine in self.own.items():
            try:
                engine.destroy()
            except Exception as e:  # noqa: BLE001 - stopping the others matters more
                logger.warning("destroying policy %s's engine failed: %s", name, e)
        if self.own_base:
            self.base.destroy()


def _with_model(config: ExperimentConfig, path: str) -> ExperimentConfig:
    """``config`` for an engine of the model at ``path`` (resolved to its HF folder)."""
    resolved = str(resolve_model_path(path, config.model.cache_dir))
    return dataclasses.replace(config, model=dataclasses.replace(config.model, path=resolved))


def _policy_config(config: ExperimentConfig, name: str, index: int) -> ExperimentConfig:
    """The config of policy ``name``'s own engine: its model; with ``backend: remote`` its own
    addresses; launched SGLang servers above the base model's ports; no policies (no LoRA)."""
    policy = config.policies[name]
    assert policy.model is not None
    cfg = dataclasses.replace(_with_model(config, policy.model), policies={})
    engine = cfg.engine
    if engine.backend == "remote":
        engine = dataclasses.replace(engine, addresses=list(policy.addresses))
    elif engine.backend == "sglang":
        sg = engine.sglang
        sg = dataclasses.replace(
            sg,
            addresses=list(policy.addresses),
            base_port=sg.base_port + 100 * (index + 1),
            log_dir=str(config.run_dir / "logs" / "servers" / name),
        )
        engine = dataclasses.replace(engine, sglang=sg)
    return dataclasses.replace(cfg, engine=engine)
