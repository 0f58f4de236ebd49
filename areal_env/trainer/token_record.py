"""Per-step token records: what the trainer made of every trained row (for ``areal-env view``).

The JSONL dumps (``rollout/{version}/{task}.jsonl``) say what the agent did; these records say
what the update did with it, token by token: the token ids, the loss mask, each trained token's
rollout logprob (what the inference engine reported) and weight version, the trainer's logprob
of it in the update pass that took its gradient, its advantage and whether the PPO clip cut its
gradient. Each row is linked to the session and the interaction it came from, so the viewer can
shade a conversation tree's tokens.

Written only with ``rollout.dump_to_file``, by a background thread: the update hands over the
tensors it computed anyway (references, no copies, except two [B, L] tensors the trace fills),
and packing, compression and disk writes happen off the training loop.

Files under ``run_dir/tokens/`` (one pair per update; a step whose batch was redrawn has
several parts):

- ``step-{step:06d}-{part}.bin``: one zlib-compressed block per GRPO group; inside a block, per
  row, little-endian: ``input_ids`` int32[n], ``loss_mask`` uint8[n], then for the k tokens in
  the loss mask: ``versions`` int32[k], ``rollout_logprob`` float32[k], ``trainer_logprob``
  float32[k] (NaN: no update pass scored it: the update was skipped, the token is the row's
  first, or another rank trained the row), ``advantage`` float32[k], ``clipped`` uint8[k]
  (0, 1, or 255 when not scored). A group's rows share their prompt (and a session's rows
  their earlier turns), which zlib stores once.
- ``step-{step:06d}-{part}.json``: the index (written last, atomically, so its presence means
  the ``.bin`` is whole): the step, version, clip range; per block its offset, size and rows'
  ``(n, k)``; per session its block, where its rows start in it, and per row its interaction
  id, lengths, reward, mean advantage, clipped count and mean |gap|.
- ``tokenizer.json``: the run's tokenizer, so the folder decodes tokens on its own.

Size: 5 bytes per token plus 17 per trained token before compression; measured figures per
1,000 episodes in docs/viewer.md.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import queue
import threading
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

    from areal_env.api.config import ActorConfig
    from areal_env.api.episode import Episode
    from areal_env.trainer.actor_math import PreparedBatch

logger = logging.getLogger(__name__)

FORMAT = 2
TOKEN_DIR = "tokens"
TOKENIZER_FILE = "tokenizer.json"
NOT_SCORED = 255
"""``clipped`` value of a trained token no update pass scored."""

_DTYPES = (
    ("versions", "<i4"),
    ("rollout_logprob", "<f4"),
    ("trainer_logprob", "<f4"),
    ("advantage", "<f4"),
    ("clipped", "u1"),
)


def part_stem(step: int, part: int) -> str:
    """``step-000012-0``: the file stem of one update's record."""
    return f"step-{step:06d}-{part}"


# ---- the row format ------------------------------------------------------------------------


@dataclass
class RowTokens:
    """One trained row: every token, and the per-token data of those in the loss mask."""

    input_ids: np.ndarray  # int32 [n]
    loss_mask: np.ndarray  # uint8 [n]
    versions: np.ndarray  # int32 [k]
    rollout_logprob: np.ndarray  # float32 [k]
    trainer_logprob: np.ndarray  # float32 [k], NaN where not scored
    advantage: np.ndarray  # float32 [k]
    clipped: np.ndarray  # uint8 [k]: 0, 1 or NOT_SCORED

    def __post_init__(self) -> None:
        n, k = len(self.input_ids), int(np.count_nonzero(self.loss_mask))
        if len(self.loss_mask) != n:
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries, input_ids {n}")
        for name, _ in _DTYPES:
            if len(getattr(self, name)) != k:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, not {k}")


def encode_block(rows: Iterable[RowTokens], level: int = 6) -> bytes:
    """The compressed block of a session's rows (layout in the module docstring)."""
    parts: list[bytes] = []
    for r in rows:
        parts.append(np.asarray(r.input_ids, "<i4").tobytes())
        parts.append(np.asarray(r.loss_mask, "u1").tobytes())
        for name, dtype in _DTYPES:
            parts.append(np.asarray(getattr(r, name), dtype).tobytes())
    return zlib.compress(b"".join(parts), level)


def decode_block(data: bytes, shapes: Sequence[tuple[int, int]]) -> list[RowTokens]:
    """The rows of a block; ``shapes``: each row's ``(n, k)`` from the index. ``ValueError``
    when the bytes do not hold exactly those rows (a damaged or foreign file)."""
    try:
        raw = zlib.decompress(data)
    except zlib.error as e:
        raise ValueError(f"token block does not decompress: {e}") from None
    out: list[RowTokens] = []
    pos = 0

    def take(dtype: str, count: int) -> np.ndarray:
        nonlocal pos
        size = np.dtype(dtype).itemsize * count
        if pos + size > len(raw):
            raise ValueError("token block is shorter than its index says")
        arr = np.frombuffer(raw, dtype=dtype, count=count, offset=pos)
        pos += size
        return arr

    for n, k in shapes:
        ids = take("<i4", n)
        mask = take("u1", n)
        if int(np.count_nonzero(mask)) != k:
            raise ValueError("token block's loss mask disagrees with its index")
        rest = {name: take(dtype, k) for name, dtype in _DTYPES}
        out.append(RowTokens(ids, mask, **rest))
    if pos != len(raw):
        raise ValueError("token block is longer than its index says")
    return out


# ---- which session each batch row came from ------------------------------------------------


@dataclass
class RowLink:
    """Where a batch row came from: its session, task, group and member, and the completion
    its tokens end at (``row_id``: the proxy's interaction id)."""

    session_id: str | None = None
    task_id: str | None = None
    group: int | None = None
    traj: int | None = None
    row_id: str | None = None


def links_of(groups: Sequence[Sequence[Episode]]) -> list[RowLink]:
    """Each row of a batch linked to its episode, in the order the batch is collated
    (``workflow.batch.collate_groups``: group by group, episode by episode, row by row)."""
    return [
        RowLink(
            session_id=ep.session_id,
            task_id=None if ep.task_id is None else str(ep.task_id),
            group=g,
            traj=ep.traj_index,
            row_id=row.row_id,
        )
        for g, episodes in enumerate(groups)
        for ep in episodes
        for row in ep.rows
    ]


# ---- what the actor hands over ------------------------------------------------------------


@dataclass
class CapturedUpdate:
    """One update's per-token tensors (CPU, [B, L]) and per-row values ([B])."""

    input_ids: torch.Tensor
    lengths: list[int]
    loss_mask: torch.Tensor
    versions: torch.Tensor
    rollout_logprob: torch.Tensor
    advantage: torch.Tensor
    rewards: torch.Tensor
    trainer_logprob: torch.Tensor
    clipped: torch.Tensor
    recomputed: bool


class UpdateTrace:
    """The actor's hook (``PPOActor.trace``): sees each update's prepared batch and every
    micro-batch's scored logprobs and clip flags. Holds one update at a time; ``take()`` hands
    it over and starts empty again. With ``ppo_epochs > 1`` the last pass over a token wins."""

    def __init__(self) -> None:
        self._current: CapturedUpdate | None = None

    def prepared(self, batch: dict[str, Any], pb: PreparedBatch) -> None:
        import torch

        b, width = pb.input_ids.shape
        self._current = CapturedUpdate(
            input_ids=pb.input_ids,
            lengths=list(pb.lengths),
            loss_mask=batch["loss_mask"],
            versions=batch["versions"],
            rollout_logprob=pb.behav_logp,
            advantage=pb.adv,
            rewards=batch["rewards"],
            trainer_logprob=torch.full((b, width), math.nan, dtype=torch.float32),
            clipped=torch.full((b, width), NOT_SCORED, dtype=torch.uint8),
            recomputed=pb.old_logp is not pb.behav_logp,
        )

    def scored(
        self, rows: Sequence[int], mask: torch.Tensor, logp: torch.Tensor, clipped: torch.Tensor
    ) -> None:
        """``mask`` [len(rows), width]: the scored positions of ``rows``; ``logp`` and
        ``clipped``: flat over them, row-major (as the loss sees them)."""
        import torch

        cur = self._current
        if cur is None or logp.numel() == 0:
            return
        pos = mask.nonzero()
        if pos.shape[0] != logp.numel():  # not the layout this trace understands: skip
            return
        row_idx = torch.as_tensor(list(rows), dtype=torch.long)[pos[:, 0].cpu()]
        col_idx = pos[:, 1].cpu()
        cur.trainer_logprob[row_idx, col_idx] = logp.detach().float().cpu()
        cur.clipped[row_idx, col_idx] = clipped.detach().cpu().to(torch.uint8)

    def take(self) -> CapturedUpdate | None:
        cur, self._current = self._current, None
        return cur


def rows_of(cap: CapturedUpdate) -> list[RowTokens]:
    """The captured update as rows (numpy; runs on the writer thread)."""
    ids = cap.input_ids.numpy()
    mask = cap.loss_mask.numpy().astype(bool)
    arrays = {
        "versions": cap.versions.numpy(),
        "rollout_logprob": cap.rollout_logprob.float().numpy(),
        "trainer_logprob": cap.trainer_logprob.numpy(),
        "advantage": cap.advantage.float().numpy(),
        "clipped": cap.clipped.numpy(),
    }
    out = []
    for i, n in enumerate(cap.lengths):
        m = mask[i, :n]
        out.append(
            RowTokens(
                input_ids=ids[i, :n].astype("<i4"),
                loss_mask=m.astype("u1"),
                **{k: v[i, :n][m] for k, v in arrays.items()},
            )
        )
    return out


# ---- the writer ----------------------------------------------------------------------------


@dataclass
class UpdatePart:
    """One update, ready to be written: ``step``'s ``part``-th update (a redrawn batch makes
    more than one), on rollouts of weights ``version``; ``links``: where each row came from
    (:func:`links_of`; rows without one are kept, unlinked); ``meta``: more keys for the
    index."""

    step: int
    part: int
    version: int
    captured: CapturedUpdate
    links: list[RowLink]
    meta: dict[str, Any] = field(default_factory=dict)


def _short(x: float) -> float:
    """Six significant digits: what a summary needs, in a third of the index's bytes."""
    return float(f"{x:.6g}")


def _row_summary(row: RowTokens, link: RowLink, reward: float) -> dict[str, Any]:
    trained = row.clipped != NOT_SCORED
    gap = np.abs(row.trainer_logprob[trained] - row.rollout_logprob[trained])
    return {
        "row_id": link.row_id,
        "n": len(row.input_ids),
        "k": len(row.versions),
        "reward": _short(reward),
        "adv": _short(float(row.advantage.mean())) if len(row.advantage) else 0.0,
        "clipped": int(np.count_nonzero(row.clipped == 1)),
        "gap": _short(float(gap.mean())) if len(gap) else None,
    }


def write_part(root: Path, job: UpdatePart) -> Path:
    """Write one update's ``.bin`` and then its ``.json`` index; returns the index path.

    One compressed block per GRPO group (its members share the prompt, which zlib then stores
    once), the rows of each session contiguous in it; the index says where each session's rows
    start in their block."""
    rows = rows_of(job.captured)
    links = job.links if len(job.links) == len(rows) else [RowLink() for _ in rows]
    rewards = job.captured.rewards.float().tolist()
    by_group: dict[int | None, dict[str | None, list[int]]] = {}
    for i, link in enumerate(links):
        by_group.setdefault(link.group, {}).setdefault(link.session_id, []).append(i)
    stem = part_stem(job.step, job.part)
    blocks: list[dict[str, Any]] = []
    sessions: list[dict[str, Any]] = []
    offset = 0
    tmp_bin = root / f".{stem}.bin.tmp"
    with tmp_bin.open("wb") as f:
        for members in by_group.values():
            order = [i for ids in members.values() for i in ids]
            data = encode_block(rows[i] for i in order)
            f.write(data)
            start = 0
            for sid, ids in members.items():
                first = links[ids[0]]
                sessions.append(
                    {
                        "session_id": sid,
                        "task_id": first.task_id,
                        "group": first.group,
                        "traj": first.traj,
                        "block": len(blocks),
                        "start": start,
                        "rows": [_row_summary(rows[i], links[i], rewards[i]) for i in ids],
                    }
                )
                start += len(ids)
            blocks.append(
                {
                    "offset": offset,
                    "size": len(data),
                    "shapes": [[len(rows[i].input_ids), len(rows[i].versions)] for i in order],
                }
            )
            offset += len(data)
    os.replace(tmp_bin, root / f"{stem}.bin")
    index = {
        "format": FORMAT,
        "step": job.step,
        "part": job.part,
        "version": job.version,
        "time": time.time(),
        "ratio_against": "recomputed" if job.captured.recomputed else "rollout",
        **job.meta,
        "rows": len(rows),
        "tokens": int(sum(len(r.input_ids) for r in rows)),
        "trained_tokens": int(sum(len(r.versions) for r in rows)),
        "bytes": offset,
        "blocks": blocks,
        "sessions": sessions,
    }
    tmp = root / f".{stem}.json.tmp"
    tmp.write_text(json.dumps(index, separators=(",", ":")))
    path = root / f"{stem}.json"
    os.replace(tmp, path)
    return path


def drop_parts_after(root: Path, keep_step: int) -> int:
    """Remove the records of steps after ``keep_step`` (they will be redone on resume; all of
    them on a fresh start: ``keep_step=0``) and any half-written file. Returns files removed."""
    removed = 0
    if not root.is_dir():
        return 0
    for f in root.iterdir():
        name = f.name
        stale = name.startswith(".") and name.endswith(".tmp")
        if name.startswith("step-") and f.suffix in (".bin", ".json"):
            try:
                stale = int(name.split("-")[1]) > keep_step
            except (IndexError, ValueError):
                stale = False
        if stale:
            f.unlink(missing_ok=True)
            removed += 1
    return removed


def save_tokenizer(tokenizer: Any, path: Path) -> bool:
    """The tokenizer's ``tokenizer.json`` (fast tokenizers); False when it has none."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(backend.to_str())
    os.replace(tmp, path)
    return True


class TokenLog:
    """The trainer's token record: ``trace`` goes to the actor (``actor.trace``), ``commit``
    after each update queues what it saw for the writer thread, ``close`` waits for the writes.

    ``keep_step``: records of later steps are removed first (a resumed run redoes them).
    A failing write (a full disk) is logged and training goes on, as for the JSONL dumps.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        actor: ActorConfig,
        *,
        tokenizer: Any = None,
        keep_step: int = 0,
        max_pending: int = 8,
    ) -> None:
        self.root = Path(run_dir) / TOKEN_DIR
        self.root.mkdir(parents=True, exist_ok=True)
        drop_parts_after(self.root, keep_step)
        self.trace = UpdateTrace()
        self._meta = {
            "eps_clip": actor.eps_clip,
            "eps_clip_high": actor.eps_clip_high
            if actor.eps_clip_high is not None
            else actor.eps_clip,
        }
        self._parts: dict[int, int] = {}
        self._queue: queue.Queue[UpdatePart | None] = queue.Queue(maxsize=max_pending)
        self.written: list[Path] = []
        self.failures = 0
        self._tokenizer = tokenizer
        self._thread = threading.Thread(target=self._run, name="token-record", daemon=True)
        self._thread.start()
        # a trainer that is never closed still gets its last steps written at exit
        atexit.register(self.close)

    def commit(self, step: int, version: int, groups: Sequence[Sequence[Episode]]) -> None:
        """Queue the update the trace saw (if any) as a part of ``step``; ``groups``: the
        batch's accepted episodes, as collated (links its rows to their sessions)."""
        captured = self.trace.take()
        if captured is None:
            return
        part = self._parts.get(step, 0)
        self._parts[step] = part + 1
        links = links_of(groups)
        if len(links) != len(captured.lengths):
            logger.warning(
                "token record of step %d: %d rows but the episodes hold %d; rows kept unlinked",
                step,
                len(captured.lengths),
                len(links),
            )
        job = UpdatePart(step, part, version, captured, links, dict(self._meta))
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            logger.warning("the token record writer is behind; the trainer waits for it")
            self._queue.put(job)

    def _run(self) -> None:
        if self._tokenizer is not None:
            try:
                save_tokenizer(self._tokenizer, self.root / TOKENIZER_FILE)
            except OSError as e:
                logger.warning("saving the tokenizer for the token record failed: %s", e)
            self._tokenizer = None
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self.written.append(write_part(self.root, job))
            except Exception as e:  # a full disk, or a bug: never take training down
                self.failures += 1
                logger.warning("token record of step %d failed: %s", job.step if job else -1, e)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued update is on disk."""
        if self._thread.is_alive():
            self._queue.join()

    def close(self, timeout: float = 120.0) -> None:
        """Finish the queued writes and stop the writer (idempotent)."""
        atexit.unregister(self.close)
        if not self._thread.is_alive():
            return
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the token record writer did not finish within %.0f s", timeout)
