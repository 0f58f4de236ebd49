"""Peak resident memory of this process, per interval (Linux ``VmHWM``, reset between steps).

Why per interval: ``ru_maxrss`` only ever grows, so it cannot say which step peaked. Linux resets
the high-water mark when ``5`` is written to ``/proc/self/clear_refs``; elsewhere the process-wide
peak from ``getrusage`` is reported instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
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


# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

#: Blocks at least this large are mmap'ed, so freeing them gives the pages back at once. Every
#: mmap'ed block is page-faulted in again when it is next allocated: at 256 KB (until
#: 2026-11-29) the demo actor's update spent 28 % of its CPU time in the kernel (37 million page
#: faults per three updates); at 2 MB the update is 1.24x faster for 0.4 GB more at its peak
#: (``bench/train_step.py --case allocator``; docs/training.md, "Memory").
MMAP_THRESHOLD_BYTES = 2 * 1024 * 1024
_tuned: bool | None = None


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt  # noqa: B018 - glibc only (musl has no mallopt)
        return libc
    except (OSError, AttributeError):
        return None


def tune_allocator(mmap_threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Keep freed tensor memory from piling up in glibc's heap (call once, early; idempotent).

    Why: glibc raises its mmap threshold each time an mmap'ed block is freed (up to 32 MB), so
    after the first few steps every activation, KV buffer and logits block of a training step
    (1-32 MB each) comes from the heap arenas instead. Freed heap blocks are rarely given back:
    the fragments of one step's rollout and update stay resident, and the process grew from 5 GB
    to 13.8 GB over five demo steps on the 135M model. A fixed threshold (which also turns off
    the dynamic raise) and two arenas keep the resident size at what is live.
    ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_ARENA_MAX`` in the environment take precedence.
    ``mmap_threshold_bytes`` (``trainer.malloc_mmap_threshold_mb``) trades memory for speed: the
    first call in a process sets it.
    """
    global _tuned
    if _tuned is not None:
        return _tuned
    libc = _libc()
    if libc is None:
        _tuned = False
        return False
    ok = True
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold_bytes)) and ok
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        ok = bool(libc.mallopt(_M_TRIM_THRESHOLD, 64 * 1024 * 1024)) and ok
    if "MALLOC_ARENA_MAX" not in os.environ:
        ok = bool(libc.mallopt(_M_ARENA_MAX, 2)) and ok
    if not ok:
        logger.warning("mallopt refused a setting: memory may grow with fragmentation")
    _tuned = ok
    return ok


def release_free_memory() -> None:
    """Give the heap's free pages back to the OS (``malloc_trim``); cheap, between steps."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


__all__ = [
    "peak_rss_gb",
    "process_peak_rss_gb",
    "release_free_memory",
    "reset_peak",
    "rss_gb",
    "tune_allocator",
]
