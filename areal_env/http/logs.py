"""Console logging for the package's command lines: one format, HTTP libraries kept quiet.

Why: httpx logs every request at INFO (health probes, weight pushes), httpx2 (the MCP client's
HTTP library) every MCP tool call, uvicorn every access: thousands of lines per training run that
bury the trainer's own progress. Their warnings and errors still show.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

NOISY_HTTP_LOGGERS = ("httpx", "httpx2", "httpcore")
"""Loggers that report each HTTP request at INFO."""


def configure_console_logging(quiet: Iterable[str] = ()) -> None:
    """INFO to stderr with timestamps (a no-op for the root handler if one is set already);
    ``NOISY_HTTP_LOGGERS`` and ``quiet`` log only warnings."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for name in (*NOISY_HTTP_LOGGERS, *quiet):
        logging.getLogger(name).setLevel(logging.WARNING)


__all__ = ["NOISY_HTTP_LOGGERS", "configure_console_logging"]
