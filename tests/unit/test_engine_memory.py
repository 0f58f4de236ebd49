"""Engine memory: replaced KV buffers are freed at once, not when the cyclic GC gets to them."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref

import torch

from areal_env.api.io import GenerationConfig, ModelRequest
from areal_env.engine import kv_cache
from areal_env.engine.kv_cache import BatchKV


def test_batch_kv_is_freed_by_reference_counting():
    kv = torch.zeros(2, 2, 3, 1, 5, 4)
    mask = torch.ones(3, 5, dtype=torch.bool)
    old = BatchKV.merge(None, kv, mask)
    ref = weakref.ref(old)
    gc.disable()
    try:
        new = BatchKV.merge(old, kv, mask)  # a row set joining: a new buffer replaces the old
        del old
        assert ref() is None  # no reference cycle keeps the old buffer alive
        assert new.cache.layers[0].owner is new
    finally:
        gc.enable()


def test_engine_holds_no_dead_batch_buffers(engine, tokenizer, monkeypatch):
    """Requests joining and leaving a running batch (merges, selects) leave no garbage behind."""
    made: list[weakref.ref] = []
    joined_running = 0
    real_init, real_merge = BatchKV.__init__, BatchKV.merge.__func__

    def tracking_init(self, *a, **k):
        real_init(self, *a, **k)
        made.append(weakref.ref(self))

    def tracking_merge(cls, old, *a, **k):
        nonlocal joined_running
        joined_running += old is not None
        kv = real_merge(cls, old, *a, **k)
        made.append(weakref.ref(kv.storage))  # each storage it allocated or kept
        return kv

    monkeypatch.setattr(kv_cache.BatchKV, "__init__", tracking_init)
    monkeypatch.setattr(kv_cache.BatchKV, "merge", classmethod(tracking_merge))
    prompts = [tokenizer(f"Tell me about the number {i}.")["input_ids"] for i in range(6)]

    async def staggered():
        async def one(i):
            # the first request runs long; the others join its running batch one by one
            await asyncio.sleep(0.4 * i)
            g = GenerationConfig(max_new_tokens=48 if i == 0 else 3, greedy=True, ignore_eos=True)
            return await engine.agenerate(ModelRequest(prompts[i], g))

        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    gc.disable()
    try:
        asyncio.run(staggered())
        assert joined_running >= 2  # rows joined (and left) a running batch
        # the worker answers the last request just before it drops the batch: give it a moment
        deadline = time.monotonic() + 5
        while any(r() is not None for r in made) and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = [r for r in made if r() is not None]
        assert alive == [], f"{len(alive)} batch KV objects or buffers still alive, engine idle"
    finally:
        gc.enable()


def test_rows_join_and_leave_in_place_and_keep_their_values():
    """A joining row goes into a spare row and a leaving row's slot is filled from the end: the
    storage is reused, and every live row keeps its keys/values and mask."""
    L, H, D = 2, 1, 3

    def rows(n: int, T: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
        kv = torch.arange(L * 2 * n * H * T * D, dtype=torch.float32).reshape(L, 2, n, H, T, D)
        return kv + base, torch.ones(n, T, dtype=torch.bool)

    a, ma = rows(2, 5, 0.0)
    kv = BatchKV.merge(None, a, ma, max_rows=8)
    storage = kv.storage
    b, mb = rows(3, 7, 1000.0)  # longer rows: the window widens to the left, in place
    kv2 = BatchKV.merge(kv, b, mb, max_rows=8)
    assert kv2 is kv and kv.storage is storage and kv.batch_size == 5 and kv.length == 7
    live = kv.buf[..., kv.start : kv.start + kv.length, :]
    assert torch.equal(live[:, :, :2, :, 2:], a) and torch.equal(live[:, :, 2:], b)
    assert (live[:, :, :2, :, :2] == 0).all()  # the old rows' new padding is zeroed
    assert kv.mask[:2].tolist() == [[False, False] + [True] * 5] * 2

    keep = BatchKV.fill_order([0, 2, 4])  # rows 1 and 3 leave: row 4 fills slot 1
    assert keep == [0, 4, 2]
    expect = live.index_select(2, torch.tensor(keep)).clone()
    kv.select(keep)
    assert kv.storage is storage and kv.batch_size == 3
    assert torch.equal(kv.buf[..., kv.start : kv.start + kv.length, :], expect)

    kv.select(BatchKV.fill_order([1, 2]))  # the short row leaves: its padding columns go
    assert kv.length == 7 and kv.mask.all()
    kv.select(BatchKV.fill_order([0]))
    big, mbig = rows(8, 4, 5.0)  # more rows than are spare: a new, larger storage
    kv3 = BatchKV.merge(kv, big, mbig, max_rows=8)
    assert kv3 is not kv and kv3.batch_size == 9 and kv3.row_capacity == 9
