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

A checkpoint of a multi-agent run keeps each policy under ``policies/<name>/model``: a peft
adapter folder for an adapter policy (on the base model its trainer state names), an HF folder
for a model of its own. :meth:`PolicyEngines.from_checkpoint` serves exactly that
(``areal-env serve --checkpoint``, ``areal-env eval --checkpoint``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_env.api.config import ExperimentConfig, ModelConfig, PolicyConfig
from areal_env.api.engine import InferenceEngine
from areal_env.engine.adapters import AdapterEngine, AdapterHost, zero_adapter
from areal_env.engine.factory import create_engine
from areal_env.engine.local import LocalEngine
from areal_env.engine.models import resolve_model_path
from areal_env.engine.sglang import SGLangEngine

logger = logging.getLogger(__name__)

POLICIES_DIR = "policies"
"""Where a checkpoint keeps each policy: ``step_N/policies/<name>/{state,model}``."""


@dataclass(frozen=True)
class SavedPolicy:
    """A policy as a checkpoint holds it (``trainer_state.json``: ``policies``)."""

    name: str
    adapter: bool
    """A peft adapter folder on the base model (else a model of its own)."""
    folder: Path
    """Its servable weights: the adapter folder or the HF model folder."""


def saved_policies(step_dir: str | Path) -> dict[str, SavedPolicy]:
    """The policies a checkpoint ``step_N`` holds (empty for a run without policies)."""
    step = Path(step_dir)
    state_file = step / "trainer_state.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    return {
        name: SavedPolicy(
            name,
            rec.get("kind") == "adapter",
            step / rec.get("folder", f"{POLICIES_DIR}/{name}") / "model",
        )
        for name, rec in (state.get("policies") or {}).items()
    }


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
        base_weights: bool = False,
    ) -> None:
        self.config = config
        self.base = base
        self.own = own
        self.own_base = own_base
        self.routes: dict[str, InferenceEngine] = {}
        for name, policy in config.policies.items():
            if not policy.is_adapter:
                self.routes[name] = own[name]
            elif base_weights:  # the untrained policies: the base model itself answers
                self.routes[name] = base
            else:
                self.routes[name] = AdapterEngine(self._host(), name)
        self._adapter_folders: dict[str, Path] = {}
        self._tokenizers: dict[str, Any] = {}

    @classmethod
    def from_config(
        cls,
        config: ExperimentConfig,
        base: InferenceEngine | None = None,
        *,
        base_weights: bool = False,
    ) -> PolicyEngines:
        """The engines of ``config.policies`` (not initialized): ``base`` (made from the config
        unless given) and one per policy with a model of its own. ``base_weights``: adapter
        policies are answered by the base model itself (their untrained state; e.g. evaluating
        the base model) instead of by adapters pushed to it."""
        own_base = base is None
        if base is None:
            base = create_engine(_with_model(config, config.model.path))
        own = {
            name: create_engine(_policy_config(config, name, i))
            for i, (name, policy) in enumerate(config.policies.items())
            if not policy.is_adapter
        }
        return cls(config, base, own, own_base=own_base, base_weights=base_weights)

    @classmethod
    def from_checkpoint(cls, config: ExperimentConfig, step_dir: str | Path) -> PolicyEngines:
        """The engines serving checkpoint ``step_dir``'s policies as they were trained (not
        initialized; :meth:`initialize` loads the adapters). ``config`` gives the base model and
        the engine settings; its ``policies:`` are replaced by the checkpoint's."""
        saved = saved_policies(step_dir)
        if not saved:
            raise FileNotFoundError(f"checkpoint {str(step_dir)!r} holds no policies")
        policies = {
            name: PolicyConfig() if p.adapter else PolicyConfig(model=str(p.folder))
            for name, p in saved.items()
        }
        engines = cls.from_config(dataclasses.replace(config, policies=policies))
        engines._adapter_folders = {n: p.folder for n, p in saved.items() if p.adapter}
        return engines

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
        for name, folder in self._adapter_folders.items():  # a checkpoint's adapters
            self._host().load_adapter(name, folder)

    def load_untrained_adapters(self) -> None:
        """Serve every adapter policy with an adapter that changes nothing (the state a new
        LoRA adapter starts in), so requests naming it are answered before the trainer pushes
        the first trained one (the any-agent service opens its gateway first). The embedded
        engine only: SGLang servers get each adapter with the trainer's first push."""
        if not isinstance(self.base, LocalEngine):
            logger.info("adapter policies are served once the trainer pushes their adapters")
            return
        for name in self.adapter_names:
            lora = self.config.policy_actor(name).lora
            assert lora is not None
            weights = zero_adapter(self.base.model, lora.r, lora.alpha, list(lora.target_modules))
            self.base.load_adapter(name, weights)

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


def checkpoint_config(config: ExperimentConfig, base_model: str) -> ExperimentConfig:
    """``config`` with the base model a checkpoint was trained on."""
    return dataclasses.replace(config, model=dataclasses.replace(config.model, path=base_model))


def default_config(base_model: str) -> ExperimentConfig:
    """A config for serving a checkpoint on the embedded engine (``areal-env serve``)."""
    return ExperimentConfig(model=ModelConfig(path=base_model))


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
