"""Following an append-only JSONL file that another process is writing.

A training run appends to its dumps and metrics while the viewer reads them: a read may end
in the middle of a line (the writer's ``write`` is not atomic for readers), a crashed run may
leave a line cut short for good, and a resumed run rewrites a file shorter (it drops the lines
of the steps it will redo). :class:`JsonlFile` reads only whole lines, returns each new
record with its byte offset (to re-read it later without keeping it in memory), skips lines
that do not parse (and counts them) and notices a rewritten file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson


@dataclass
class Poll:
    """What one :meth:`JsonlFile.poll` found."""

    records: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    """New records and the byte offset of each line."""
    reset: bool = False
    """The file was rewritten or truncated: drop what was read from it before; ``records``
    then holds the whole file again."""


@dataclass
class JsonlFile:
    """One JSONL file, read incrementally: :meth:`poll` returns only what was appended."""

    path: Path
    offset: int = 0
    """Bytes consumed: always the end of a complete line."""
    bad_lines: int = 0
    """Lines that were not a JSON object (a line cut short by a crash, then appended to)."""
    partial_bytes: int = 0
    """Bytes after the last complete line: a line being written, or one a crash cut short."""
    _ident: tuple[int, int] | None = None

    def poll(self) -> Poll:
        """Read the complete lines appended since the last call (none when the file is
        missing: it may not have been written yet)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            if self.offset:
                self._restart()
                return Poll(reset=True)
            return Poll()
        ident = (st.st_dev, st.st_ino)
        reset = False
        if self._ident is not None and (ident != self._ident or st.st_size < self.offset):
            reset = True
        elif self.offset and not self._line_end_at_offset():
            reset = True  # rewritten in place to at least the same size
        if reset:
            self._restart()
        self._ident = ident
        self.partial_bytes = 0
        if st.st_size == self.offset:
            return Poll(reset=reset)
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(st.st_size - self.offset)
        end = data.rfind(b"\n")
        self.partial_bytes = len(data) - end - 1
        if end < 0:
            return Poll(reset=reset)  # a line still being written
        out = Poll(reset=reset)
        pos = 0
        base = self.offset
        chunk = data[: end + 1]
        while pos < len(chunk):
            nl = chunk.index(b"\n", pos)
            line = chunk[pos:nl]
            if line.strip():
                try:
                    value = orjson.loads(line)
                except orjson.JSONDecodeError:
                    value = None
                if isinstance(value, dict):
                    out.records.append((base + pos, value))
                else:
                    self.bad_lines += 1
            pos = nl + 1
        self.offset = base + end + 1
        return out

    def _line_end_at_offset(self) -> bool:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset - 1)
                return f.read(1) == b"\n"
        except OSError:
            return False

    def _restart(self) -> None:
        self.offset = 0
        self.bad_lines = 0
        self.partial_bytes = 0
        self._ident = None


def read_line(path: Path, offset: int) -> dict[str, Any] | None:
    """The record of the line starting at ``offset`` (None if it is gone or damaged)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            line = f.readline()
    except OSError:
        return None
    try:
        value = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def read_lines(path: Path, offsets: list[int]) -> list[dict[str, Any] | None]:
    """Several lines of one file, in one open (offsets in any order)."""
    out: list[dict[str, Any] | None] = []
    try:
        with open(path, "rb") as f:
            for off in offsets:
                f.seek(off)
                try:
                    value = orjson.loads(f.readline())
                except orjson.JSONDecodeError:
                    value = None
                out.append(value if isinstance(value, dict) else None)
    except OSError:
        return [None] * len(offsets)
    return out
