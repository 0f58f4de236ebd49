"""Batching, grouping and the executor's scheduling (concurrency, staleness) with local workflows.

These workflows produce rows themselves (no model) so scheduling can be observed exactly; the
"engine" here only carries a weight version, which is all the executor reads from it.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_env.api.config import RolloutConfig
from areal_env.api.episode import Episode
from areal_env.api.rows import TrainingRow, rows_from_export
from areal_env.api.workflow import RolloutWorkflow
from areal_env.workflow.batch import collate, collate_groups, episode_rows
from areal_env.workflow.executor import RolloutExecutor, StalenessDeadlock
from areal_env.workflow.grouped import GroupedRolloutWorkflow
from areal_env.workflow.resolve import resolve_workflow
from tests.fixtures.batches import as_tensors, episode_dicts


class VersionedWeights:
    """The part of an engine the executor uses: the version of the weights it serves."""

    def __init__(self, version: int = 0) -> None:
        self.version = version

    def get_version(self) -> int:
        return self.version

    def set_version(self, v: int) -> None:
        self.version = v


def rows(n_prompt: int, n_out: int, reward: float, version: int, n_rows: int = 1):
    return {
        f"r{i}": {
            "input_ids": list(range(1, n_prompt + n_out + 1)),
            "loss_mask": [0] * n_prompt + [1] * n_out,
            "logprobs": [0.0] * n_prompt + [-0.5] * n_out,
            "versions": [-1] * n_prompt + [version] * n_out,
            "reward": reward,
        }
        for i in range(n_rows)
    }


def test_rows_are_numbered_once_and_collated_once():
    a = rows_from_export(rows(2, 3, 1.0, 4))
    b = rows_from_export(rows(1, 1, 0.0, 5, n_rows=2))
    b[1].traj_id = 1  # a second trajectory in the same episode
    td = collate_groups([[Episode(rows=a)], [Episode(rows=b)]])
    assert td["input_ids"].shape == (3, 5)
    assert td["versions"][0].tolist() == [-1, -1, 4, 4, 4]
    assert td["input_ids"][1].tolist() == [1, 2, 0, 0, 0]
    assert td["attention_mask"][1].tolist() == [True, True, False, False, False]
    assert td["loss_mask"][2].tolist() == [0, 1, 0, 0, 0]
    assert td["versions"][2].tolist() == [-1, 5, -1, -1, -1]
    assert td["logprobs"].dtype == torch.float32 and td["logprobs"][1, 2:].abs().sum() == 0
    assert td["rewards"].tolist() == [1.0, 0.0, 0.0]
    assert td["group_ids"].tolist() == [0, 1, 1] and td["traj_ids"].tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="loss_mask"):
        TrainingRow([1, 2], [1], [0.0, 0.0], [0, 0])
    with pytest.raises(ValueError, match="at least one row"):
        collate([])


class ScriptedWorkflow(RolloutWorkflow):
    """Episode i (in start order) returns rows with reward ``rewards[i % len]``; None = reject;
    an Exception instance is raised. Records the number running and the versions at start."""

    def __init__(self, engine, rewards, *, delay=0.01, executor=None):
        self.engine = engine
        self.rewards = rewards
        self.delay = delay
        self.executor = executor
        self.started = 0
        self.running = 0
        self.peak = 0
        self.starts: list[tuple[int, int]] = []  # (trainer version, engine version) at start
        self.bound_violations: list[str] = []

    async def arun_episode(self, engine, data):
        i = self.started
        self.started += 1
        self.running += 1
        self.peak = max(self.peak, self.running)
        if self.executor is not None:
            ex = self.executor
            self.starts.append((ex.get_version(), engine.get_version()))
            v0 = ex._v0 if ex._v0 is not None else 0
            limit = (
                ex.get_version() - v0 + ex._skipped_steps + ex.rollout.max_head_offpolicyness + 1
            ) * ex.rollout.batch_size
            if ex._accepted_total + ex._running > limit:
                self.bound_violations.append(f"{ex._accepted_total}+{ex._running} > {limit}")
        version = engine.get_version()
        try:
            await asyncio.sleep(self.delay)
            r = self.rewards[i % len(self.rewards)]
            if isinstance(r, Exception):
                raise r
            if r is None:
                return None
            return rows(2, 2 + i % 3, r, version, n_rows=1 + i % 2)
        finally:
            self.running -= 1


async def test_grouped_keeps_valid_members_and_tags_them():
    eng = VersionedWeights(3)
    inner = ScriptedWorkflow(eng, [1.0, None, RuntimeError("agent broke"), 0.0])
    wf = GroupedRolloutWorkflow(inner, 4)
    from areal_env.workflow.proxy_workflow import episode_sink

    with episode_sink() as sink:
        out = await wf.arun_episode(eng, {"task_id": "t1"})
    assert sorted({r.traj_id for r in out}) == [0, 3]  # the members' indices
    assert [r.reward for r in out if r.traj_id == 0] == [1.0]
    assert {r.reward for r in out if r.traj_id == 3} == {0.0}
    assert [r.accepted for r in sorted(sink, key=lambda r: r.traj_index)] == [
        True,
        False,
        False,
        True,
    ]
    reasons = {r.traj_index: r.reason for r in sink}
    assert reasons[1] == "workflow_rejected" and reasons[2] == "workflow_error"
    assert len({r.group_id for r in sink}) == 1 and all(r.task_id == "t1" for r in sink)
    # every member rejected -> the group is rejected
    all_bad = GroupedRolloutWorkflow(ScriptedWorkflow(eng, [None]), 3)
    assert await all_bad.arun_episode(eng, {}) is None


async def test_rollout_batch_assembles_groups_and_stats():
    eng = VersionedWeights(5)
    rollout = RolloutConfig(
        n_samples=2, batch_size=3, max_concurrent_rollouts=8, max_head_offpolicyness=1
    )
    # group 0: 1.0, 1.0 (zero variance); group 1: both rejected; group 2: 0.0 and 1.0
    inner = ScriptedWorkflow(eng, [1.0, 1.0, None, None, 0.0, 1.0], delay=0)
    wf = resolve_workflow(inner, rollout=rollout)
    ex = RolloutExecutor(eng, wf, rollout, show_progress=False)
    # run groups one at a time so that start order = item order
    ex.max_running_groups = 1
    batch, stats = as_tensors(
        await ex.rollout_batch([{"id": i} for i in range(3)], trainer_version=6)
    )
    assert stats["groups/accepted"] == 2 and stats["groups/rejected"] == 1
    assert stats["episodes/accepted"] == 4 and stats["episodes/rejected"] == 2
    assert stats["rejected/workflow_rejected"] == 2
    assert stats["groups/zero_variance"] == 1
    assert stats["reward/mean"] == pytest.approx(0.75)
    assert stats["reward/min"] == 0.0 and stats["reward/max"] == 1.0
    assert stats["staleness/mean"] == 1.0  # rows generated at version 5, trainer at 6
    assert batch["group_ids"].unique().tolist() == [0, 1]
    assert batch["traj_ids"].unique().tolist() == [0, 1, 2, 3]
    # trajectories never span groups
    for t in range(4):
        assert batch["group_ids"][batch["traj_ids"] == t].unique().numel() == 1
    assert stats["tokens/output"] == float(batch["loss_mask"].sum())
    assert stats["rows"] == batch["input_ids"].shape[0]
    assert len(episode_dicts(ex.last_batch)) == 6
    assert {e["group_index"] for e in episode_dicts(ex.last_batch)} == {0, 1, -1}
    # nothing accepted -> (None, stats), never an exception
    wf_bad = resolve_workflow(ScriptedWorkflow(eng, [None]), rollout=rollout)
    batch, stats = as_tensors(
        await RolloutExecutor(eng, wf_bad, rollout, show_progress=False).rollout_batch(
            [{}, {}], trainer_version=5
        )
    )
    assert batch is None and stats["episodes/rejected"] == 4


@pytest.mark.parametrize("max_conc,n,expected_peak", [(4, 2, 4), (3, 1, 3), (1, 4, 4)])
async def test_concurrency_bound(max_conc, n, expected_peak):
    eng = VersionedWeights(0)
    rollout = RolloutConfig(n_samples=n, batch_size=8, max_concurrent_rollouts=max_conc)
    inner = ScriptedWorkflow(eng, [1.0], delay=0.03)
    ex = RolloutExecutor(
        eng, resolve_workflow(inner, rollout=rollout), rollout, show_progress=False
    )
    batch, stats = as_tensors(await ex.rollout_batch([{}] * 8, trainer_version=0))
    assert stats["episodes/accepted"] == 8 * n
    # at most max(max_conc, one group) episodes at once, and the bound is actually reached
    assert inner.peak == expected_peak


async def test_rollout_batch_waits_for_fresh_weights():
    eng = VersionedWeights(0)
    rollout = RolloutConfig(n_samples=1, batch_size=2, max_head_offpolicyness=0)
    inner = ScriptedWorkflow(eng, [1.0], delay=0)
    ex = RolloutExecutor(eng, inner, rollout, show_progress=False)
    inner.executor = ex

    async def push_weights_later():
        await asyncio.sleep(0.2)
        eng.set_version(2)

    pusher = asyncio.create_task(push_weights_later())
    batch, stats = as_tensors(await ex.rollout_batch([{}, {}], trainer_version=2))
    await pusher
    assert [s[1] for s in inner.starts] == [2, 2]  # nothing started on the stale weights
    assert stats["staleness/max"] == 0


@pytest.mark.parametrize("k", [0, 1, 2])
async def test_prefetch_staleness_bound(k):
    """Drive trainer/engine versions; no episode starts more than k versions behind, consumed
    groups are at most k stale, the (version + k + 1) * B bound holds, and with k > 0 the
    executor really does prefetch while the trainer trains."""
    eng = VersionedWeights(0)
    bs = 2
    rollout = RolloutConfig(
        n_samples=1, batch_size=bs, max_head_offpolicyness=k, max_concurrent_rollouts=16
    )
    inner = ScriptedWorkflow(eng, [1.0, 0.5], delay=0.02)
    ex = RolloutExecutor(eng, inner, rollout, show_progress=False)
    inner.executor = ex
    ex.feed({"id": i} for i in range(100))
    staleness = []
    started_while_training = 0
    try:
        for step in range(6):
            batch, stats = as_tensors(await ex.next_batch(trainer_version=step))
            assert batch is not None and stats["groups/accepted"] == bs
            staleness.append(stats["staleness/max"])
            before = inner.started
            await asyncio.sleep(0.1)  # "training"
            started_while_training += inner.started - before
            eng.set_version(step + 1)  # push weights, then bump the trainer version
            ex.set_version(step + 1)
    finally:
        await ex.aclose()
    assert not inner.bound_violations
    assert all(tv - ev <= k for tv, ev in inner.starts), inner.starts
    assert max(staleness) <= k
    if k == 0:
        assert started_while_training == 0 and max(staleness) == 0
    else:
        assert started_while_training > 0 and max(staleness) >= 1
        assert inner.started <= (6 + k + 1) * bs


async def test_prefetch_replaces_rejected_groups_and_detects_deadlock():
    eng = VersionedWeights(0)
    rollout = RolloutConfig(n_samples=1, batch_size=2, max_head_offpolicyness=0)
    inner = ScriptedWorkflow(eng, [None, 1.0, None, 1.0], delay=0)
    ex = RolloutExecutor(eng, inner, rollout, show_progress=False)
    for i in range(4):
        ex.submit({"id": i})
    batch, stats = as_tensors(await ex.next_batch(trainer_version=0))
    assert stats["groups/accepted"] == 2 and stats["episodes/rejected"] == 2
    assert batch["input_ids"].shape[0] == 4  # episodes 1 and 3, two rows each
    ex.submit({"id": 5})
    with pytest.raises(StalenessDeadlock):
        await ex.next_batch()  # the version never moved: the bound is full
    ex.set_version(1)
    eng.set_version(1)
    batch, stats = as_tensors(await ex.next_batch())  # input runs out: a partial batch
    assert stats["groups/accepted"] == 0 and batch is None and stats["episodes/rejected"] == 1
    await ex.aclose()


async def test_feed_exhaustion_gives_a_partial_batch():
    eng = VersionedWeights(0)
    rollout = RolloutConfig(n_samples=1, batch_size=2, max_head_offpolicyness=1)
    inner = ScriptedWorkflow(eng, [1.0], delay=0)
    ex = RolloutExecutor(eng, inner, rollout, show_progress=False)
    ex.feed({"id": i} for i in range(3))
    batch, stats = as_tensors(await asyncio.wait_for(ex.next_batch(trainer_version=0), 10))
    assert stats["groups/accepted"] == 2
    ex.set_version(1)
    eng.set_version(1)
    batch, stats = as_tensors(await asyncio.wait_for(ex.next_batch(), 10))
    assert stats["groups/accepted"] == 1  # the input ran out: a partial batch, no hang
    batch, stats = as_tensors(await asyncio.wait_for(ex.next_batch(), 10))
    assert batch is None and stats["groups/accepted"] == 0
    await ex.aclose()


async def test_workflows_may_return_rows_or_interactions():
    from areal_env.proxy.cache import Interaction

    it = Interaction(
        id="c1",
        session_id="s",
        messages=[{"role": "user", "content": "hi"}],
        tools=None,
        output_message={"role": "assistant", "content": "yo"},
        prompt_ids=[5, 6, 7],
        output_ids=[8, 9],
        output_logprobs=[-0.1, -0.2],
        output_versions=[3, 3],
        stop_reason="stop",
        reward=0.5,
    )
    td = _as_tensors({"c1": it})
    assert td["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert td["loss_mask"].tolist() == [[0, 0, 0, 1, 1]]
    assert td["versions"].tolist() == [[-1, -1, -1, 3, 3]]
    assert td["logprobs"][0, 3:].tolist() == pytest.approx([-0.1, -0.2])
    assert td["rewards"].tolist() == [0.5]
    td2 = _as_tensors(rows(1, 2, 1.0, 0))
    assert td2["input_ids"].shape == (1, 3)
    # a tensor dict a workflow returns is un-padded into rows, then collated with the batch
    td3 = _as_tensors(collate([*episode_rows({"c1": it}), *episode_rows(rows(1, 2, 1.0, 0))]))
    assert td3["attention_mask"].sum(1).tolist() == [5, 3]
    assert td3["input_ids"][1].tolist() == [1, 2, 3, 0, 0]
    assert _as_tensors(None) is None and _as_tensors({}) is None
    with pytest.raises(TypeError, match="expected"):
        _as_tensors([1, 2])


@given(
    shapes=st.lists(
        st.tuples(st.integers(1, 3), st.integers(0, 4), st.integers(1, 5)), min_size=1, max_size=5
    )
)
@settings(max_examples=40, deadline=None)
def test_concat_preserves_every_row(shapes):
    parts = [collate(rows_from_export(rows(p, o, float(p), 1, n_rows=n))) for n, p, o in shapes]
    td = collate_groups(
        [[Episode(rows=rows_from_export(rows(p, o, float(p), 1, n_rows=n)))] for n, p, o in shapes]
    )
    assert td["input_ids"].shape == (
        sum(n for n, _, _ in shapes),
        max(p + o for _, p, o in shapes),
    )
    i = 0
    for (n, p, o), part in zip(shapes, parts, strict=True):
        for r in range(n):
            width = p + o
            assert td["input_ids"][i, :width].tolist() == part["input_ids"][r].tolist()
            assert not td["attention_mask"][i, width:].any()
            assert (td["versions"][i, width:] == -1).all()
            assert td["loss_mask"][i].sum() == o and td["rewards"][i] == float(p)
            i += 1


def _as_tensors(out):
    """A workflow's output through the row record and the one collation."""
    got = episode_rows(out)
    return None if got is None else collate(got)


async def test_skipped_updates_do_not_fill_the_staleness_bound():
    """A step whose update is skipped (all-equal rewards) leaves the version where it was; the
    trainer says so with ``skip_step`` and the next batches still start. Without it the bound
    fills after ``max_head_offpolicyness + 1`` such steps and ``next_batch`` deadlocks."""
    for skip in (True, False):
        eng = VersionedWeights(0)
        rollout = RolloutConfig(n_samples=1, batch_size=2, max_head_offpolicyness=1)
        inner = ScriptedWorkflow(eng, [0.0, 0.0], delay=0)
        ex = RolloutExecutor(eng, inner, rollout, show_progress=False)
        inner.executor = ex
        ex.feed({"id": i} for i in range(100))
        taken = 0
        try:
            for _ in range(5):
                batch, stats = as_tensors(await ex.next_batch(trainer_version=0))
                assert stats["groups/accepted"] == 2
                taken += 1
                if skip:
                    ex.skip_step()  # no update: the version stays 0
        except StalenessDeadlock:
            assert not skip, "skip_step should keep the bound moving"
        finally:
            await ex.aclose()
        assert taken == (5 if skip else 2)
        assert not inner.bound_violations
