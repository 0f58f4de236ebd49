"""One run folder, indexed for the viewer and kept up to date while the run trains.

What a run leaves (see ``areal_env.trainer.stats``): ``metrics.jsonl``, ``eval.jsonl``,
``config.yaml``, ``rollout/{version}/{task}.jsonl`` (one line per completion, or per rejected
episode, or per external session), ``eval-rollout/{version}/`` and ``tokens/``. The index keeps
only what lists and filters need (ids, step, group, rewards, counts) and where each line
starts; a conversation is read from its lines when it is opened. :meth:`RunIndex.refresh`
reads only what was appended since the last call, at most once per ``refresh_interval``.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from areal_env.view.jsonl import JsonlFile, read_lines
from areal_env.view.tokens import TokenRecords

logger = logging.getLogger(__name__)

RUN_MARKERS = ("metrics.jsonl", "config.yaml", "rollout", "eval.jsonl", "tokens", "checkpoints")
"""Entries whose presence makes a folder a run folder."""


def is_run_dir(path: Path) -> bool:
    return any((path / m).exists() for m in RUN_MARKERS)


def reward_value(reward: Any) -> float | None:
    """An episode's reward as one number: a float as is, per-completion rewards by their mean
    (None: no reward, e.g. a rejected episode)."""
    if isinstance(reward, bool):
        return float(reward)
    if isinstance(reward, int | float):
        return float(reward) if math.isfinite(reward) else None
    if isinstance(reward, dict):
        values = [float(v) for v in reward.values() if isinstance(v, int | float)]
        return sum(values) / len(values) if values else None
    return None


@dataclass
class SessionInfo:
    """One episode (an agent session) of a step: what lists show, and where its lines are."""

    session_id: str
    step: int
    version: int | None
    task_id: str
    group: str
    traj_index: int | None
    accepted: bool | None
    reason: str | None
    reward: float | None
    external: bool = False
    completions: int = 0
    output_tokens: int = 0
    tool_calls: int = 0
    failed_tool_calls: int = 0
    error: str | None = None
    lines: list[tuple[int, int]] = field(default_factory=list)
    """(file number, byte offset) of each of its dump lines."""

    def summary(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "step": self.step,
            "version": self.version,
            "task_id": self.task_id,
            "group": self.group,
            "traj_index": self.traj_index,
            "accepted": self.accepted,
            "reason": self.reason,
            "reward": self.reward,
            "completions": self.completions,
            "output_tokens": self.output_tokens,
            "tool_calls": self.tool_calls,
            "failed_tool_calls": self.failed_tool_calls,
            "error": self.error,
        }


def natural_key(text: str) -> tuple[Any, ...]:
    """``task-2`` before ``task-10``: digit runs compare as numbers."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", text))


@dataclass
class StepInfo:
    """A step's episodes, in dump order, and grouped."""

    step: int
    sessions: list[str] = field(default_factory=list)
    groups: dict[str, list[str]] = field(default_factory=dict)
    versions: set[int] = field(default_factory=set)
    _order: tuple[int, list[str], list[str]] | None = None

    def ordered(self, sessions: dict[str, SessionInfo]) -> tuple[list[str], list[str]]:
        """(session ids, group ids) in a stable reading order: by task (``task-2`` before
        ``task-10``), then group, then member; dump files are per task, so the order they are
        read in says nothing."""
        if self._order is None or self._order[0] != len(self.sessions):

            def key(sid: str) -> tuple[Any, ...]:
                s = sessions[sid]
                traj = s.traj_index if isinstance(s.traj_index, int) else -1
                return (natural_key(s.task_id), s.group, traj, sid)

            ordered = sorted(self.sessions, key=key)
            groups = list(dict.fromkeys(sessions[s].group for s in ordered))
            self._order = (len(self.sessions), ordered, groups)
        return self._order[1], self._order[2]


def _count_tool_calls(line: dict[str, Any]) -> tuple[int, int]:
    """(tool calls made, of which failed: unparsable or naming no offered tool)."""
    names = line.get("tool_calls") or []
    n = len(names) if isinstance(names, list) else 0
    valid = line.get("valid_tool_calls")
    bad = (n - int(valid) if isinstance(valid, int) else 0) + bool(line.get("tool_parse_error"))
    return n, max(0, bad)


class RunIndex:
    """A run folder's files, indexed; thread-safe (one lock; the server answers from threads)."""

    def __init__(self, run_id: str, path: Path, *, refresh_interval: float = 1.0) -> None:
        self.id = run_id
        self.path = path
        self.refresh_interval = refresh_interval
        self._lock = threading.RLock()
        self._last_refresh = -math.inf
        self.metrics_file = JsonlFile(path / "metrics.jsonl")
        self.eval_file = JsonlFile(path / "eval.jsonl")
        self.metrics: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.tokens = TokenRecords(path)
        self._files: list[JsonlFile] = []
        self._file_no: dict[Path, int] = {}
        self.steps: dict[int, StepInfo] = {}
        self.sessions: dict[str, SessionInfo] = {}
        self.updated = 0.0
        """The newest modification time seen among the run's files."""

    # ---- refreshing --------------------------------------------------------------------------

    def refresh(self, force: bool = False) -> None:
        with self._lock:
            now = time.monotonic()
            if not force and now - self._last_refresh < self.refresh_interval:
                return
            self._last_refresh = now
            self._refresh_metrics()
            self._refresh_rollout()
            self.tokens.refresh()

    def _refresh_metrics(self) -> None:
        for jf, target in ((self.metrics_file, self.metrics), (self.eval_file, self.evals)):
            poll = jf.poll()
            if poll.reset:
                target.clear()
            target.extend(rec for _, rec in poll.records)
            self._touch(jf.path)
        self.metrics.sort(key=lambda r: r.get("step", 0))

    def _touch(self, path: Path) -> None:
        try:
            self.updated = max(self.updated, path.stat().st_mtime)
        except OSError:
            pass

    def _rollout_files(self) -> list[Path]:
        root = self.path / "rollout"
        out: list[Path] = []
        try:
            versions = list(os.scandir(root))
        except OSError:
            return out
        for v in versions:
            if not v.is_dir():
                continue
            try:
                out += [Path(f.path) for f in os.scandir(v.path) if f.name.endswith(".jsonl")]
            except OSError:
                continue
        return sorted(out)

    def _refresh_rollout(self) -> None:
        rebuild = False
        polls = []
        for path in self._rollout_files():
            no = self._file_no.get(path)
            if no is None:
                no = self._file_no[path] = len(self._files)
                self._files.append(JsonlFile(path))
            poll = self._files[no].poll()
            rebuild = rebuild or poll.reset
            polls.append((no, poll))
        gone = [p for p in self._file_no if not p.exists()]
        if gone or rebuild:  # a resumed run rewrote its dumps: index them again
            self._file_no.clear()
            self._files.clear()
            self.steps.clear()
            self.sessions.clear()
            self._refresh_rollout()
            return
        for no, poll in polls:
            if poll.records:
                self._touch(self._files[no].path)
            for offset, rec in poll.records:
                self._add_line(no, offset, rec)

    def _add_line(self, file_no: int, offset: int, rec: dict[str, Any]) -> None:
        step = int(rec.get("step") or 0)
        task = str(rec.get("task_id") if rec.get("task_id") is not None else "unknown")
        external = "interactions" in rec and "interaction_id" not in rec
        sid = rec.get("session_id")
        if not sid:  # rejected before its session opened
            sid = f"episode-{step}-{file_no}-{offset}"
        info = self.sessions.get(sid)
        if info is None:
            group = rec.get("group_id") or rec.get("group_key") or sid
            reward = rec.get("final_reward") if external else rec.get("episode_reward")
            accepted = rec.get("accepted")
            if external and accepted is None:  # dumps from before episodes said so
                accepted = rec.get("status") in (None, "finalized", "completed", "trained")
            version = rec.get("version")
            info = SessionInfo(
                session_id=sid,
                step=step,
                version=int(version) if isinstance(version, int) else None,
                task_id=task,
                group=str(group),
                traj_index=rec.get("traj_index"),
                accepted=accepted,
                reason=rec.get("reason") or (rec.get("status") if external else None),
                reward=reward_value(reward),
                external=external,
                error=rec.get("error"),
            )
            self.sessions[sid] = info
            st = self.steps.setdefault(step, StepInfo(step))
            st.sessions.append(sid)
            st.groups.setdefault(info.group, []).append(sid)
            if info.version is not None:
                st.versions.add(info.version)
        info.lines.append((file_no, offset))
        its = rec.get("interactions") if external else ([rec] if rec.get("interaction_id") else [])
        for it in its or []:
            info.completions += 1
            info.output_tokens += int(it.get("completion_len") or it.get("num_output_tokens") or 0)
            n, bad = _count_tool_calls(it)
            info.tool_calls += n
            info.failed_tool_calls += bad

    # ---- reading -----------------------------------------------------------------------------

    def session_lines(self, info: SessionInfo) -> list[dict[str, Any]]:
        """The dump lines of a session (lines that vanished since indexing are left out)."""
        by_file: dict[int, list[int]] = {}
        for no, off in info.lines:
            by_file.setdefault(no, []).append(off)
        out: list[dict[str, Any]] = []
        with self._lock:
            files = {no: self._files[no].path for no in by_file if no < len(self._files)}
        for no, offs in by_file.items():
            if no in files:
                out += [x for x in read_lines(files[no], offs) if x is not None]
        return out

    def config_text(self) -> str | None:
        try:
            return (self.path / "config.yaml").read_text()
        except (OSError, UnicodeDecodeError):
            return None

    def config(self) -> dict[str, Any]:
        text = self.config_text()
        if not text:
            return {}
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError:
            return {}
        return data if isinstance(data, dict) else {}

    def checkpoints(self) -> list[str]:
        root = self.path / "checkpoints"
        try:
            names = [d.name for d in os.scandir(root) if d.is_dir() and d.name.startswith("step_")]
        except OSError:
            return []
        return sorted(names, key=lambda n: int(n[5:]) if n[5:].isdigit() else -1)

    def warnings(self) -> list[str]:
        """What is off about the folder, in words (cut lines, damaged records)."""
        out = []
        for jf in (self.metrics_file, self.eval_file, *self._files):
            rel = jf.path.relative_to(self.path)
            if jf.bad_lines:
                out.append(f"{rel}: {jf.bad_lines} line(s) are not JSON (cut short?) and skipped")
            if jf.partial_bytes:
                out.append(
                    f"{rel}: ends in a partial line ({jf.partial_bytes} bytes): being written, "
                    "or cut short by a crash"
                )
        out += self.tokens.errors
        if not is_run_dir(self.path):
            out.append("this folder holds no run files (yet)")
        return out

    def status(self) -> dict[str, Any]:
        """Where the run stands: steps done of the configured total, and whether its files
        changed lately (``live``: it is probably still training)."""
        cfg = self.config()
        total = (cfg.get("trainer") or {}).get("total_train_steps")
        last = self.metrics[-1]["step"] if self.metrics else 0
        age = time.time() - self.updated if self.updated else None
        return {
            "last_step": last,
            "total_steps": total,
            "updated": self.updated or None,
            "age_s": age,
            "live": age is not None and age < 120 and not (total and last >= total),
        }

    def eval_dir(self) -> Path:
        return self.path / "eval-rollout"


def load_json(path: Path) -> Any:
    try:
        return orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
