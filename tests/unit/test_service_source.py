"""ExternalTrajectorySource: grouping across producers, waking on completion, staleness."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from areal_env.service.source import ExternalTrajectorySource, SourceClosedError
from tests.fixtures.batches import as_tensors, episode_dicts


def export(reward: float, version: int = 0, prompt: int = 3, out: int = 2, rows: int = 1) -> dict:
    row = {
        "input_ids": list(range(1, prompt + out + 1)),
        "loss_mask": [0] * prompt + [1] * out,
        "logprobs": [0.0] * prompt + [-0.5] * out,
        "versions": [-1] * prompt + [version] * out,
        "reward": reward,
    }
    return {"trajectories": {f"r{i}": dict(row) for i in range(rows)}, "interactions": []}


async def test_groups_form_by_group_id_and_batch_has_executor_shape():
    src = ExternalTrajectorySource(n_samples=2, batch_size=2, max_head_offpolicyness=0)
    src.put(export(1.0), "a")
    src.put(export(0.0), "b")
    src.put(export(0.0, rows=2), "a")
    assert src.num_ready_groups == 1
    src.put(export(1.0), "b")
    batch, stats = as_tensors(await src.rollout_batch(trainer_version=0, timeout=5))
    assert batch is not None
    assert batch["input_ids"].shape == (5, 5)
    assert batch["group_ids"].tolist() == [0, 0, 0, 1, 1]
    assert len(set(batch["traj_ids"].tolist())) == 4
    assert batch["versions"][0].tolist() == [-1, -1, -1, 0, 0]
    assert stats["groups/accepted"] == 2 and stats["episodes/accepted"] == 4
    assert stats["reward/mean"] == pytest.approx(0.5)
    assert len(episode_dicts(src.last_batch)) == 4


async def test_waits_without_polling_and_wakes_on_put_from_another_thread():
    src = ExternalTrajectorySource(n_samples=2, batch_size=1)
    task = asyncio.create_task(src.rollout_batch(trainer_version=0))
    await asyncio.sleep(0.1)
    assert not task.done()

    def producer() -> None:
        src.put(export(1.0))  # no group id: consecutive sessions form a group
        time.sleep(0.05)
        src.put(export(0.0))

    t0 = time.monotonic()
    threading.Thread(target=producer).start()
    batch, stats = as_tensors(await asyncio.wait_for(task, 5))
    assert time.monotonic() - t0 < 2
    assert batch["group_ids"].tolist() == [0, 0]
    assert stats["groups/zero_variance"] == 0


async def test_stale_trajectories_and_failures_are_dropped_and_counted():
    src = ExternalTrajectorySource(
        n_samples=2, batch_size=1, max_head_offpolicyness=1, stale_trajectories="drop"
    )
    src.put_failed("g", "agent crashed")  # does not count towards the group
    src.put(export(1.0, version=1), "g")
    src.put(export(0.0, version=3), "g")
    batch, stats = as_tensors(await src.rollout_batch(trainer_version=3, timeout=5))
    assert batch["input_ids"].shape[0] == 1  # version 1 is 2 behind 3 > 1
    assert stats["rejected/stale"] == 1 and stats["rejected/failed"] == 1
    assert stats["staleness/max"] == 0


async def test_stale_trajectories_are_trained_and_counted_by_default():
    """A group that waited for a retried member: its older member is past the bound, and is
    trained (it was acknowledged) with its staleness counted, not dropped."""
    src = ExternalTrajectorySource(n_samples=2, batch_size=1, max_head_offpolicyness=1)
    src.put_failed("g", "the service restarted while the session was open")
    src.put(export(1.0, version=1), "g")
    src.put(export(0.0, version=3), "g")
    batch, stats = as_tensors(await src.rollout_batch(trainer_version=3, timeout=5))
    assert batch["input_ids"].shape[0] == 2 and batch["group_ids"].tolist() == [0, 0]
    assert stats["rejected/stale"] == 0 and stats["groups/incomplete"] == 0
    assert stats["staleness/over_bound"] == 1 and stats["staleness/max"] == 2
    with pytest.raises(ValueError, match="'train' or 'drop'"):
        ExternalTrajectorySource(n_samples=1, stale_trajectories="keep")


async def test_timeout_returns_none_and_incomplete_groups_expire():
    src = ExternalTrajectorySource(n_samples=3, batch_size=1, group_timeout=0.3)
    batch, _ = as_tensors(await src.rollout_batch(trainer_version=0, timeout=0.1))
    assert batch is None
    src.put(export(1.0), "x")
    src.put(export(0.5), "x")
    batch, stats = as_tensors(await src.rollout_batch(trainer_version=0, timeout=5))
    assert batch["input_ids"].shape[0] == 2 and stats["groups/incomplete"] == 1


async def test_close_wakes_waiters_and_cancel_keeps_groups():
    src = ExternalTrajectorySource(n_samples=1, batch_size=2)
    src.put(export(1.0), "kept")
    task = asyncio.create_task(src.rollout_batch(trainer_version=0))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert src.num_ready_groups == 1
    task = asyncio.create_task(src.rollout_batch(trainer_version=0))
    await asyncio.sleep(0.05)
    src.close()
    with pytest.raises(SourceClosedError):
        await asyncio.wait_for(task, 5)
    with pytest.raises(SourceClosedError):
        src.put(export(1.0))


async def test_executor_prefetch_interface():
    src = ExternalTrajectorySource(n_samples=1, batch_size=4)
    for r in (0.0, 1.0, 0.5):
        src.put(export(r))
    batch, stats = as_tensors(await src.next_batch(trainer_version=0, batch_size=3, timeout=5))
    assert batch["group_ids"].tolist() == [0, 1, 2] and stats["groups/accepted"] == 3
    await src.aclose()


def _take_batch_in_another_loop(src: ExternalTrajectorySource) -> threading.Thread:
    """The trainer's side: take a batch from its own thread and event loop."""
    thread = threading.Thread(
        target=lambda: asyncio.run(src.rollout_batch(trainer_version=src.get_version(), timeout=5))
    )
    thread.start()
    return thread


async def test_admission_bounds_sessions_by_staleness_and_wakes_on_version():
    src = ExternalTrajectorySource(
        n_samples=2, batch_size=1, max_head_offpolicyness=1, admission_control=True
    )
    assert [src.try_admit() for _ in range(5)] == [True] * 4 + [False]  # (0 + 1 + 1) x 2
    assert not await src.admit(timeout=0.1)
    src.put_failed("g")  # a failed session gives its slot back
    assert await src.admit(timeout=0.1)
    src.put(export(1.0), "g")
    src.put(export(0.0), "g")
    _take_batch_in_another_loop(src).join()  # step 1 takes its batch and trains...
    assert not src.try_admit()  # ... the limit grows only once the step is over
    waiter = asyncio.create_task(src.admit(timeout=10))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    t0 = time.monotonic()
    threading.Thread(target=src.set_version, args=(1,)).start()  # the trainer's next version
    assert await asyncio.wait_for(waiter, 5) and time.monotonic() - t0 < 2
    assert src.try_admit() and not src.try_admit()  # limit is now (1 + 1 + 1) x 2 = 6
    assert ExternalTrajectorySource(n_samples=1, batch_size=1).try_admit()  # off by default


async def test_admission_grows_with_steps_whose_update_was_skipped():
    """All-equal rewards give every advantage 0: the trainer skips the update and the version
    stays. Admission still grows once the step is over (the trainer asks for the next batch),
    or no session would ever be admitted again."""
    src = ExternalTrajectorySource(
        n_samples=2, batch_size=1, max_head_offpolicyness=0, admission_control=True
    )
    trainer: asyncio.Task | None = None
    for step in range(3):
        assert [src.try_admit() for _ in range(3)] == [True, True, False], step
        waiter = asyncio.create_task(src.admit(timeout=10))
        src.put(export(0.0), f"g{step}")
        src.put(export(0.0), f"g{step}")
        if trainer is None:
            await src.rollout_batch(trainer_version=0, timeout=5)
        else:
            await asyncio.wait_for(trainer, 5)
        await asyncio.sleep(0.05)  # the step trains; its update is skipped, no new version
        assert not waiter.done()
        trainer = asyncio.create_task(src.rollout_batch(trainer_version=0, timeout=10))
        assert await asyncio.wait_for(waiter, 5)  # the trainer is back: the step is over
        src.release_admission()  # the waiter's slot: the next round admits two again
    assert trainer is not None
    trainer.cancel()
    assert src.get_version() == 0
