"""``WeightPusher``: the trainer's new weights onto every inference server, once per update.

Weights go to the engine as an in-process state dict, as one HF folder (or, with LoRA, only the
adapter) under ``run_dir/weights/v{N}`` for engines that load from disk, or over NCCL to
SGLang. Gathering is collective under FSDP: every rank runs :meth:`gather`, rank 0 announces it
first, gets (or writes) the weights and hands them on.

A LoRA policy of a multi-agent run (``adapter=True``) pushes its adapter alone, never merged
weights: its engine serves it by name next to the other policies' adapters (in memory to the
embedded engine, as an adapter folder under ``run_dir/weights/<policy>/v{N}`` to servers).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from areal_env.api.config import ExperimentConfig
from areal_env.api.engine import InferenceEngine
from areal_env.engine.adapters import AdapterWeights
from areal_env.trainer.actor import PPOActor
from areal_env.trainer.ranks import RankChannel


class WeightPusher:
    """Pushes ``actor``'s weights to ``engine`` (rank 0) and runs the gathering half elsewhere.

    ``policy``: the policy's name in a multi-agent run (its weights folder, and the name the
    other ranks are told); ``adapter``: it is a LoRA adapter served by name (push it alone).
    """

    def __init__(
        self,
        config: ExperimentConfig,
        actor: PPOActor,
        ranks: RankChannel,
        *,
        engine: InferenceEngine | None = None,
        tokenizer: Any = None,
        policy: str | None = None,
        adapter: bool = False,
    ) -> None:
        self.config = config
        self.actor = actor
        self.ranks = ranks
        self.engine = engine
        self.tokenizer = tokenizer
        self.policy = policy
        self.adapter = adapter
        self.weights_root = Path(config.run_dir) / "weights"
        if policy is not None:
            self.weights_root = self.weights_root / policy
        self.last_push_bytes = 0
        """Bytes the last push moved: written through a folder, or the adapter tensors handed
        over in memory (0 for a full in-process state dict)."""
        self._nccl_sync: Any = None  # NcclWeightSync, made on the first NCCL push

    def push(self, new_version: int) -> None:
        """Gather the weights once and load them on every inference server (rank 0).

        In-process engines take the state dict; server engines load one HF folder written once
        under ``run_dir/weights/v{N}`` (with LoRA only the adapter when the engine takes
        adapters). A server that fails to load is reported by address and the step fails."""
        engine = self.engine
        if engine is None:
            raise RuntimeError("only rank 0 pushes weights (it holds the engine)")
        if self.adapter:
            self._push_adapter(engine, new_version)
            return
        lora = self.actor.cfg.lora is not None and engine.supports_lora
        in_process = engine.supports_state_dict_update
        what = "full" if in_process else ("adapter" if lora else "hf")
        sg = self.config.engine.sglang
        if not in_process and self.config.engine.backend == "sglang" and sg.weight_sync == "nccl":
            self._announce("full")  # the others only gather
            self._push_nccl(self.gather("full"), new_version)
            return
        self._announce(what)
        if in_process:
            engine.update_weights(self.gather(what))
        else:
            folder = self.weights_root / f"v{new_version}"
            if folder.exists():
                shutil.rmtree(folder)
            self.last_push_bytes = self.gather(what, folder)
            if not lora:
                self.tokenizer.save_pretrained(str(folder))
            engine.update_weights(str(folder))
            for old in self.weights_root.glob("v*"):
                if old != folder:
                    shutil.rmtree(old, ignore_errors=True)
        engine.set_version(new_version)

    def _push_adapter(self, engine: InferenceEngine, new_version: int) -> None:
        """The policy's adapter alone: in memory to an engine that takes tensors, else as a
        peft adapter folder under ``weights_root/v{N}``."""
        if engine.supports_state_dict_update:
            self._announce("adapter_tensors")
            weights = AdapterWeights(self.gather("adapter_tensors"), self.actor.adapter_config())
            self.last_push_bytes = weights.nbytes
            engine.update_weights(weights)  # type: ignore[arg-type]
        else:
            self._announce("adapter")
            folder = self.weights_root / f"v{new_version}"
            if folder.exists():
                shutil.rmtree(folder)
            self.last_push_bytes = self.gather("adapter", folder)
            engine.update_weights(str(folder))
            for old in self.weights_root.glob("v*"):
                if old != folder:
                    shutil.rmtree(old, ignore_errors=True)
        engine.set_version(new_version)

    def _announce(self, what: str) -> None:
        """Tell the other ranks which collective comes (and, with policies, whose)."""
        cmd: dict[str, Any] = {"op": "push", "what": what}
        if self.policy is not None:
            cmd["policy"] = self.policy
        self.ranks.announce(cmd)

    def gather(self, what: str, folder: Path | None = None) -> Any:
        """The collective half of a push: every rank runs it; rank 0 gets the weights (``full``,
        ``adapter_tensors``) or writes them (``adapter``, ``hf``), the other ranks nothing."""
        if what == "full":
            return self.actor.state_dict_for_engine()
        if what == "adapter_tensors":
            return self.actor.adapter_state_dict()
        target = folder or self.weights_root / "unused"
        if what == "adapter":
            return self.actor.save_adapter(target)
        return self.actor.export_hf(target)

    def _push_nccl(self, weights: dict[str, Any], new_version: int) -> None:
        """SGLang's tensor path (``engine.sglang.weight_sync: nccl``; GPU only, unverified here)."""
        from areal_env.engine.sglang_nccl import NcclWeightSync

        engine = self.engine
        assert engine is not None
        if self._nccl_sync is None:
            import socket

            sg = self.config.engine.sglang
            self._nccl_sync = NcclWeightSync(
                engine,
                master_address=socket.gethostbyname(socket.gethostname()),
                master_port=sg.weight_sync_port,
                tp_size=sg.tp_size,
            )
        device = self.actor.device
        engine.pause()
        try:
            self._nccl_sync.push(((k, v.to(device)) for k, v in weights.items()), new_version)
        finally:
            engine.resume()
        engine.set_version(new_version)
