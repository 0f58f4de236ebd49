"""The runs a viewer serves: one run folder, or every run folder under an outputs folder.

``fileroot/experiment/trial`` is a run folder (see ``areal_env.trainer.stats``); the viewer
given ``fileroot`` finds them all, and new ones as they start (re-scanned at most every
``scan_interval`` seconds). A run's id is its path relative to the folder given (``.`` when
the folder given is the run itself); requests name runs by id only, never by path.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from areal_env.view.evals import EvalStore
from areal_env.view.run import RunIndex, is_run_dir

# Folders a run writes that never hold other runs: not searched.
_RUN_CONTENT = {"rollout", "tokens", "checkpoints", "tensorboard", "eval-rollout", "weights"}
MAX_DEPTH = 4


class Catalog:
    """Run folders under ``root`` and their indexes (built on first use)."""

    def __init__(
        self, root: Path, *, refresh_interval: float = 1.0, scan_interval: float = 5.0
    ) -> None:
        self.root = root
        self.refresh_interval = refresh_interval
        self.scan_interval = scan_interval
        self._lock = threading.Lock()
        self._runs: dict[str, RunIndex] = {}
        self._evals: dict[str, EvalStore] = {}
        self._ids: list[str] = []
        self._scanned = -float("inf")

    def _scan_dirs(self) -> list[str]:
        found: list[str] = []

        def walk(folder: Path, depth: int) -> None:
            try:
                entries = sorted(os.scandir(folder), key=lambda e: e.name)
            except OSError:
                return
            for e in entries:
                if not e.is_dir(follow_symlinks=False) or e.name.startswith("."):
                    continue
                sub = Path(e.path)
                if is_run_dir(sub):
                    found.append(sub.relative_to(self.root).as_posix())
                elif depth < MAX_DEPTH and e.name not in _RUN_CONTENT:
                    walk(sub, depth + 1)

        walk(self.root, 1)
        return found

    def ids(self) -> list[str]:
        with self._lock:
            now = time.monotonic()
            if now - self._scanned >= self.scan_interval:
                self._scanned = now
                self._ids = ["."] if is_run_dir(self.root) else self._scan_dirs()
            return list(self._ids)

    def run(self, run_id: str) -> RunIndex | None:
        """The run with this id (``None``: no such run under the root)."""
        ids = self.ids()
        if run_id not in ids and not (run_id == "." and not ids):
            return None
        with self._lock:
            run = self._runs.get(run_id)
            if run is None:
                path = self.root if run_id == "." else self.root / run_id
                run = self._runs[run_id] = RunIndex(
                    run_id, path, refresh_interval=self.refresh_interval
                )
                self._evals[run_id] = EvalStore(run.eval_dir())
        run.refresh()
        return run

    def warm(self) -> None:
        """Index every run now (the first read of a big run takes a second or two: better at
        start-up, in the background, than on the first page someone opens)."""
        for run_id in self.ids():
            self.run(run_id)

    def evals(self, run_id: str) -> EvalStore | None:
        if self.run(run_id) is None:
            return None
        with self._lock:
            return self._evals.get(run_id)
