"""Logging for the package's command lines: progress and results on the console, the rest in
the run's log file.

Why: httpx logs every request at INFO (health probes, weight pushes), httpx2 (the MCP client's
HTTP library) every MCP tool call, mcp's client every reconnect of an idle stream, uvicorn every
access, the proxy every expired idle session: thousands of lines per training run that bury the
trainer's own progress and break its progress bars. Their warnings and errors still show.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from pathlib import Path

NOISY_HTTP_LOGGERS = ("httpx", "httpx2", "httpcore")
"""Loggers that report each HTTP request at INFO."""

PROGRESS_LOGGERS = ("areal_env.trainer.ppo", "areal_env.trainer.eval", "train_aenv")
"""Loggers whose INFO lines are a run's progress (steps, evaluations): shown on the console
when everything else at INFO goes to the log file only."""

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_console_logging(quiet: Iterable[str] = ()) -> None:
    """INFO to stderr with timestamps (a no-op for the root handler if one is set already);
    ``NOISY_HTTP_LOGGERS`` and ``quiet`` log only warnings."""
    logging.basicConfig(level=logging.INFO, format=_FORMAT)
    for name in (*NOISY_HTTP_LOGGERS, *quiet):
        logging.getLogger(name).setLevel(logging.WARNING)


class _ConsoleFilter(logging.Filter):
    """Warnings and errors of every logger; INFO of the progress loggers only."""

    def __init__(self, progress: tuple[str, ...]) -> None:
        super().__init__()
        self.progress = progress

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        return any(record.name == p or record.name.startswith(p + ".") for p in self.progress)


class _TqdmHandler(logging.Handler):
    """Writes through ``tqdm.write`` so a log line never tears a progress bar; to the
    ``sys.stderr`` of the moment (a stream captured when the handler was made may be closed
    by now: test runners swap it per test)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm.auto import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # pragma: no cover - logging must never raise
            self.handleError(record)


def configure_run_logging(
    log_file: str | os.PathLike[str],
    *,
    progress: Iterable[str] = PROGRESS_LOGGERS,
    quiet: Iterable[str] = (),
) -> Path:
    """Everything at INFO into ``log_file`` (appended); on the console, warnings and errors and
    the INFO lines of the ``progress`` loggers, written so they never tear a progress bar.
    ``NOISY_HTTP_LOGGERS`` and ``quiet`` log only warnings, in the file too. Returns the file.
    Replaces handlers an earlier call installed (safe to call once per run)."""
    path = Path(log_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_areal_env_run_logging", False):
            root.removeHandler(h)
            h.close()
    root.setLevel(logging.INFO)
    formatter = logging.Formatter(_FORMAT)
    to_file = logging.FileHandler(path, encoding="utf-8")
    to_file.setFormatter(formatter)
    console = _TqdmHandler()
    console.setFormatter(formatter)
    console.addFilter(_ConsoleFilter(tuple(progress)))
    handlers: list[logging.Handler] = [to_file, console]
    for h in handlers:
        setattr(h, "_areal_env_run_logging", True)  # noqa: B010 - a marker on a library class
        root.addHandler(h)
    for h in root.handlers:  # a basicConfig handler from before would print everything again
        if not getattr(h, "_areal_env_run_logging", False):
            root.removeHandler(h)
    for name in (*NOISY_HTTP_LOGGERS, *quiet):
        logging.getLogger(name).setLevel(logging.WARNING)
    return path
