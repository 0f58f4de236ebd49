"""Checkpoints: ``run_dir/checkpoints/step_{N}/`` holds the model and optimiser state as a
``torch.distributed.checkpoint`` folder (``state/``: sharded, one file per rank), an HF model
folder for serving (``model/``; with LoRA also ``model/adapter/``) and the trainer state (step,
epoch, data position, RNG states, version).

``state/`` is resharded on load, so a run saved by 2 FSDP ranks resumes on 1 process (FSDP or
``strategy: single``) and the other way round. Under FSDP every rank calls ``save_checkpoint`` /
``restore_checkpoint`` (they are collective); rank 0 writes the shared files. On several nodes
``run_dir`` must be on a filesystem every node sees.

Written atomically — into a temporary folder renamed into place, then the ``latest`` pointer file
replaced — so a run killed mid-save leaves the previous checkpoint intact and never a half one.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

LATEST = "latest"
STATE_FILE = "trainer_state.json"
RNG_FILE = "rng_state.pt"
MODEL_DIR = "model"
STATE_DIR = "state"


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, I/O error); the previous one is intact and
    still the latest. Raised for every failure of the write (safetensors reports a full disk as
    its own ``SafetensorError``, not an ``OSError``), so callers catch one type."""


def save_checkpoint(
    ckpt_root: str | os.PathLike[str],
    step: int,
    *,
    model: Any,
    tokenizer: Any | None,
    optimizer: torch.optim.Optimizer | None,
    trainer_state: dict[str, Any],
    keep_last: int | None = None,
    export_hf: Callable[[Path], Any] | None = None,
) -> Path:
    """Write ``ckpt_root/step_{step}`` atomically and point ``latest`` at it.

    ``export_hf(folder)``: writes the servable HF folder (collective under FSDP: it gathers the
    full weights); default ``model.save_pretrained``.

    Any failure raises :class:`CheckpointWriteError` and leaves the previous checkpoint the
    latest (the temporary folder is removed, so a full disk gets its space back).
    """
    # torch.distributed.checkpoint reports a failed write as CheckpointException, a
    # BaseException (not an Exception): catch it too, but never KeyboardInterrupt/SystemExit
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return _save_checkpoint(
            Path(ckpt_root),
            step,
            model=model,
            tokenizer=tokenizer,
            optimizer=optimizer,
            trainer_state=trainer_state,
            keep_last=keep_last,
            export_hf=export_hf,
        )
    except CheckpointWriteError:
        raise
    except (Exception, CheckpointException) as e:
        raise CheckpointWriteError(
            getattr(e, "errno", None) or 0,
            f"checkpoint step_{step} in {ckpt_root} could not be written "
            f"({type(e).__name__}: {e}); the previous checkpoint stays the latest",
        ) from e


def _save_checkpoint(
    root: Path,
    step: int,
    *,
    model: Any,
    tokenizer: Any | None,
    optimizer: torch.optim.Optimizer | None,
    trainer_state: dict[str, Any],
    keep_last: int | None,
    export_hf: Callable[[Path], Any] | None,
) -> Path:
    import torch.distributed.checkpoint as dcp

    from areal_env.trainer.dist import barrier, broadcast_object, current_context

    ctx = current_context()
    final = root / f"step_{step}"
    tmp_name = None
    if ctx.is_main:
        root.mkdir(parents=True, exist_ok=True)
        tmp_name = tempfile.mkdtemp(prefix=f".step_{step}.", dir=root)
    tmp = Path(broadcast_object(tmp_name, ctx))
    try:
        msd, osd = _state_dicts(model, optimizer)
        dcp.save(
            {"model": msd, "optim": osd}, checkpoint_id=str(tmp / STATE_DIR), no_dist=_no_dist()
        )
        if export_hf is not None:
            export_hf(tmp / MODEL_DIR)
        elif ctx.is_main:
            model.save_pretrained(str(tmp / MODEL_DIR), safe_serialization=True)
        if ctx.is_main:
            if tokenizer is not None:
                tokenizer.save_pretrained(str(tmp / MODEL_DIR))
            torch.save(rng_state(), tmp / RNG_FILE)
            state = {**trainer_state, "step": step, "world_size": ctx.world_size}
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=2))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        barrier(ctx)
    finally:
        if ctx.is_main and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if ctx.is_main:
        pointer_tmp = root / f".{LATEST}.tmp"
        try:
            pointer_tmp.write_text(final.name + "\n")
            os.replace(pointer_tmp, root / LATEST)
        except BaseException:
            pointer_tmp.unlink(missing_ok=True)
            raise
        logger.info("checkpoint saved: %s (%d rank(s))", final, ctx.world_size)
        if keep_last:
            _prune(root, keep_last, final.name)
    barrier(ctx)
    return final


def _no_dist() -> bool:
    """No process group: save/load in this process alone (what DCP would assume anyway)."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


def _state_dicts(
    model: Any, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Model and optimiser state keyed by parameter names (sharded DTensors under FSDP, plain
    tensors otherwise): the form ``torch.distributed.checkpoint`` reshards between world sizes."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return get_model_state_dict(model), {}
    return get_state_dict(model, optimizer)


def _prune(root: Path, keep: int, current: str) -> None:
    steps = sorted(
        (p for p in root.glob("step_*") if p.is_dir()), key=lambda p: int(p.name.split("_")[1])
    )
    for p in steps[:-keep]:
        if p.name != current:
            shutil.rmtree(p, ignore_errors=True)


def latest_checkpoint(ckpt_root: str | os.PathLike[str]) -> Path | None:
    """The folder ``latest`` points at, if it is complete; else the newest complete step_N."""
    root = Path(ckpt_root)
    pointer = root / LATEST
    if pointer.is_file():
        cand = root / pointer.read_text().strip()
        if (cand / STATE_FILE).is_file():
            return cand
    complete = [p for p in root.glob("step_*") if (p / STATE_FILE).is_file()]
    if not complete:
        return None
    return max(complete, key=lambda p: int(p.name.split("_")[1]))


def load_trainer_state(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / STATE_FILE).read_text())


def restore_checkpoint(
    ckpt: Path, *, model: Any, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    """Load weights, optimiser and RNG states in place; return the trainer state.

    Collective under FSDP (every rank calls it). A ``state/`` folder written at any world size
    loads at any other.
    """
    if not (ckpt / STATE_DIR).is_dir():
        raise RuntimeError(
            f"checkpoint {ckpt} has no {STATE_DIR}/ folder (written by an areal-env before 0.1.0, or "
            "half-deleted): start the run in a new trial_name, or remove that step folder"
        )
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    msd, osd = _state_dicts(model, optimizer)
    bundle = {"model": msd, "optim": osd} if optimizer is not None else {"model": msd}
    dcp.load(bundle, checkpoint_id=str(ckpt / STATE_DIR), no_dist=_no_dist())
    if optimizer is not None:
        set_state_dict(
            model, optimizer, model_state_dict=bundle["model"], optim_state_dict=bundle["optim"]
        )
    else:
        set_model_state_dict(model, bundle["model"])
    if (ckpt / RNG_FILE).is_file():
        set_rng_state(torch.load(ckpt / RNG_FILE, weights_only=False))
    return load_trainer_state(ckpt)
