"""Training data: a list of dicts, a JSONL path, or a ``datasets.Dataset``, served in batches
(shuffled, or weighted toward the kinds of items whose rewards vary) whose position (epoch,
batch index) and order state are saved in checkpoints, so a resumed run continues with exactly
the items it would have seen."""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from areal_env.api.config import RolloutConfig
from areal_env.api.episode import Episode
from areal_env.workflow.proxy_workflow import task_id_of


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
    if isinstance(dataset, _IndexedDataset):
        return dataset
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


class DataLoader:
    """Fixed-size batches of a dataset; the last partial batch of an epoch is dropped so every
    step sees ``batch_size`` prompts.

    Which items make a batch is ``order``'s choice: :class:`ShuffledOrder` (the default: each
    epoch in a shuffled order from ``seed``) or :class:`SignalOrder` (weighted toward the groups
    of items whose recent rewards vary). ``record`` hands a rolled-out batch back to the order.

    ``position`` = (epoch, batch index in that epoch); ``state_dict``/``load_state_dict`` carry it
    (and the order's state), so a resumed run draws exactly the items it would have drawn.
    An item without a ``task_id`` / ``id`` / ``query_id`` key is returned with ``task_id`` set
    to its dataset index, so its episodes and trajectory dumps can be traced back to it.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        *,
        seed: int = 1,
        shuffle: bool = True,
        order: BatchOrder | None = None,
    ):
        self.items = load_items(dataset)
        if len(self.items) < batch_size:
            raise ValueError(
                f"the dataset has {len(self.items)} items, fewer than one batch "
                f"(rollout.batch_size={batch_size})"
            )
        self.batch_size = batch_size
        self.seed = seed
        self.order: BatchOrder = order or ShuffledOrder(len(self.items), seed, shuffle=shuffle)
        self.epoch = 0
        self.batch_index = 0
        self._index_of_task: dict[str, int] = {}

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self.items) // self.batch_size

    def next_batch(self) -> list[dict[str, Any]]:
        """The batch at the current position; advances the position."""
        if self.batch_index >= len(self):
            self.epoch += 1
            self.batch_index = 0
        idx = self.order.batch(self.epoch, self.batch_index, self.batch_size)
        self.batch_index += 1
        out = []
        for i in idx:
            item = dict(self.items[i])
            if all(item.get(k) is None for k in ("id", "task_id", "query_id")):
                item["task_id"] = str(i)
            self._index_of_task[task_id_of(item) or str(i)] = i
            out.append(item)
        return out

    def record(self, episodes: Iterable[Episode]) -> None:
        """The rewards of rolled-out episodes of this loader's items (others are ignored)."""
        seen = []
        for ep in episodes:
            i = self._index_of_task.get(ep.task_id or "")
            if i is not None and ep.accepted:
                seen.append((i, ep.mean_reward))
        if seen:
            self.order.record(seen)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "batch_index": self.batch_index,
            "seed": self.seed,
            "order": self.order.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.batch_index = int(state["batch_index"])
        if state.get("order") is not None:
            self.order.load_state_dict(state["order"])


def make_loader(dataset: Any, rollout: RolloutConfig, *, seed: int) -> DataLoader:
    """The training data loader ``rollout`` asks for (``prompt_sampling``)."""
    items = load_items(dataset)
    order: BatchOrder | None = None
    if rollout.prompt_sampling == "signal":
        assert rollout.signal_key is not None  # RolloutConfig.validate
        order = SignalOrder(items, rollout.signal_key, seed, floor=rollout.signal_floor)
    return DataLoader(items, rollout.batch_size, seed=seed, order=order)


class BatchOrder(Protocol):
    """Which dataset indices make the batch at (epoch, batch index), and what it learns from
    the rewards of rolled-out items."""

    def batch(self, epoch: int, batch_index: int, size: int) -> list[int]: ...

    def record(self, rewards: list[tuple[int, float]]) -> None: ...

    def stats(self) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ShuffledOrder:
    """Each epoch a permutation of the dataset from ``seed`` (in order without ``shuffle``)."""

    def __init__(self, n_items: int, seed: int, *, shuffle: bool = True) -> None:
        self.n_items = n_items
        self.seed = seed
        self.shuffle = shuffle

    def batch(self, epoch: int, batch_index: int, size: int) -> list[int]:
        order = list(range(self.n_items))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order[batch_index * size : (batch_index + 1) * size]

    def record(self, rewards: list[tuple[int, float]]) -> None:
        """Rewards do not change a shuffled order."""

    def stats(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: the order follows from the seed and the position."""


class SignalOrder:
    """Batches weighted toward the groups of items whose recent rewards vary.

    Why: a group of episodes whose rewards are all equal (every attempt failed, or every one
    succeeded) has no advantage to learn from, and a kind of problem the policy cannot solve yet
    only pushes its attempts down, which also pushes down the same calls where they are right.
    The items are grouped by the value of their ``key`` field (a kind, a level). A group's
    weight is its number of items times its signal: the variance of its recent rewards
    (p(1 - p) for 0/1 rewards, largest at 50 % success), not below ``floor`` times the largest
    group's, so a group that cannot be solved yet, or is mastered, is still visited at that
    rate and comes back once its rewards vary. A group's signal starts at the largest group's
    and moves to its own as its episodes add up (``prior`` pseudo-episodes at the largest
    signal), so the first batches follow the dataset's own mix and a kind is not starved on
    the evidence of a few failures. Rewards age by ``decay`` per recorded batch.

    A batch's slots are split among the groups in proportion to the weights (whole slots first,
    the rest drawn at random by the remainders), and each group hands out its items in a
    shuffled cycle.
    """

    def __init__(
        self,
        items: Sequence[dict[str, Any]],
        key: str,
        seed: int,
        *,
        floor: float = 0.25,
        decay: float = 0.7,
        prior: float = 4.0,
    ) -> None:
        groups: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            groups.setdefault(_group_name(item.get(key)), []).append(i)
        if set(groups) == {_group_name(None)}:
            raise ValueError(
                f"rollout.signal_key={key!r} is a field of none of the {len(items)} training "
                "items: name a field that groups them (a kind, a level)"
            )
        self.key = key
        self.floor = floor
        self.decay = decay
        self.prior = prior
        self.names = sorted(groups)
        self.members = [groups[n] for n in self.names]
        self.group_of = {i: g for g, idx in enumerate(self.members) for i in idx}
        self.rng = random.Random(seed * 1_000_003 + 7)
        self.cycles = [self._shuffled(g) for g in range(len(self.names))]
        self.next = [0] * len(self.names)
        # aged sums per group: episodes, rewards, squared rewards
        self.n = [0.0] * len(self.names)
        self.s = [0.0] * len(self.names)
        self.s2 = [0.0] * len(self.names)

    def _shuffled(self, g: int) -> list[int]:
        order = list(self.members[g])
        self.rng.shuffle(order)
        return order

    def weights(self) -> list[float]:
        """Each group's share of the next batch (sums to 1)."""
        var = []
        for n, s, s2 in zip(self.n, self.s, self.s2, strict=True):
            mean = s / n if n > 0 else 0.0
            var.append(max(s2 / n - mean * mean, 0.0) if n > 0 else 0.0)
        seen = [v for v, n in zip(var, self.n, strict=True) if n >= 2.0]
        top = max(seen, default=0.0) or 1.0
        raw = []
        for m, v, n in zip(self.members, var, self.n, strict=True):
            # a few episodes prove little: the estimate starts at the best group's signal and
            # moves to the group's own as its (aged) episodes add up
            signal = (n * v + self.prior * top) / (n + self.prior)
            raw.append(len(m) * max(signal, self.floor * top))
        total = sum(raw)
        return [w / total for w in raw]

    def batch(self, epoch: int, batch_index: int, size: int) -> list[int]:
        shares = self.weights()
        counts = [int(size * w) for w in shares]
        rest = [size * w - c for w, c in zip(shares, counts, strict=True)]
        while sum(counts) < size:
            g = self.rng.choices(range(len(shares)), weights=rest)[0]
            counts[g] += 1
            rest[g] = 0.0
            if not any(rest):
                rest = list(shares)
        # no item twice in one batch while other groups have room: a group's excess moves on
        room = [len(m) - c for m, c in zip(self.members, counts, strict=True)]
        while any(r < 0 for r in room) and any(r > 0 for r in room):
            g = min(range(len(room)), key=lambda k: room[k])
            to = max(range(len(room)), key=lambda k: (room[k] > 0, shares[k]))
            counts[g] -= 1
            counts[to] += 1
            room[g] += 1
            room[to] -= 1
        out = []
        for g, c in enumerate(counts):
            for _ in range(c):
                if self.next[g] >= len(self.cycles[g]):
                    self.cycles[g], self.next[g] = self._shuffled(g), 0
                out.append(self.cycles[g][self.next[g]])
                self.next[g] += 1
        self.rng.shuffle(out)
        return out

    def record(self, rewards: list[tuple[int, float]]) -> None:
        self.n = [x * self.decay for x in self.n]
        self.s = [x * self.decay for x in self.s]
        self.s2 = [x * self.decay for x in self.s2]
        for i, r in rewards:
            g = self.group_of.get(i)
            if g is None or not math.isfinite(r):
                continue
            self.n[g] += 1.0
            self.s[g] += r
            self.s2[g] += r * r

    def stats(self) -> dict[str, float]:
        """Per-group shares of the next batch, for the metrics log."""
        return {f"sampling/share/{n}": w for n, w in zip(self.names, self.weights(), strict=True)}

    def state_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "names": self.names,
            "cycles": self.cycles,
            "next": self.next,
            "n": self.n,
            "s": self.s,
            "s2": self.s2,
            "rng": _rng_state(self.rng),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("names") != self.names:
            raise ValueError(
                "the checkpoint's signal sampling groups differ from this dataset's "
                f"({state.get('names')} vs {self.names}): resume with the same train_dataset "
                "and rollout.signal_key, or start fresh (trainer.recover=off)"
            )
        self.cycles = [list(c) for c in state["cycles"]]
        self.next = list(state["next"])
        self.n, self.s, self.s2 = list(state["n"]), list(state["s"]), list(state["s2"])
        self.rng.setstate(_rng_from_state(state["rng"]))


def _group_name(value: Any) -> str:
    return "(none)" if value is None else str(value)


def _rng_state(rng: random.Random) -> list[Any]:
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def _rng_from_state(state: list[Any]) -> tuple[Any, ...]:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)
