"""Data-parallel training over ``torch.distributed``: FSDP2 sharding and rank-balanced rows.

One code path for CPU (gloo) and GPU (NCCL): ``init_distributed`` reads torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``), picks NCCL when the
device is a GPU and gloo otherwise. ``shard_model`` applies FSDP2 ``fully_shard`` to every
decoder layer and then to the root (so the embedding / LM head / final norm are one unit),
with parameters gathered in the compute dtype and gradients reduced in fp32 (mixed precision)
and optional CPU offload.

Why every rank sees the whole batch: group-normalised advantages need every row of a group, and
a batch of token ids is tiny next to the model. Rank 0 (the only rank that rolls out)
broadcasts the batch; each rank then takes its own rows with ``split_rows`` — a deterministic
longest-first split balanced by token count that every rank computes identically, so no rank
has to be told which rows the others took. The loss of a minibatch is normalised by the
minibatch's *global* token count, and FSDP averages gradients over ranks, so the loss is
multiplied by the world size: the summed gradient then equals the single-process gradient.

FSDP's collectives run once per forward/backward of each sharded layer, so every rank must run
the same number of micro-batches: a rank with fewer rows runs padding micro-batches whose loss
is multiplied by 0 (``padded_micro_batches``).
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job. ``world_size == 1`` means no process group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str | None = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


SINGLE = DistContext()


def env_world_size() -> int:
    """``WORLD_SIZE`` set by torchrun (1 when not launched by it)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def init_distributed(device: str = "auto", *, timeout_s: float = 1800.0) -> DistContext:
    """Join torchrun's process group (idempotent) and return this rank's context.

    ``device``: ``auto`` = ``cuda:LOCAL_RANK`` when CUDA is available, else CPU; ``cpu`` forces
    gloo. Without torchrun's environment this returns a single-process context (no group), so
    ``strategy: fsdp`` also runs as one process (FSDP over one rank).
    """
    world = env_world_size()
    rank = int(os.environ.get("RANK", "0") or 0)
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    use_cuda = torch.cuda.is_available() and (device == "auto" or device.startswith("cuda"))
    if use_cuda:
        dev = torch.device(f"cuda:{local_rank}")
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    backend = "nccl" if use_cuda else "gloo"
    if "MASTER_ADDR" not in os.environ:
        if world > 1:
            raise RuntimeError(
                f"WORLD_SIZE={world} but MASTER_ADDR is not set: launch the ranks with torchrun "
                "(torchrun --nproc-per-node N -m areal_env.cli train config.yaml)"
            )
        # One rank without torchrun: a private single-member group so FSDP still works.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=dev if use_cuda else None,
        )
        logger.info(
            "rank %d/%d joined the process group (backend %s, device %s)",
            rank,
            world,
            backend,
            dev,
        )
    return DistContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=dev,
        backend=backend,
    )


def current_context() -> DistContext:
    """The context of an already-initialised group (``SINGLE`` when there is none)."""
    if not dist.is_available() or not dist.is_initialized():
        return SINGLE
    dev = (
        torch.device(f"cuda:{torch.cuda.current_device()}")
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    return DistContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0") or 0),
        device=dev,
        backend=dist.get_backend(),
    )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------------------------------
# FSDP2
# ------------------------------------------------------------------------------------------


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks to shard one by one: the classes the model lists in
    ``_no_split_modules`` (every HF decoder model does), else a ``layers`` ModuleList."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    if names:
        found = [m for m in model.modules() if type(m).__name__ in names]
        if found:
            return found
    for m in model.modules():
        layers = getattr(m, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
            return list(layers)
    raise ValueError(
        f"cannot find the decoder layers of {type(model).__name__} to shard: it lists no "
        "_no_split_modules and has no `layers` ModuleList"
    )


def shard_model(
    model: torch.nn.Module,
    *,
    param_dtype: torch.dtype | None,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
) -> torch.nn.Module:
    """FSDP2 ``fully_shard`` per decoder layer, then the root. In place; returns ``model``.

    ``param_dtype``: compute in it (each layer's parameters are gathered cast to it) and reduce
    gradients in fp32, over the model's own (fp32 master) parameters and optimiser states; None
    = compute in the parameters' dtype. ``cpu_offload``: keep sharded parameters, gradients and
    optimiser states in host memory (the optimiser step runs on the CPU; for models that do not
    fit).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
    if param_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=torch.float32
        )
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    logger.info(
        "FSDP2: %d decoder layers + root sharded over %d rank(s) (compute dtype %s, "
        "cpu offload %s)",
        len(layers),
        dist.get_world_size() if dist.is_initialized() else 1,
        param_dtype or "of the parameters",
        cpu_offload,
    )
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_state_dict(model: torch.nn.Module, *, trainable_only: bool = False) -> dict[str, Any]:
    """The full (unsharded) weights on CPU. Collective for a sharded model: every rank must
    call it; rank 0 gets the tensors, the other ranks an empty dict."""
    if not is_sharded(model):
        sd = model.state_dict()
        if trainable_only:
            names = {n for n, p in model.named_parameters() if p.requires_grad}
            sd = {k: v for k, v in sd.items() if k in names}
        return {k: v.detach().to("cpu", copy=True) for k, v in sd.items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(
        full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only
    )
    sd = get_model_state_dict(model, options=opts)
    # With one rank on the CPU the "gathered, offloaded" tensors are the live parameters
    # themselves (and tied names share one): copy those, so that no caller ever holds tensors
    # the optimiser goes on changing, and every name owns its memory, as unsharded.
    live = {storage_ptr(p) for p in model.parameters()}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor) and storage_ptr(v) in live:
            sd[k] = v.detach().clone()
    if trainable_only:
        # DCP keeps a tied weight under every name (a frozen lm_head tied to the embeddings
        # stays in); ``named_parameters`` names each parameter once, as the unsharded path does.
        names = {n for n, p in model.named_parameters() if p.requires_grad}
        sd = {k: v for k, v in sd.items() if k in names}
    return sd


def storage_ptr(t: torch.Tensor) -> int:
    """The address of the memory behind ``t`` (a DTensor's: its local shard's)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return int(local.untyped_storage().data_ptr())


def to_local_float(value: Any) -> float:
    """A (possibly DTensor) scalar as a Python float (a DTensor norm is already reduced)."""
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value)


# ------------------------------------------------------------------------------------------
# Rows across ranks
# ------------------------------------------------------------------------------------------


def split_rows(rows: list[int], lengths: list[int], world_size: int) -> list[list[int]]:
    """Deal ``rows`` to ``world_size`` ranks, longest first, each to the rank with the fewest
    tokens so far (ties: lowest rank). Deterministic: every rank computes the same split."""
    shares: list[list[int]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for r in sorted(rows, key=lambda r: (-lengths[r], r)):
        k = min(range(world_size), key=lambda i: (loads[i], i))
        shares[k].append(r)
        loads[k] += lengths[r]
    return [sorted(s) for s in shares]


def micro_batches(lengths: list[int], rows: list[int], max_tokens: int) -> list[list[int]]:
    """Pack ``rows`` (longest first) so each micro-batch's padded size rows×max_len ≤ max_tokens
    (a single longer row still gets its own micro-batch)."""
    order = sorted(rows, key=lambda r: -lengths[r])
    out: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for r in order:
        new_max = max(cur_max, lengths[r])
        if cur and new_max * (len(cur) + 1) > max_tokens:
            out.append(cur)
            cur, cur_max = [], 0
            new_max = lengths[r]
        cur.append(r)
        cur_max = new_max
    if cur:
        out.append(cur)
    return out


def padded_micro_batches(
    rows: list[int], lengths: list[int], max_tokens: int, ctx: DistContext
) -> list[list[int] | None]:
    """This rank's micro-batches of ``rows`` (split across ranks), padded with ``None`` to the
    largest count over all ranks, so every rank runs as many forward/backward passes."""
    shares = split_rows(rows, lengths, ctx.world_size)
    per_rank = [micro_batches(lengths, s, max_tokens) if s else [] for s in shares]
    n = max(len(p) for p in per_rank)
    mine: list[list[int] | None] = list(per_rank[ctx.rank])
    return mine + [None] * (n - len(mine))


def broadcast_object(obj: Any, ctx: DistContext, src: int = 0) -> Any:
    """``obj`` from rank ``src`` on every rank (pickled; CPU tensors inside are fine)."""
    if not ctx.distributed:
        return obj
    box = [obj if ctx.rank == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_reduce_sums(values: dict[str, float], ctx: DistContext) -> dict[str, float]:
    """Sum each value over ranks (keys must be the same on every rank: pass sorted keys)."""
    if not ctx.distributed or not values:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return {k: float(v) for k, v in zip(keys, t.tolist(), strict=True)}


def all_reduce_tensor(t: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum of ``t`` over ranks (moved to the group's device and back)."""
    if not ctx.distributed:
        return t
    buf = t.to(ctx.device)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    return buf.to(t.device)


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()


def destroy() -> None:
    """Tear the process group down after a barrier.

    Without the barrier a rank that finishes first closes its gloo pairs while a peer is
    still in its last collective; the peer then aborts in C++ ("terminate called without an
    active exception") and torchrun reports the whole job as failed.
    """
    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


__all__ = [
    "DistContext",
    "SINGLE",
    "all_reduce_sums",
    "all_reduce_tensor",
    "barrier",
    "broadcast_object",
    "current_context",
    "decoder_layers",
    "destroy",
    "env_world_size",
    "full_state_dict",
    "init_distributed",
    "is_sharded",
    "padded_micro_batches",
    "shard_model",
    "split_rows",
    "to_local_float",
]
