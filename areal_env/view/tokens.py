"""Reading a run's token records (``run_dir/tokens/``, written by
``areal_env.trainer.token_record``) and turning token ids into the text pieces shown.

An index file is written once and never changed, so parsed indexes are cached by name; a
``.bin`` without its index is an update still being written (or cut by a crash) and is not
read. Blocks are read one session at a time: opening a conversation reads a few kilobytes,
whatever the size of the run.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from areal_env.trainer.token_record import (
    FORMAT,
    NOT_SCORED,
    TOKEN_DIR,
    TOKENIZER_FILE,
    RowTokens,
    decode_block,
)

logger = logging.getLogger(__name__)

_PART = re.compile(r"^step-(\d+)-(\d+)\.json$")


@dataclass
class TokenPart:
    """One update's record: its index, parsed."""

    stem: str
    step: int
    part: int
    index: dict[str, Any]

    @property
    def sessions(self) -> list[dict[str, Any]]:
        return list(self.index.get("sessions") or [])


class TokenRecords:
    """The token records of one run folder."""

    def __init__(self, run_dir: Path) -> None:
        self.root = run_dir / TOKEN_DIR
        self._parts: dict[str, TokenPart] = {}
        self._by_step: dict[int, list[str]] = {}
        self.errors: list[str] = []
        self._text: TokenText | None = None
        self._text_tried = False
        self._blocks: dict[tuple[str, int], list[RowTokens]] = {}
        self._lock = threading.Lock()

    def refresh(self) -> None:
        """Pick up indexes written since the last call."""
        if not self.root.is_dir():
            return
        for f in self.root.iterdir():
            m = _PART.match(f.name)
            if m is None or f.name in self._parts:
                continue
            stem = f.name[: -len(".json")]
            try:
                index = orjson.loads(f.read_bytes())
            except (OSError, orjson.JSONDecodeError) as e:
                self._note(f"{f.name}: unreadable ({e})")
                continue
            if not isinstance(index, dict) or index.get("format") != FORMAT:
                self._note(f"{f.name}: not a token record of format {FORMAT}")
                continue
            part = TokenPart(stem, int(m.group(1)), int(m.group(2)), index)
            self._parts[f.name] = part
            self._by_step.setdefault(part.step, []).append(f.name)
            self._by_step[part.step].sort(key=lambda n: self._parts[n].part)

    def _note(self, message: str) -> None:
        if message not in self.errors:
            self.errors.append(message)
            logger.warning("token record: %s", message)

    def steps(self) -> list[int]:
        return sorted(self._by_step)

    def parts_of(self, step: int) -> list[TokenPart]:
        return [self._parts[n] for n in self._by_step.get(step, [])]

    def session_entries(self, step: int, session_id: str) -> list[tuple[TokenPart, dict]]:
        """The blocks of ``session_id`` in ``step``'s records (one per update part)."""
        out = []
        for part in self.parts_of(step):
            for entry in part.sessions:
                if entry.get("session_id") == session_id:
                    out.append((part, entry))
        return out

    def sessions_with_tokens(self, step: int) -> set[str]:
        return {
            e["session_id"] for p in self.parts_of(step) for e in p.sessions if e.get("session_id")
        }

    def read_block(self, part: TokenPart, entry: dict[str, Any]) -> list[RowTokens]:
        """A session's rows; ``ValueError`` for a damaged file (said in plain words)."""
        try:
            block = part.index["blocks"][int(entry["block"])]
            start = int(entry["start"])
            offset, size = int(block["offset"]), int(block["size"])
            shapes = [(int(n), int(k)) for n, k in block["shapes"]]
        except (KeyError, IndexError, TypeError, ValueError):
            raise ValueError(f"{part.stem}.json: the index does not describe this block") from None
        key = (part.stem, int(entry["block"]))
        with self._lock:
            rows = self._blocks.get(key)
        if rows is None:
            path = self.root / f"{part.stem}.bin"
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read(size)
            except OSError as e:
                raise ValueError(f"{path.name}: cannot be read ({e})") from None
            if len(data) != size:
                raise ValueError(f"{path.name} ends before the block its index names (cut short?)")
            rows = decode_block(data, shapes)
            with self._lock:
                self._blocks[key] = rows
                while len(self._blocks) > 64:  # a few groups' blocks: what pages read again
                    self._blocks.pop(next(iter(self._blocks)))
        return rows[start : start + len(entry["rows"])]

    def text(self, run_dir: Path) -> TokenText | None:
        """The run's tokenizer, when the run saved one (or a checkpoint holds one)."""
        if not self._text_tried:
            self._text_tried = True
            candidates = [self.root / TOKENIZER_FILE]
            ckpts = run_dir / "checkpoints"
            if ckpts.is_dir():
                candidates += sorted(ckpts.glob("*/model/" + TOKENIZER_FILE), reverse=True)
            for path in candidates:
                if path.is_file():
                    try:
                        self._text = TokenText.from_file(path)
                        break
                    except Exception as e:  # a damaged file: try the next one
                        self._note(f"{path}: tokenizer unreadable ({e})")
        return self._text


class TokenText:
    """Token ids -> the text piece of each token (joined, they give the decoded text)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def from_file(cls, path: Path) -> TokenText:
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)))

    def pieces(self, ids: list[int]) -> list[str]:
        """Each token's piece: the text it adds after the token before it (decoding a token
        alone drops the leading space of SentencePiece pieces). A character split over several
        byte tokens is given to the last of them; the others get ``""``."""
        if not ids:
            return []
        dec = self.tokenizer.decode_batch
        singles = dec([[t] for t in ids], skip_special_tokens=False)
        pairs = dec([[a, b] for a, b in zip(ids, ids[1:], strict=False)], skip_special_tokens=False)
        out = [singles[0]]
        for i in range(1, len(ids)):
            prev, both = singles[i - 1], pairs[i - 1]
            out.append(both[len(prev) :] if both.startswith(prev) else singles[i])
        i = 0
        while i < len(ids):  # byte fragments: merge until the text is whole
            if "\ufffd" not in out[i]:
                i += 1
                continue
            for j in range(i + 2, min(i + 5, len(ids)) + 1):
                text = self.tokenizer.decode(ids[i:j], skip_special_tokens=False)
                if "\ufffd" not in text:
                    out[i : j - 1] = [""] * (j - 1 - i)
                    out[j - 1] = text
                    i = j
                    break
            else:
                i += 1
        return out


def row_payload(row: RowTokens, text: TokenText | None) -> dict[str, Any]:
    """One row for the page: per token its id, piece and (for trained tokens) its values;
    ``None`` where a value does not apply (prompt tokens) or was not measured."""
    ids = row.input_ids.tolist()
    mask = row.loss_mask.astype(bool)
    n = len(ids)
    full: dict[str, list[Any]] = {
        k: [None] * n
        for k in ("version", "rollout_logprob", "trainer_logprob", "advantage", "clipped")
    }
    where = [i for i in range(n) if mask[i]]
    for name, values in (
        ("version", row.versions.tolist()),
        ("rollout_logprob", row.rollout_logprob.tolist()),
        ("trainer_logprob", row.trainer_logprob.tolist()),
        ("advantage", row.advantage.tolist()),
    ):
        col = full[name]
        for i, v in zip(where, values, strict=True):
            col[i] = None if v != v else v  # NaN: not scored
    for i, c in zip(where, row.clipped.tolist(), strict=True):
        full["clipped"][i] = None if c == NOT_SCORED else bool(c)
    return {
        "ids": ids,
        "pieces": text.pieces(ids) if text is not None else None,
        "loss_mask": mask.astype(int).tolist(),
        **full,
    }
