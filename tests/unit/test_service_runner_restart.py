"""A group member lost in a service restart, on the real gateway, proxies, model and SQLite
store: ``AgentRunner`` runs it again in its group however late in its episode the restart came;
the service admits that retry (and every later session) even when the trainer's steps skip their
update and the version stays; an attempt the service stored although its answer was lost is
counted, not run again. So every group completes with exactly ``n_samples`` members and nothing
waits for ``group_timeout`` (or forever).
"""

from __future__ import annotations

import asyncio
import socket
import sqlite3

import httpx
from areal_env_client import AgentRunner, AgentSession, current_session
from areal_env_client.runner import _Attempts

from areal_env.api.config import ProxyConfig
from areal_env.api.service_config import ServiceConfig
from areal_env.proxy.server import ProxyServer
from areal_env.service.gateway import GatewayServer
from areal_env.service.sessions import RESTARTED
from areal_env.service.source import ExternalTrajectorySource
from areal_env.service.store import open_store
from tests.fixtures.batches import as_tensors, episode_dicts
from tests.fixtures.service import SERVICE_USER_KEYS, ServiceStack, make_service_stack

ALICE = SERVICE_USER_KEYS[0]
QUESTION = {"model": "m", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(stack: ServiceStack) -> None:
    stack.gateway.stop()
    for p in stack.proxies:
        p.stop()
    stack.source.close()
    stack.source.store.close()


def _restart(
    engine, tokenizer, db: str, port: int, old: ServiceStack, *, admission: bool = False
) -> ServiceStack:
    """Stop ``old`` with its sessions open (as a crash leaves them) and start the service again
    on the same port and store; the new proxies start first so the outage is short."""
    proxies = [
        ProxyServer(engine, tokenizer, ProxyConfig(default_max_tokens=8)).start() for _ in range(2)
    ]
    _stop(old)
    store = open_store(db)
    source = ExternalTrajectorySource(
        n_samples=2, batch_size=1, store=store, admission_control=admission
    )
    config = ServiceConfig(
        api_keys=list(SERVICE_USER_KEYS), port=port, health_interval=0.2, admission_timeout=1.0
    )
    gateway = GatewayServer(
        config,
        backends=[(p.base_url, p.admin_key) for p in proxies],
        source=source,
        store=store,
    ).start()
    return ServiceStack(gateway=gateway, proxies=proxies, source=source)


async def _model_call(url: str) -> None:
    async with httpx.AsyncClient(timeout=60) as h:  # tagged with the session by the hook
        r = await h.post(
            url + "/v1/chat/completions",
            json=QUESTION,
            headers={"Authorization": f"Bearer {ALICE}"},
        )
        r.raise_for_status()


async def test_a_member_lost_in_a_restart_late_in_its_episode_is_rerun_in_its_group(
    engine, tokenizer, tmp_path
):
    db, port = str(tmp_path / "service.db"), _free_port()
    stack = make_service_stack(engine, tokenizer, n_samples=2, store=open_store(db), port=port)
    stack.source.load(0)
    url = stack.base_url
    retry_for = 3.0
    calls = 0
    in_session, restarted = asyncio.Event(), asyncio.Event()
    lost: list[str] = []

    async def agent(item: dict) -> float:
        nonlocal calls
        calls += 1
        mine = calls
        await _model_call(url)
        if mine == 2:  # the second member: cut by the restart, long after its start
            session = current_session()
            assert session is not None and session.session_id is not None
            lost.append(session.session_id)
            in_session.set()
            await restarted.wait()
            await _model_call(url)  # the old session: 410, start a new one
        return 1.0

    run = asyncio.create_task(
        AgentRunner(url, ALICE).run(
            agent,
            [{"q": "hi"}],
            concurrency=2,
            group_size=2,
            group_prefix="late",
            backoff=0.1,
            max_backoff=0.5,
            retry_for=retry_for,
            progress=False,
        )
    )
    try:
        await asyncio.wait_for(in_session.wait(), 60)
        for _ in range(300):  # the other member is acknowledged (stored)
            if stack.source.total_received == 1 or run.done():
                break
            await asyncio.sleep(0.1)
        if run.done():
            run.result()
        assert stack.source.total_received == 1
        # The open episode has now run for longer than retry_for: that time is no outage.
        await asyncio.sleep(retry_for + 0.5)
        stack = await asyncio.to_thread(_restart, engine, tokenizer, db, port, stack)
        assert stack.source.load(0) == 1  # the acknowledged member is back in its group
        restarted.set()
        (result,) = await asyncio.wait_for(run, 120)
        assert result.ok, result.errors
        assert sorted(result.attempts) == [1, 2]
        assert lost[0] not in result.session_ids
        _, stats = as_tensors(
            await stack.source.rollout_batch(trainer_version=0, step=1, timeout=30)
        )
        assert stats["groups/accepted"] == 1 and stats["groups/incomplete"] == 0
        assert stats["episodes/accepted"] == 2
        trained = {e["session_id"] for e in episode_dicts(stack.source.last_batch)}
        assert trained == set(result.session_ids)
        assert stack.source.num_pending_trajectories == 0
        async with httpx.AsyncClient(timeout=30) as h:
            r = await h.get(
                f"{url}/rl/v1/sessions/{lost[0]}", headers={"Authorization": f"Bearer {ALICE}"}
            )
        assert r.json()["state"] == "failed" and r.json()["error"] == RESTARTED
    finally:
        run.cancel()
        _stop(stack)


async def _episode(url: str, group: str) -> str:
    """One session of ``group``: a model call, then the reward 0 (every reward equal: the
    trainer's update is skipped and its version stays)."""
    async with AgentSession(url, ALICE, group_id=group) as session:
        await _model_call(url)
        await session.finalize(0.0)
    assert session.session_id is not None
    return session.session_id


async def test_a_restart_failed_member_is_admitted_again_though_steps_skip_their_update(
    engine, tokenizer, tmp_path
):
    """The hang the SIGKILL restart test found: admission grew with the trainer's version, and
    a step whose update is skipped (all-equal rewards) leaves it; after a restart the reloaded
    trajectories filled the limit, so the retry of a member the restart failed, and every later
    session, waited forever."""
    db, port = str(tmp_path / "service.db"), _free_port()
    stack = make_service_stack(
        engine,
        tokenizer,
        n_samples=2,
        store=open_store(db),
        port=port,
        admission=True,
        admission_timeout=1.0,
    )
    stack.source.load(0, trainer_version=0)  # admits (0 + 0 + 1) x 1 x 2 = 2 sessions
    url = stack.base_url
    trainer: asyncio.Task | None = None
    try:
        first = await _episode(url, "a")
        lost = AgentSession(url, ALICE, group_id="a")
        await lost.__aenter__()  # open when the service dies
        lost._deactivate()
        stack = await asyncio.to_thread(
            _restart, engine, tokenizer, db, port, stack, admission=True
        )
        assert stack.source.load(0, trainer_version=0) == 1
        retry = await _episode(url, "a")  # the lost member, run again in its group
        _, stats = as_tensors(
            await stack.source.rollout_batch(trainer_version=0, step=1, timeout=30)
        )
        assert stats["groups/accepted"] == 1 and stats["groups/incomplete"] == 0
        assert {e["session_id"] for e in episode_dicts(stack.source.last_batch)} == {first, retry}
        # Step 1's update is skipped (no new version); the trainer asks for step 2's batch.
        trainer = asyncio.create_task(
            stack.source.rollout_batch(trainer_version=0, step=2, timeout=60)
        )
        second = [await _episode(url, "b") for _ in range(2)]  # admitted, not 429
        _, stats = as_tensors(await asyncio.wait_for(trainer, 60))
        assert {e["session_id"] for e in episode_dicts(stack.source.last_batch)} == set(second)
        assert stack.source.get_version() == 0
    finally:
        if trainer is not None:
            trainer.cancel()
        _stop(stack)


class CuttingRelay:
    """A TCP relay on 127.0.0.1 in front of the gateway. For the session named in ``cut``, it
    lets the ``/rl/v1/finalize`` request through and drops the connection when the answer comes
    back: the service stored the trajectory, the client never heard so (as when the service
    dies between its commit and its answer)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.cut: str | None = None
        self.cuts = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _handle(self, c_reader, c_writer) -> None:
        s_reader, s_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        cutting = asyncio.Event()

        async def upstream() -> None:
            while data := await c_reader.read(65536):
                cut = self.cut
                if cut and b"POST /rl/v1/finalize" in data and cut.encode() in data:
                    self.cut = None
                    cutting.set()
                s_writer.write(data)
                await s_writer.drain()

        async def downstream() -> None:
            while data := await s_reader.read(65536):
                if cutting.is_set():  # the finalize's answer: never delivered
                    self.cuts += 1
                    return
                c_writer.write(data)
                await c_writer.drain()

        tasks = [asyncio.create_task(upstream()), asyncio.create_task(downstream())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        except (ConnectionError, OSError):
            pass
        finally:
            for t in tasks:
                t.cancel()
            for w in (c_writer, s_writer):
                w.close()


async def test_an_attempt_stored_though_its_answer_was_lost_is_counted_not_rerun(
    engine, tokenizer, tmp_path
):
    db = str(tmp_path / "service.db")
    stack = make_service_stack(engine, tokenizer, n_samples=2, store=open_store(db))
    stack.source.load(0)
    assert stack.gateway.port is not None
    relay = CuttingRelay(stack.gateway.port)
    url = await relay.start()
    calls = 0

    async def agent(item: dict) -> float:
        nonlocal calls
        calls += 1
        mine = calls
        await _model_call(url)
        if mine == 2:
            session = current_session()
            assert session is not None
            relay.cut = session.session_id  # its finalize is stored, the answer lost
        return 1.0

    try:
        (result,) = await asyncio.wait_for(
            AgentRunner(url, ALICE).run(
                agent,
                [{"q": "hi"}],
                concurrency=2,
                group_size=2,
                group_prefix="cut",
                backoff=0.1,
                max_backoff=0.5,
                progress=False,
            ),
            120,
        )
        assert relay.cuts == 1
        assert result.ok, result.errors
        assert result.attempts == [1, 1] and calls == 2  # nobody ran twice
        _, stats = as_tensors(
            await stack.source.rollout_batch(trainer_version=0, step=1, timeout=30)
        )
        assert stats["episodes/accepted"] == 2 and stats["groups/incomplete"] == 0
        assert {e["session_id"] for e in episode_dicts(stack.source.last_batch)} == set(
            result.session_ids
        )
        assert stack.source.num_pending_trajectories == 0  # no third member opened a new group
        rows = (
            sqlite3.connect(db)
            .execute("SELECT state FROM sessions WHERE group_id = 'cut-0'")
            .fetchall()
        )
        assert sorted(r[0] for r in rows) == ["done", "done"]
    finally:
        await relay.close()
        _stop(stack)


def test_retry_budget_counts_outages_not_queueing_or_episodes(monkeypatch):
    """The runner's clocks (no service needed): only time without a session after a failure
    counts against ``retry_for``; 429 waits count against ``patience`` only."""
    now = [1000.0]
    monkeypatch.setattr("areal_env_client.runner.time.monotonic", lambda: now[0])
    state = _Attempts(retry_for=10.0, patience=4.0, max_retries=None)
    down = httpx.ConnectError("refused")
    busy = httpx.HTTPStatusError(
        "busy", request=httpx.Request("POST", "http://x"), response=httpx.Response(429)
    )
    now[0] += 600.0  # queued for a slot, then a long episode: no failure yet
    assert state.will_retry(down)
    state.failed(down)
    now[0] += 6.0  # 6 s of outage
    assert state.will_retry(down)
    state.failed(down)
    now[0] += 2.0
    state.failed(busy)  # the service answers again, busy: the outage clock stops at 8 s
    now[0] += 3.0
    assert state.will_retry(busy) and state.will_retry(down)
    now[0] += 1.5  # 4.5 s busy
    assert not state.will_retry(busy)
    state.got_session()  # admitted; runs for an hour, then a second outage
    now[0] += 3600.0
    assert state.will_retry(down)
    state.failed(down)
    now[0] += 1.9
    assert state.will_retry(down)  # 9.9 s of outage in all
    now[0] += 0.2
    assert not state.will_retry(down)
    assert state.failures == 3
