"""Run agents in worker processes (``rollout.mode="subproc"``).

Why processes: some agents are synchronous, block, read their endpoint only from the environment
(``OPENAI_BASE_URL``...), or are not safe to run many times in one event loop. Each worker is a
``spawn``-started process that runs one episode at a time: it sets the session's environment
variables, calls ``run(data)`` (awaiting it when it is a coroutine) and sends the result back.

A worker whose episode exceeds the timeout (or whose caller is cancelled) is killed and replaced
on demand, so a hung agent costs one episode, never the pool. This module imports only the
standard library at top level so that workers start quickly.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import multiprocessing as mp
import os
import pickle
import sys
import threading
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any

from areal_env.api.imports import FILE_MODULES, import_string, load_file_module

logger = logging.getLogger(__name__)


class AgentError(RuntimeError):
    """The agent raised in the worker; ``remote_traceback`` holds the worker's traceback."""

    def __init__(self, message: str, remote_traceback: str | None = None) -> None:
        super().__init__(message)
        self.remote_traceback = remote_traceback


class WorkerDied(AgentError):
    """The worker process exited in the middle of an episode (crash, os._exit, OOM kill)."""


@dataclass
class AgentSpec:
    """How a worker rebuilds the agent: by import string (+ kwargs) or by pickle."""

    key: str
    import_string: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    pickled: bytes | None = None
    file_modules: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_agent(
        cls, agent: Any, import_string: str | None = None, kwargs: dict[str, Any] | None = None
    ) -> AgentSpec:
        files = dict(FILE_MODULES)
        if import_string is not None:
            return cls(uuid.uuid4().hex, import_string, dict(kwargs or {}), None, files)
        try:
            blob = pickle.dumps(agent)
        except Exception as e:
            raise TypeError(
                f"rollout.mode='subproc' needs a picklable agent or an import string; "
                f"{type(agent).__name__} cannot be pickled: {e}"
            ) from e
        return cls(uuid.uuid4().hex, None, {}, blob, files)


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


def _build_agent(spec: AgentSpec) -> Any:
    for name, path in spec.file_modules.items():
        if name not in sys.modules:
            with contextlib.suppress(Exception):
                load_file_module(path)
    if spec.import_string is not None:
        obj = import_string(spec.import_string)
        return obj(**spec.kwargs) if isinstance(obj, type) else obj
    return pickle.loads(spec.pickled)  # type: ignore[arg-type]


def _call(agent: Any, data: Any, extra: dict[str, Any]) -> Any:
    run = agent.run
    try:
        sig = inspect.signature(run)
        params = sig.parameters.values()
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            kwargs = dict(extra)
        else:
            kwargs = {k: v for k, v in extra.items() if k in sig.parameters}
    except (TypeError, ValueError):
        kwargs = {}
    result = run(data, **kwargs)
    if inspect.isawaitable(result):

        async def _await() -> Any:
            return await result

        result = asyncio.run(_await())
    return result


def _worker_main(conn: Any) -> None:
    """Worker loop: receive (kind, spec, data, env, extra), run, send back a pickled outcome.

    ``kind="warmup"`` only builds the agent (imports, constructor), so that start-up cost is not
    charged to the first episode's timeout.
    """
    agents: dict[str, Any] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        kind, spec, data, env, extra = msg
        os.environ.update(env)
        try:
            agent = agents.get(spec.key)
            if agent is None:
                agent = agents[spec.key] = _build_agent(spec)
            result = _call(agent, data, extra) if kind == "run" else None
            try:
                payload = pickle.dumps(("ok", result))
            except Exception:
                payload = pickle.dumps(
                    ("ok_unpicklable", f"{type(result).__name__}: {result!r:.200}")
                )
        except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
            payload = pickle.dumps(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        try:
            conn.send_bytes(payload)
        except (BrokenPipeError, OSError):
            return


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------


class _Worker:
    def __init__(self, ctx: Any) -> None:
        parent, child = ctx.Pipe(duplex=True)
        self.conn = parent
        self.process = ctx.Process(target=_worker_main, args=(child,), daemon=True)
        self.process.start()
        child.close()
        self.warm = False

    def alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.process.kill()
        with contextlib.suppress(Exception):
            self.process.join(5)
        with contextlib.suppress(Exception):
            self.conn.close()

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.send(None)
        self.process.join(2)
        if self.process.is_alive():
            self.kill()
        with contextlib.suppress(Exception):
            self.conn.close()


class SubprocAgentPool:
    """At most ``max_workers`` worker processes, created on demand and reused across episodes."""

    def __init__(
        self,
        spec: AgentSpec,
        *,
        max_workers: int,
        start_method: str = "spawn",
        startup_timeout: float = 120.0,
    ) -> None:
        self.startup_timeout = startup_timeout
        self.spec = spec
        self.max_workers = max_workers
        self._ctx = mp.get_context(start_method)
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self._sem: asyncio.Semaphore | None = None
        self._sem_loop: Any = None
        self.killed = 0
        self._closed = False

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._sem is None or self._sem_loop is not loop:
            self._sem = asyncio.Semaphore(self.max_workers)
            self._sem_loop = loop
        return self._sem

    async def _acquire(self) -> _Worker:
        with self._lock:
            while self._idle:
                w = self._idle.pop()
                if w.alive():
                    return w
                self._all.discard(w)
                w.kill()
        w = await asyncio.to_thread(_Worker, self._ctx)
        with self._lock:
            self._all.add(w)
        return w

    def _release(self, w: _Worker) -> None:
        with self._lock:
            if self._closed:
                w.stop()
                return
            self._idle.append(w)

    def _discard(self, w: _Worker) -> None:
        with self._lock:
            self._all.discard(w)
        self.killed += 1
        w.kill()

    async def run(
        self, data: Any, *, env: dict[str, str], extra: dict[str, Any], timeout: float
    ) -> Any:
        """Run one episode in a worker; TimeoutError after ``timeout`` s (the worker is killed)."""
        if self._closed:
            raise RuntimeError("the subprocess pool is closed")
        async with self._semaphore():
            w = await self._acquire()
            ok = False
            try:
                if not w.warm:
                    await asyncio.wait_for(
                        self._roundtrip(w, "warmup", None, {}, {}),
                        max(timeout, self.startup_timeout),
                    )
                    w.warm = True
                result = await asyncio.wait_for(
                    self._roundtrip(w, "run", data, env, extra), timeout
                )
                ok = True
                return result
            except AgentError as e:
                ok = not isinstance(e, WorkerDied)  # the agent raised; its worker is fine
                raise
            finally:
                if ok:
                    self._release(w)
                else:
                    # timed out, cancelled or the worker died: its state is unknown, replace it
                    await asyncio.to_thread(self._discard, w)

    async def _roundtrip(
        self, w: _Worker, kind: str, data: Any, env: dict[str, str], extra: dict[str, Any]
    ) -> Any:
        loop = asyncio.get_running_loop()
        await asyncio.to_thread(w.conn.send, (kind, self.spec, data, env, extra))
        ready = loop.create_future()
        fd = w.conn.fileno()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        loop.add_reader(fd, wake)
        try:
            await ready
        finally:
            loop.remove_reader(fd)
        try:
            payload = await asyncio.to_thread(w.conn.recv_bytes)
        except (EOFError, OSError) as e:
            raise WorkerDied(
                f"the agent's worker process died (exit code {w.process.exitcode})"
            ) from e
        kind, *rest = pickle.loads(payload)
        if kind == "ok":
            return rest[0]
        if kind == "ok_unpicklable":
            return _Unpicklable(rest[0])
        raise AgentError(rest[0], rest[1])

    def close(self) -> None:
        """Stop every worker (idle ones politely, busy ones by kill)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            busy = self._all - set(idle)
            self._all = set()
        for w in idle:
            w.stop()
        for w in busy:
            w.kill()


class _Unpicklable:
    """Stands in for a return value that could not be sent back (so the reward is rejected)."""

    def __init__(self, description: str) -> None:
        self.description = description

    def __repr__(self) -> str:
        return f"<unpicklable {self.description}>"
