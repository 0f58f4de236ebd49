"""SGLang's tensor path for weights: the trainer's rank 0 broadcasts every tensor over an NCCL
group it shares with the servers, instead of writing a folder they read from disk.

Contract (SGLang's HTTP API, read from its source):

- ``POST /init_weights_update_group`` ``{master_address, master_port, rank_offset, world_size,
  group_name, backend}``: each server joins a process group of ``world_size`` members; its TP
  ranks take ranks ``rank_offset .. rank_offset + tp - 1``; the trainer is rank 0.
- ``POST /update_weights_from_distributed`` ``{names, dtypes, shapes, group_name, flush_cache,
  weight_version}``: the server receives ``len(names)`` tensors broadcast from rank 0, in order,
  and loads them; it answers ``{success, message}`` once they are in.

Both calls block until the trainer does its half, so the HTTP requests run in threads while this
process joins the group / broadcasts. Selected with ``engine.sglang.weight_sync: nccl``.
NOT RUN on this project's CPU machine (it needs GPUs and real SGLang servers); the disk path
(``weight_sync: disk``) is the tested default.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Iterable
from typing import Any

import torch

logger = logging.getLogger(__name__)

GROUP_NAME = "areal_env_weight_sync"


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


class NcclWeightSync:
    """Rank 0's end of the weight-update group shared with ``engine``'s servers."""

    def __init__(
        self,
        engine: Any,
        *,
        master_address: str,
        master_port: int,
        tp_size: int = 1,
        backend: str = "nccl",
        timeout_s: float = 600.0,
    ) -> None:
        self.engine = engine
        self.master_address = master_address
        self.master_port = int(master_port)
        self.tp_size = tp_size
        self.backend = backend
        self.timeout_s = timeout_s
        self.group: Any = None

    @property
    def world_size(self) -> int:
        return 1 + self.tp_size * len(self.engine.addresses)

    def _all_servers(self, path: str, bodies: list[dict]) -> None:
        """POST ``bodies[i]`` to server ``i`` in threads; raise naming every failed server."""
        errors: dict[str, str] = {}

        def one(addr: str, body: dict) -> None:
            try:
                res = self.engine.servers.post(addr, path, body)
                if isinstance(res, dict) and res.get("success") is False:
                    errors[addr] = str(res.get("message"))
            except Exception as e:  # noqa: BLE001 - collected and reported below
                errors[addr] = f"{type(e).__name__}: {e}"

        self._threads = [
            threading.Thread(target=one, args=(a, b), daemon=True)
            for a, b in zip(self.engine.addresses, bodies, strict=True)
        ]
        for t in self._threads:
            t.start()
        self._errors = errors
        self._path = path

    def _join(self) -> None:
        for t in self._threads:
            t.join()
        if self._errors:
            detail = "; ".join(f"{a}: {m}" for a, m in self._errors.items())
            raise RuntimeError(f"{self._path} failed on {len(self._errors)} server(s): {detail}")

    def connect(self) -> None:
        """Create the group (the servers join through their HTTP endpoint meanwhile)."""
        from torch.distributed.distributed_c10d import _new_process_group_helper, _world

        bodies = [
            {
                "master_address": self.master_address,
                "master_port": self.master_port,
                "rank_offset": 1 + i * self.tp_size,
                "world_size": self.world_size,
                "group_name": GROUP_NAME,
                "backend": self.backend,
            }
            for i in range(len(self.engine.addresses))
        ]
        self._all_servers("/init_weights_update_group", bodies)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        store = torch.distributed.TCPStore(
            self.master_address,
            self.master_port,
            self.world_size,
            is_master=True,
            timeout=timeout,
        )
        prefixed = torch.distributed.PrefixStore(f"{GROUP_NAME}/", store)
        pg, _ = _new_process_group_helper(
            self.world_size,
            0,
            [],
            self.backend,
            prefixed,
            group_name=GROUP_NAME,  # type: ignore[arg-type]
            timeout=timeout,
        )
        _world.pg_group_ranks[pg] = {i: i for i in range(self.world_size)}
        self.group = pg
        self._join()
        logger.info("weight-update group %s: %d member(s)", GROUP_NAME, self.world_size)

    def push(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Broadcast ``(name, tensor)`` pairs (on this rank's GPU) to every server."""
        if self.group is None:
            self.connect()
        items = list(tensors)
        body = {
            "names": [n for n, _ in items],
            "dtypes": [_dtype_name(t) for _, t in items],
            "shapes": [list(t.shape) for _, t in items],
            "group_name": GROUP_NAME,
            "flush_cache": True,
            "weight_version": str(version),
        }
        self._all_servers("/update_weights_from_distributed", [body] * len(self.engine.addresses))
        for _, t in items:
            torch.distributed.broadcast(t, src=0, group=self.group)
        self._join()
