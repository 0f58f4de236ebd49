"""``TrainerPush``: joining the ranks, the update on every rank, and the weight push.

Weights go to the engine as an in-process state dict, as one HF folder (or LoRA adapter)
under ``run_dir/weights/v{N}`` for engines that load from disk, or over NCCL to SGLang.
Every rank runs the gathering half; rank 0 announces each collective first (``_command``).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from areal_env.trainer.dist import SINGLE
from areal_env.trainer.ppo_state import TrainerState


class TrainerPush(TrainerState):
    """Process group, the all-ranks update and the push of new weights to the engine."""

    def _join_process_group(self) -> None:
        """Under torchrun with ``actor.strategy: fsdp``: join the ranks' process group."""
        from areal_env.trainer.dist import init_distributed

        self.dist = SINGLE
        if self.config.actor.strategy == "fsdp":
            self.dist = init_distributed(self.config.model.device)
            if self.dist.distributed and self.external:
                raise ValueError(
                    "an external batch source runs in one process: use actor.strategy single, "
                    "or run the service's trainer under torchrun without an external executor"
                )

    def _update_all_ranks(self, batch: dict[str, Any]) -> dict[str, float]:
        """The PPO update; every rank gets the batch and trains on its token-balanced share."""
        self._command({"op": "update", "batch": batch, "step": self.step})
        return self._actor.update(batch, step=self.step)

    def _push_weights(self, new_version: int) -> None:
        """Gather the weights once and load them on every inference server.

        In-process engines take the state dict; server engines load one HF folder written once
        under ``run_dir/weights/v{N}`` (with LoRA only the adapter when the engine takes
        adapters). A server that fails to load is reported by address and the step fails."""
        engine = self._engine
        lora = self.config.actor.lora is not None and engine.supports_lora
        in_process = engine.supports_state_dict_update
        what = "full" if in_process else ("adapter" if lora else "hf")
        sg = self.config.engine.sglang
        if not in_process and self.config.engine.backend == "sglang" and sg.weight_sync == "nccl":
            self._command({"op": "push", "what": "full"})  # the others only gather
            self._push_nccl(self._gather_for_push("full"), new_version)
            return
        self._command({"op": "push", "what": what})
        if in_process:
            engine.update_weights(self._gather_for_push(what))
        else:
            folder = self.run_dir / "weights" / f"v{new_version}"
            if folder.exists():
                shutil.rmtree(folder)
            self.last_push_bytes = self._gather_for_push(what, folder)
            if not lora:
                self.tokenizer.save_pretrained(str(folder))
            engine.update_weights(str(folder))
            for old in (self.run_dir / "weights").glob("v*"):
                if old != folder:
                    shutil.rmtree(old, ignore_errors=True)
        engine.set_version(new_version)

    def _push_nccl(self, weights: dict[str, Any], new_version: int) -> None:
        """SGLang's tensor path (``engine.sglang.weight_sync: nccl``; GPU only, unverified here)."""
        from areal_env.engine.sglang_nccl import NcclWeightSync

        sync = self._nccl_sync
        if sync is None:
            import socket

            sg = self.config.engine.sglang
            sync = self._nccl_sync = NcclWeightSync(
                self._engine,
                master_address=socket.gethostbyname(socket.gethostname()),
                master_port=sg.weight_sync_port,
                tp_size=sg.tp_size,
            )
        device = self._actor.device
        self._engine.pause()
        try:
            sync.push(((k, v.to(device)) for k, v in weights.items()), new_version)
        finally:
            self._engine.resume()
        self._engine.set_version(new_version)

    def _gather_for_push(self, what: str, folder: Path | None = None) -> Any:
        """The collective half of a push: every rank runs it, rank 0 gets (or writes) the
        weights; the other ranks write nothing."""
        if what == "full":
            return self._actor.state_dict_for_engine()
        target = folder or self.run_dir / "weights" / "unused"
        if what == "adapter":
            return self._actor.save_adapter(target)
        return self._actor.export_hf(target)
