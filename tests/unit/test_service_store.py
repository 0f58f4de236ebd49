"""The service store (SQLite by default, PostgreSQL on a real server) and the trajectory
source's durability on it: acknowledged trajectories survive a crash and are consumed once."""

from __future__ import annotations

import asyncio

import pytest

from areal_env.service.auth import KeyStore, QuotaExceededError
from areal_env.service.source import ExternalTrajectorySource
from areal_env.service.store import KeyRecord, SessionRecord, SQLStore, open_store, redact_url
from tests.fixtures.batches import as_tensors, episode_dicts
from tests.unit.test_service_source import export


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request, tmp_path):
    if request.param == "sqlite":
        return str(tmp_path / "service.db")
    return request.getfixturevalue("fresh_postgres")


def _record(session: str, reward: float, version: int = 0) -> dict:
    return dict(export(reward, version), session_id=session)


def test_store_keeps_keys_sessions_and_the_trajectory_lifecycle(store_url):
    store = SQLStore(store_url)
    store.upsert_key(KeyRecord(digest="d1", key_id="d1"[:12], name="carol", max_sessions=3))
    store.add_key_usage("d1", 40)
    store.put_session(SessionRecord("s1", "d1", "g", None, {"a": 1}, "open"))
    store.put_session(SessionRecord("s2", "d1", "g", None, {}, "open", owner="other-host"))
    store.update_session("s1", rewarded=True)
    rid = store.add_trajectory("s1", "g", _record("s1", 1.0))
    store.close()

    store = open_store(store_url)  # a restart
    (key,) = store.load_keys()
    assert (key.name, key.max_sessions, key.tokens_used) == ("carol", 3, 40)
    assert store.revoke_key(key.key_id) and store.get_key("d1").revoked
    s1 = store.get_session("s1")
    assert (s1.state, s1.rewarded, s1.metadata) == ("done", True, {"a": 1})
    assert store.fail_open_sessions("main", "restarted") == 0  # s2 belongs to another host
    assert store.get_session("s2").state == "open"
    (pending,) = store.pending_trajectories()
    assert pending.row_id == rid and pending.record["session_id"] == "s1"
    store.mark_consumed([rid], 3)
    assert store.pending_trajectories() == []
    assert store.restore_to(2) == (0, 1)  # resumed before step 3: handed back
    store.mark_consumed([rid], 3)
    assert store.commit_through(3) == 1
    assert store.pending_trajectories() == [] and store.restore_to(3) == (0, 0)
    assert store.consumed_ledger() == [("s1", 3, "trained")]
    store.close()


def test_keys_are_stored_hashed_with_quotas_and_survive_a_restart(tmp_path):
    store = open_store(str(tmp_path / "s.db"))
    keys = KeyStore(["configured-key"], store=store, max_sessions_per_key=2)
    issued, user = keys.issue(name="carol", tokens_per_minute=100, max_tokens=150)
    keys.count_tokens(user, 120)
    with pytest.raises(QuotaExceededError) as e:
        keys.check_tokens(user)  # 120 tokens in the last minute, quota 100/min
    assert e.value.retry_after is not None and e.value.retry_after > 1
    raw = (tmp_path / "s.db").read_bytes()
    assert b"configured-key" not in raw and issued.encode() not in raw
    store.close()

    store = open_store(str(tmp_path / "s.db"))
    again = KeyStore(["configured-key"], store=store, max_sessions_per_key=2)
    carol = again.lookup(issued)
    assert carol is not None and carol.name == "carol" and carol.tokens_used == 120
    again.count_tokens(carol, 40)
    with pytest.raises(QuotaExceededError, match="used its 150 tokens"):
        again.check_tokens(carol)
    assert again.revoke(carol.key_id) is carol and again.lookup(issued) is None
    assert KeyStore([], store=store).lookup(issued) is None  # revoked stays revoked
    assert again.lookup("configured-key") is not None
    store.close()


async def test_source_reloads_acknowledged_trajectories_and_consumes_each_once(store_url):
    store = open_store(store_url)
    src = ExternalTrajectorySource(n_samples=2, batch_size=1, store=store)
    src.load(0)
    await src.aput(_record("a1", 1.0), "a")
    await src.aput(_record("a2", 0.0), "a")
    await src.aput(_record("b1", 1.0), "b")
    await src.aput(_record("x1", 0.5), None)  # grouped in arrival order
    batch, stats = as_tensors(await src.rollout_batch(trainer_version=0, step=1, timeout=5))
    assert stats["episodes/accepted"] == 2
    assert {e["session_id"] for e in episode_dicts(src.last_batch)} == {"a1", "a2"}
    store.close()  # SIGKILL before the step-1 checkpoint: nothing is committed

    store = open_store(store_url)
    src = ExternalTrajectorySource(n_samples=2, batch_size=1, store=store)
    assert src.load(0) == 4  # a1, a2 handed back; b1 and x1 still waiting
    assert src.num_ready_groups == 1 and src.num_pending_trajectories == 2
    await src.aput(_record("b2", 0.0), "b")
    await src.aput(_record("x2", 0.0), None)
    seen = []
    for step in (1, 2, 3):
        _, stats = as_tensors(await src.rollout_batch(trainer_version=0, step=step, timeout=5))
        seen.append(sorted(e["session_id"] for e in episode_dicts(src.last_batch)))
    assert seen == [["a1", "a2"], ["b1", "b2"], ["x1", "x2"]]
    src.commit(2)  # checkpoint at step 2; the process dies during step 3
    store.close()

    store = open_store(store_url)
    src = ExternalTrajectorySource(n_samples=2, batch_size=1, store=store)
    assert src.load(2) == 2  # only step 3's group comes back
    _, _ = as_tensors(await src.rollout_batch(trainer_version=0, step=3, timeout=5))
    assert sorted(e["session_id"] for e in episode_dicts(src.last_batch)) == ["x1", "x2"]
    src.commit(3)
    ledger = store.consumed_ledger()
    assert sorted(s for s, _, _ in ledger) == ["a1", "a2", "b1", "b2", "x1", "x2"]
    assert {s: step for s, step, _ in ledger} == {
        "a1": 1,
        "a2": 1,
        "b1": 2,
        "b2": 2,
        "x1": 3,
        "x2": 3,
    }
    store.close()


@pytest.mark.parametrize("policy", ["drop", "train"])
async def test_stale_reloaded_trajectories_are_dropped_or_trained_with_a_count(tmp_path, policy):
    store = open_store(str(tmp_path / "s.db"))
    kw = {"n_samples": 1, "max_head_offpolicyness": 1, "stale_trajectories": policy}
    src = ExternalTrajectorySource(batch_size=1, store=store, **kw)
    src.load(0)
    await src.aput(_record("old", 1.0, version=0), "g1")
    await src.aput(_record("new", 1.0, version=5), "g2")
    store.close()
    store = open_store(str(tmp_path / "s.db"))
    src = ExternalTrajectorySource(batch_size=2, store=store, **kw)
    src.load(5, trainer_version=5)
    batch, stats = as_tensors(
        await src.rollout_batch(trainer_version=5, step=6, batch_size=2, timeout=1)
    )
    if policy == "drop":
        assert stats["rejected/stale"] == 1 and stats["episodes/accepted"] == 1
        episodes = episode_dicts(src.last_batch)
        assert [e["session_id"] for e in episodes if e["accepted"]] == ["new"]
        assert [(e["session_id"], e["reason"]) for e in episodes if not e["accepted"]] == [
            ("old", "stale")
        ]
        assert ("old", 6, "stale") in store.consumed_ledger()
    else:
        assert stats["rejected/stale"] == 0 and stats["staleness/over_bound"] == 1
        assert sorted(e["session_id"] for e in episode_dicts(src.last_batch)) == ["new", "old"]
        src.commit(6)  # the step-6 checkpoint makes it final
        assert ("old", 6, "trained") in store.consumed_ledger()


async def test_a_member_that_gives_up_completes_its_group():
    src = ExternalTrajectorySource(n_samples=3, batch_size=1)
    src.put(export(1.0), "g")
    src.put_failed("g", "agent raised")  # will be retried: the group keeps waiting
    assert src.num_ready_groups == 0
    src.put_failed("g", "agent raised", retry=False)
    src.put(export(0.0), "g")
    assert src.num_ready_groups == 1
    _, stats = as_tensors(await asyncio.wait_for(src.rollout_batch(trainer_version=0), 5))
    assert stats["episodes/accepted"] == 2 and stats["groups/incomplete"] == 1
    src.abandon("h")
    src.abandon("h")
    src.abandon("h")  # nobody came: nothing to train on, nothing left waiting
    assert src.num_ready_groups == 0 and src.num_pending_trajectories == 0


def test_store_urls_are_redacted_in_logs():
    assert redact_url("postgresql://u:secret@h:5432/db") == "postgresql://u:***@h:5432/db"
    assert redact_url("/tmp/service.db") == "/tmp/service.db"
