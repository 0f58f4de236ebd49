"""Peak resident memory of this process, per interval (Linux ``VmHWM``, reset between steps).

Why per interval: ``ru_maxrss`` only ever grows, so it cannot say which step peaked. Linux resets
the high-water mark when ``5`` is written to ``/proc/self/clear_refs``; elsewhere the process-wide
peak from ``getrusage`` is reported instead.
"""

from __future__ import annotations

import logging
import resource
import sys

logger = logging.getLogger(__name__)

_GIB = 1024**3


def reset_peak() -> bool:
    """Start a new measurement interval; False where the peak cannot be reset."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _proc_status_gb(field: str) -> float | None:
    """A ``/proc/self/status`` memory line (``VmHWM``, ``VmRSS``) in GiB; None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024 / _GIB
    except OSError:
        pass
    return None


def peak_rss_gb() -> float:
    """Peak resident set size (GiB) since the last :func:`reset_peak` (or process start)."""
    peak = _proc_status_gb("VmHWM")
    if peak is not None:
        return peak
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / _GIB if sys.platform == "darwin" else rss * 1024 / _GIB


def rss_gb() -> float:
    """Current resident set size (GiB)."""
    return _proc_status_gb("VmRSS") or 0.0


def process_peak_rss_gb() -> float:
    """Peak resident set size (GiB) of the whole process lifetime (never reset)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / _GIB if sys.platform == "darwin" else rss * 1024 / _GIB


__all__ = ["peak_rss_gb", "process_peak_rss_gb", "reset_peak", "rss_gb"]
