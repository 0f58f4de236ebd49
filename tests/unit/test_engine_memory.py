"""Engine memory: replaced KV buffers are freed at once, not when the cyclic GC gets to them."""

from __future__ import annotations

import asyncio
import gc
import weakref

import torch

from areal_env.api.io import GenerationConfig, ModelRequest
from areal_env.engine import _kv
from areal_env.engine._kv import BatchKV


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
    real_init = BatchKV.__init__

    def tracking_init(self, *a, **k):
        real_init(self, *a, **k)
        made.append(weakref.ref(self))

    monkeypatch.setattr(_kv.BatchKV, "__init__", tracking_init)
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
        assert len(made) >= 2
        alive = [r for r in made if r() is not None]
        assert alive == [], f"{len(alive)} BatchKV objects still alive with the engine idle"
    finally:
        gc.enable()
