"""Trainer memory: freed tensor memory goes back to the OS (``memory.tune_allocator``).

The cause of the demo's growth (5 GB after the first step, 13.8 GB at the fifth): glibc raises
its mmap threshold whenever an mmap'ed block is freed, so later 1-32 MB tensors come from heap
arenas, and a heap fragmented by small long-lived objects keeps the freed blocks resident. Each
case runs in a fresh interpreter (``mallopt`` settings are per process).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from areal_env.trainer import memory

PROBE = textwrap.dedent(
    """
    import json, sys, threading
    import torch
    from areal_env.trainer import memory
    if sys.argv[1] == "tuned":
        assert memory.tune_allocator()
    big = torch.ones(20 * 2**20 // 4)  # an mmap'ed 20 MB block freed: glibc raises its threshold
    del big
    base = memory.rss_gb()
    keep, peaks = [], []

    def step():  # a step's activations (8 MB each) between small long-lived objects
        blocks = []
        for i in range(96):
            blocks.append(torch.ones(2 * 2**20))
            keep.append(torch.ones(64))
        peaks.append(memory.rss_gb())

    for _ in range(3):  # each step in a thread of its own, as asyncio.to_thread runs them
        t = threading.Thread(target=step)
        t.start()
        t.join()
    print(json.dumps({"base": base, "peak": max(peaks), "after": memory.rss_gb()}))
    """
)


def _probe(mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator only")
def test_freed_activations_leave_the_resident_set():
    tuned, plain = _probe("tuned"), _probe("plain")
    gib = 2**30
    for r in (tuned, plain):
        assert r["peak"] - r["base"] > 0.6, r  # 768 MB were live in each step
    # untuned: every step's thread takes fresh memory (another arena) and keeps it after free
    assert plain["after"] - plain["base"] > 1.2, plain
    # tuned: the steps reuse the same memory and give it back when freed
    assert tuned["peak"] - tuned["base"] < 0.9, tuned
    assert tuned["after"] - tuned["base"] < 64 * 2**20 / gib, tuned


def test_tune_allocator_is_idempotent():
    assert memory.tune_allocator() == memory.tune_allocator()


FAULTS = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    from areal_env.trainer import memory
    assert memory.tune_allocator(int(sys.argv[1]))
    torch.ones(4 * 2**20)  # 16 MB, allocated and freed once first
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        torch.ones(4 * 2**20)  # written, then freed
    print(json.dumps(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator only")
def test_mmap_threshold_is_the_one_asked_for():
    """``trainer.malloc_mmap_threshold_mb``: under a 32 MB threshold a freed 16 MB tensor's
    memory is reused from the heap; under 2 MB every one is mapped and faulted in afresh
    (4,096 pages of 4 KB each)."""

    def faults(threshold: int) -> int:
        out = subprocess.run(
            [sys.executable, "-c", FAULTS, str(threshold)],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return int(out.stdout.strip().splitlines()[-1])

    mapped, reused = faults(2 * 2**20), faults(32 * 2**20)
    assert mapped > 20 * 2000, mapped
    assert reused < mapped / 2, (reused, mapped)
