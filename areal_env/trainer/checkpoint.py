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

A run with several policies (``policies:``) saves one :class:`CheckpointPart` per policy, each
with its own ``state/`` and servable ``model/`` under ``policies/<name>/``, in the same atomic
step folder: a LoRA policy saves its adapter alone (its ``model/`` is a peft adapter folder on
the base model the trainer state names), a policy with a model of its own the whole model.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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


@dataclass
class CheckpointPart:
    """One trained model of a checkpoint: its weights and optimiser state in ``folder/state``,
    its servable form in ``folder/model`` (``folder`` ``""``: the step folder itself)."""

    folder: str
    model: Any
    optimizer: torch.optim.Optimizer | None
    export: Callable[[Path], Any] | None = None
    """Writes the servable folder (collective under FSDP); default ``model.save_pretrained``."""
    tokenizer: Any = None
    """Saved next to the servable weights."""
    trainable_only: bool = False
    """Save and restore only the parameters that require grad (a LoRA policy's adapter: the
    base weights it shares with other policies are the run's base model)."""
    activate: Callable[[], None] | None = None
    """Called before the part's state is read or written (a shared model's adapter choice)."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, I/O error); the previous one is intact and
    still the latest. Raised for every failure of the write (safetensors reports a full disk as
    its own ``SafetensorError``, not an ``OSError``), so callers catch one type."""


def save_checkpoint(
    ckpt_root: str | os.PathLike[str],
    step: int,
    *,
    model: Any = None,
    tokenizer: Any | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    trainer_state: dict[str, Any],
    keep_last: int | None = None,
    export_hf: Callable[[Path], Any] | None = None,
    parts: Sequence[CheckpointPart] = (),
) -> Path:
    """Write ``ckpt_root/step_{step}`` atomically and point ``latest`` at it.

    ``model`` (with ``optimizer``, ``tokenizer``): the run's one model, in the step folder's
    own ``state/`` and ``model/``; ``parts``: more models, each in a folder of its own (a
    multi-agent run's policies). ``export_hf(folder)``: writes ``model``'s servable HF folder
    (collective under FSDP: it gathers the full weights); default ``model.save_pretrained``.

    Any failure raises :class:`CheckpointWriteError` and leaves the previous checkpoint the
    latest (the temporary folder is removed, so a full disk gets its space back).
    """
    # torch.distributed.checkpoint reports a failed write as CheckpointException, a
    # BaseException (not an Exception): catch it too, but never KeyboardInterrupt/SystemExit
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        main = [] if model is None else [CheckpointPart("", model, optimizer, export_hf, tokenizer)]
        return _save_checkpoint(
            Path(ckpt_root),
            step,
            parts=[*main, *parts],
            trainer_state=trainer_state,
            keep_last=keep_last,
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
    parts: Sequence[CheckpointPart],
    trainer_state: dict[str, Any],
    keep_last: int | None,
) -> Path:

    from areal_env.trainer.dist import barrier, broadcast_object, current_context

    ctx = current_context()
    final = root / f"step_{step}"
    tmp_name = None
    if ctx.is_main:
        root.mkdir(parents=True, exist_ok=True)
        tmp_name = tempfile.mkdtemp(prefix=f".step_{step}.", dir=root)
    tmp = Path(broadcast_object(tmp_name, ctx))
    try:
        for part in parts:
            _save_part(tmp / part.folder, part, ctx.is_main)
        if ctx.is_main:
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


def _save_part(folder: Path, part: CheckpointPart, is_main: bool) -> None:
    import torch.distributed.checkpoint as dcp

    if part.activate is not None:
        part.activate()
    msd, osd = _state_dicts(part.model, part.optimizer, part.trainable_only)
    dcp.save(
        {"model": msd, "optim": osd}, checkpoint_id=str(folder / STATE_DIR), no_dist=_no_dist()
    )
    if part.export is not None:
        part.export(folder / MODEL_DIR)
    elif is_main:
        part.model.save_pretrained(str(folder / MODEL_DIR), safe_serialization=True)
    if is_main and part.tokenizer is not None:
        part.tokenizer.save_pretrained(str(folder / MODEL_DIR))


def _no_dist() -> bool:
    """No process group: save/load in this process alone (what DCP would assume anyway)."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


def _state_dicts(
    model: Any, optimizer: torch.optim.Optimizer | None, trainable_only: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Model and optimiser state keyed by parameter names (sharded DTensors under FSDP, plain
    tensors otherwise): the form ``torch.distributed.checkpoint`` reshards between world sizes.
    ``trainable_only``: the parameters that require grad alone."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
    )

    options = StateDictOptions(ignore_frozen_params=trainable_only)
    if optimizer is None:
        return get_model_state_dict(model, options=options), {}
    return get_state_dict(model, optimizer, options=options)


def _prune(root: Path, keep: int, current: str) -> None:
    steps = sorted(
        (p for p in root.glob("step_*") if p.is_dir()), key=lambda p: int(p.name.split("_")[1])
    )
    for p in steps[:-keep]:
        if p.name != current:
            shutil.rmtree(p, ignore_errors=True)


def _restore_part(ckpt: Path, part: CheckpointPart) -> None:
    state_dir = ckpt / part.folder / STATE_DIR
    if not state_dir.is_dir():
        raise RuntimeError(
            f"checkpoint {ckpt} has no {part.folder + '/' if part.folder else ''}{STATE_DIR}/ "
            "folder (written by an areal-env before 0.1.0, by a run with other policies, or "
            "half-deleted): start the run in a new trial_name, or remove that step folder"
        )
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_state_dict,
    )

    if part.activate is not None:
        part.activate()
    model, optimizer = part.model, part.optimizer
    msd, osd = _state_dicts(model, optimizer, part.trainable_only)
    bundle = {"model": msd, "optim": osd} if optimizer is not None else {"model": msd}
    dcp.load(bundle, checkpoint_id=str(state_dir), no_dist=_no_dist())
    # only the parameters that were saved: a shared model's other adapters stay as they are
    options = StateDictOptions(
        ignore_frozen_params=part.trainable_only, strict=not part.trainable_only
    )
    if optimizer is not None:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=bundle["model"],
            optim_state_dict=bundle["optim"],
            options=options,
        )
    else:
        set_model_state_dict(model, bundle["model"], options=options)


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
    ckpt: Path,
    *,
    model: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    parts: Sequence[CheckpointPart] = (),
) -> dict[str, Any]:
    """Load weights, optimiser and RNG states in place; return the trainer state.

    ``model``/``optimizer``: the step folder's own ``state/``; ``parts``: each from its folder.
    Collective under FSDP (every rank calls it). A ``state/`` folder written at any world size
    loads at any other.
    """
    main = [] if model is None else [CheckpointPart("", model, optimizer)]
    for part in [*main, *parts]:
        _restore_part(ckpt, part)
    if (ckpt / RNG_FILE).is_file():
        set_rng_state(torch.load(ckpt / RNG_FILE, weights_only=False))
    return load_trainer_state(ckpt)
