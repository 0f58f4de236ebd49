"""Held-out evaluations of a run, side by side: per problem, before vs after.

Reads what ``areal_env.trainer.eval`` writes: ``eval.jsonl`` (one line of metrics per
evaluation), ``eval-rollout/{version}/summary.json`` (per-task outcomes) and
``eval-rollout/{version}/{task}.jsonl`` (the episode's completions). An evaluation's files are
written once; they are cached by their sizes and modification times.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_env.trainer.eval import paired_p_value
from areal_env.view.jsonl import JsonlFile
from areal_env.view.run import load_json, reward_value
from areal_env.view.tree import build_tree

FILTERS = ("all", "gained", "lost", "changed", "failed_tool_calls", "rejected")


@dataclass
class EvalSet:
    """One evaluation: its summary and each task's dump lines."""

    version: int
    step: int | None
    metrics: dict[str, Any]
    outcomes: dict[str, bool]
    rewards: dict[str, float]
    episodes: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def _stamp(folder: Path) -> tuple[tuple[str, int, float], ...]:
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return ()
    return tuple(
        sorted((e.name, e.stat().st_size, e.stat().st_mtime) for e in entries if e.is_file())
    )


class EvalStore:
    """The evaluations of one run folder."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._cache: dict[int, tuple[Any, EvalSet]] = {}

    def versions(self) -> list[int]:
        try:
            names = [d.name for d in os.scandir(self.root) if d.is_dir()]
        except OSError:
            return []
        return sorted(int(n) for n in names if n.lstrip("-").isdigit())

    def load(self, version: int) -> EvalSet | None:
        folder = self.root / str(version)
        stamp = _stamp(folder)
        if not stamp:
            return None
        hit = self._cache.get(version)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        summary = load_json(folder / "summary.json") or {}
        episodes: dict[str, list[dict[str, Any]]] = {}
        for name, _, _ in stamp:
            if not name.endswith(".jsonl"):
                continue
            for _, rec in JsonlFile(folder / name).poll().records:
                episodes.setdefault(str(rec.get("task_id") or "unknown"), []).append(rec)
        outcomes = dict(summary.get("outcomes") or {})
        rewards = dict(summary.get("rewards") or {})
        for task, lines in episodes.items():  # a summary not written yet: from the lines
            if task not in outcomes and lines and lines[0].get("success") is not None:
                outcomes[task] = bool(lines[0]["success"])
            if task not in rewards and lines:
                value = reward_value(lines[0].get("episode_reward"))
                if value is not None:
                    rewards[task] = value
        ev = EvalSet(
            version=version,
            step=summary.get("step"),
            metrics=dict(summary.get("metrics") or {}),
            outcomes=outcomes,
            rewards=rewards,
            episodes=episodes,
        )
        self._cache[version] = (stamp, ev)
        return ev


def _side(ev: EvalSet | None, task: str, full: bool) -> dict[str, Any] | None:
    if ev is None:
        return None
    lines = ev.episodes.get(task)
    if lines is None and task not in ev.outcomes:
        return None
    lines = lines or []
    first = lines[0] if lines else {}
    nodes = build_tree(lines)
    last = nodes[-1] if nodes else None
    out = {
        "success": ev.outcomes.get(task),
        "reward": ev.rewards.get(task),
        "accepted": first.get("accepted"),
        "reason": first.get("reason"),
        "error": first.get("error"),
        "turns": len(nodes),
        "reply": last["completion"] if last else None,
        "reply_calls": last["calls"] if last else [],
        "tool_calls": sum(len(n["calls"]) for n in nodes),
        "failed_tool_calls": sum(n["failed_tool_calls"] for n in nodes),
    }
    if full:
        out["nodes"] = nodes
    return out


def _keep(flt: str, b: dict[str, Any] | None, a: dict[str, Any] | None) -> bool:
    sb = bool(b and b["success"])
    sa = bool(a and a["success"])
    if flt == "gained":
        return sa and not sb
    if flt == "lost":
        return sb and not sa
    if flt == "changed":
        return (b or {}).get("reply") != (a or {}).get("reply")
    if flt == "failed_tool_calls":
        return any(s is not None and s["failed_tool_calls"] > 0 for s in (b, a))
    if flt == "rejected":
        return any(s is not None and s["accepted"] is False for s in (b, a))
    return True


def compare(
    before: EvalSet | None,
    after: EvalSet | None,
    *,
    flt: str = "all",
    offset: int = 0,
    limit: int = 50,
    task: str | None = None,
) -> dict[str, Any]:
    """The per-problem table of two evaluations (``before`` may be None: one evaluation),
    filtered and paged; ``task``: only that problem, with both conversations in full."""
    if flt not in FILTERS:
        raise ValueError(f"unknown filter {flt!r}; one of {', '.join(FILTERS)}")
    tasks: list[str] = []
    for ev in (before, after):
        if ev is not None:
            for t in [*ev.outcomes, *ev.episodes]:
                if t not in tasks:
                    tasks.append(t)
    if task is not None:
        tasks = [t for t in tasks if t == task]
    rows = []
    for t in tasks:
        b, a = _side(before, t, task is not None), _side(after, t, task is not None)
        if _keep(flt, b, a):
            rows.append({"task_id": t, "before": b, "after": a})
    counts: dict[str, int] = {}
    if before is not None and after is not None:
        shared = before.outcomes.keys() & after.outcomes.keys()
        counts = {
            "shared": len(shared),
            "gained": sum(1 for t in shared if after.outcomes[t] and not before.outcomes[t]),
            "lost": sum(1 for t in shared if before.outcomes[t] and not after.outcomes[t]),
        }
        p: float | None = paired_p_value(before.outcomes, after.outcomes)
    else:
        p = None
    return {
        "before": None if before is None else _meta(before),
        "after": None if after is None else _meta(after),
        "counts": counts,
        "p_value": p,
        "filter": flt,
        "total": len(rows),
        "offset": offset,
        "items": rows[offset : offset + limit],
    }


def _meta(ev: EvalSet) -> dict[str, Any]:
    n = len(ev.outcomes)
    return {
        "version": ev.version,
        "step": ev.step,
        "n": n,
        "success_rate": sum(ev.outcomes.values()) / n if n else None,
        "metrics": ev.metrics,
    }
