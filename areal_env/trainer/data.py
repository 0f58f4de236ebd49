"""Training data: a list of dicts, a JSONL path, or a ``datasets.Dataset``, served in shuffled
batches whose position (epoch, batch index) is saved in checkpoints so a resumed run continues
with exactly the items it would have seen."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def load_items(dataset: Any) -> Sequence[dict[str, Any]]:
    """Normalise a dataset to an indexable sequence of dicts."""
    if dataset is None:
        raise ValueError("a training dataset is required (list of dicts, JSONL path or Dataset)")
    if isinstance(dataset, (str, os.PathLike)):
        path = Path(dataset)
        if not path.is_file():
            raise FileNotFoundError(f"dataset file {str(path)!r} does not exist")
        items = []
        with path.open() as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from e
                if not isinstance(item, dict):
                    raise ValueError(f"{path}:{lineno}: each line must be a JSON object")
                items.append(item)
        return items
    if isinstance(dataset, (list, tuple)):
        for i, item in enumerate(dataset):
            if not isinstance(item, dict):
                raise TypeError(f"dataset item {i} is {type(item).__name__}, expected a dict")
        return list(dataset)
    if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):  # datasets.Dataset
        return _IndexedDataset(dataset)
    raise TypeError(
        f"unsupported dataset type {type(dataset).__name__}: give a list of dicts, "
        "a JSONL path, or a datasets.Dataset"
    )


class _IndexedDataset(Sequence):
    """Row access to a ``datasets.Dataset`` without materialising it."""

    def __init__(self, ds: Any) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i):  # type: ignore[override]
        return dict(self.ds[int(i)])


def task_id_of(item: dict[str, Any], index: int) -> str:
    """The item's ``id`` / ``task_id`` / ``query_id`` (first present), else its dataset index."""
    for key in ("id", "task_id", "query_id"):
        if item.get(key) is not None:
            return str(item[key])
    return str(index)


class DataLoader:
    """Shuffled (per epoch, from ``seed``) fixed-size batches; the last partial batch is dropped
    so every step sees ``batch_size`` prompts.

    ``position`` = (epoch, batch index in that epoch); ``state_dict``/``load_state_dict`` carry it.
    An item without an ``id`` / ``task_id`` / ``query_id`` key is returned with ``task_id`` set
    to its dataset index, so its episodes and trajectory dumps can be traced back to it.
    """

    def __init__(self, dataset: Any, batch_size: int, *, seed: int = 1, shuffle: bool = True):
        self.items = load_items(dataset)
        if len(self.items) < batch_size:
            raise ValueError(
                f"the dataset has {len(self.items)} items, fewer than one batch "
                f"(rollout.batch_size={batch_size})"
            )
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.batch_index = 0

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self.items) // self.batch_size

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self) -> list[dict[str, Any]]:
        """The batch at the current position; advances the position."""
        if self.batch_index >= len(self):
            self.epoch += 1
            self.batch_index = 0
        order = self._order(self.epoch)
        start = self.batch_index * self.batch_size
        idx = order[start : start + self.batch_size]
        self.batch_index += 1
        out = []
        for i in idx:
            item = dict(self.items[i])
            if all(item.get(k) is None for k in ("id", "task_id", "query_id")):
                item["task_id"] = str(i)
            out.append(item)
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_index": self.batch_index, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.batch_index = int(state["batch_index"])
