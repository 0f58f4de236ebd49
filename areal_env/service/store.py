"""Durable state of the training service: keys, sessions and acknowledged trajectories.

A trajectory whose ``/rl/v1/finalize`` answered 200 is in the store before the answer leaves,
so neither a restart, Ctrl-C nor SIGKILL loses it. Its life: *pending* (written at finalize) →
*consumed at step s* (handed to the trainer for step ``s``) → *committed* (a checkpoint at
step >= ``s`` exists: the row moves to the ``consumed`` ledger). On start, rows consumed after
the checkpoint the trainer restores go back to pending, so every acknowledged trajectory is
trained exactly once along the run that survives.

One store holds one run (``experiment_name/trial_name``): the first start of a run stamps it,
and a start of another run on the same database is refused with the name of the run it holds
(``StoreInUseError``), so two trials never share pending trajectories, sessions or key usage.

``SQLStore`` speaks SQLite (standard library, WAL mode, the embedded default: one file in the
run dir) and PostgreSQL (``postgresql://...`` with the optional ``psycopg`` driver; several
gateway hosts of one run may share it). Every method blocks: async callers go through
``asyncio.to_thread``. One connection, serialised by a lock (writes are few and small).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)

SCHEMA_VERSION = "1"


class StoreInUseError(RuntimeError):
    """The database holds the state of another run (the message names it and says what to do)."""


@dataclass
class StoreSummary:
    """What a store holds (``areal-env serve-training`` prints it at start)."""

    run: str | None
    pending: int
    """Acknowledged trajectories not trained yet (reloaded at start)."""
    trained: int
    """Trajectories in the ledger as trained."""
    issued_keys: int
    sessions: int

    def describe(self) -> str:
        if not (self.pending or self.trained or self.issued_keys or self.sessions):
            return f"run {self.run or '(unnamed)'}, empty"
        return (
            f"run {self.run or '(unnamed)'}: {self.pending} acknowledged trajectories not "
            f"trained yet, {self.trained} trained, {self.sessions} sessions, "
            f"{self.issued_keys} issued keys"
        )


@dataclass
class KeyRecord:
    """A user key as stored: its digest only, never the key."""

    digest: str
    key_id: str
    name: str | None = None
    max_sessions: int = 64
    tokens_per_minute: int | None = None
    max_tokens: int | None = None
    issued: bool = False
    revoked: bool = False
    tokens_used: int = 0
    created: float = 0.0


@dataclass
class SessionRecord:
    id: str
    key_digest: str
    group_id: str | None
    task_id: str | None
    metadata: dict[str, Any]
    state: str
    error: str | None = None
    rewarded: bool = False
    created: float = 0.0
    updated: float = 0.0
    owner: str = "main"
    """The gateway instance that holds the session (``service.instance``)."""


@dataclass
class StoredTrajectory:
    row_id: int
    session_id: str
    group_key: str
    record: dict[str, Any]
    created: float


class ServiceStore(Protocol):
    """What the gateway, key registry and trajectory source need from a database."""

    url: str

    def summary(self) -> StoreSummary: ...
    def get_meta(self, name: str) -> str | None: ...
    def set_meta(self, name: str, value: str) -> None: ...
    def upsert_key(self, key: KeyRecord) -> None: ...
    def load_keys(self) -> list[KeyRecord]: ...
    def get_key(self, digest: str) -> KeyRecord | None: ...
    def revoke_key(self, key_id: str) -> bool: ...
    def add_key_usage(self, digest: str, tokens: int) -> None: ...
    def put_session(self, session: SessionRecord) -> None: ...
    def update_session(
        self,
        session_id: str,
        state: str | None = None,
        error: str | None = None,
        *,
        rewarded: bool | None = None,
    ) -> None: ...
    def get_session(self, session_id: str) -> SessionRecord | None: ...
    def fail_open_sessions(self, owner: str, reason: str) -> int: ...
    def add_trajectory(
        self, session_id: str, group_key: str, record: dict[str, Any], *, state: str = "done"
    ) -> int: ...
    def pending_trajectories(self) -> list[StoredTrajectory]: ...
    def mark_consumed(self, row_ids: list[int], step: int) -> None: ...
    def drop_trajectories(self, row_ids: list[int], step: int, outcome: str) -> None: ...
    def commit_through(self, step: int) -> int: ...
    def restore_to(self, step: int) -> tuple[int, int]: ...
    def consumed_ledger(self) -> list[tuple[str, int, str]]: ...
    def trained_groups(self) -> dict[str, int]: ...
    def close(self) -> None: ...


_TABLES = {
    "meta": "name TEXT PRIMARY KEY, value TEXT NOT NULL",
    "keys": (
        "digest TEXT PRIMARY KEY, key_id TEXT NOT NULL, name TEXT, max_sessions INTEGER NOT NULL,"
        " tokens_per_minute BIGINT, max_tokens BIGINT, issued INTEGER NOT NULL,"
        " revoked INTEGER NOT NULL DEFAULT 0, tokens_used BIGINT NOT NULL DEFAULT 0,"
        " created DOUBLE PRECISION NOT NULL"
    ),
    "sessions": (
        "id TEXT PRIMARY KEY, key_digest TEXT NOT NULL, group_id TEXT, task_id TEXT,"
        " metadata TEXT NOT NULL, state TEXT NOT NULL, error TEXT,"
        " rewarded INTEGER NOT NULL DEFAULT 0, created DOUBLE PRECISION NOT NULL,"
        " updated DOUBLE PRECISION NOT NULL, owner TEXT NOT NULL DEFAULT 'main'"
    ),
    "trajectories": (
        "{serial}, session_id TEXT NOT NULL UNIQUE, group_key TEXT NOT NULL,"
        " record TEXT NOT NULL, created DOUBLE PRECISION NOT NULL, consumed_step INTEGER"
    ),
    "consumed": (
        "session_id TEXT PRIMARY KEY, step INTEGER NOT NULL, outcome TEXT NOT NULL,"
        " at DOUBLE PRECISION NOT NULL"
    ),
}


class SQLStore:
    """``ServiceStore`` on SQLite (``sqlite:///path``, a path, or ``:memory:``) or PostgreSQL.

    ``run`` (``experiment_name/trial_name``): the run this store belongs to; a database stamped
    with another run is refused (``StoreInUseError``). None: no check (a bare gateway)."""

    def __init__(self, url: str, *, run: str | None = None) -> None:
        self.url = url
        self.run = run
        self._lock = threading.RLock()
        if url.startswith(("postgresql://", "postgres://")):
            try:
                import psycopg
            except ImportError as e:
                raise RuntimeError(
                    "service.store is a PostgreSQL URL but the driver is missing: "
                    "pip install 'areal-env[postgres]' (psycopg)"
                ) from e
            self.dialect = "postgres"
            self._conn: Any = psycopg.connect(url, autocommit=True)
            serial = "id BIGSERIAL PRIMARY KEY"
        else:
            self.dialect = "sqlite"
            path = url.removeprefix("sqlite:///") if url.startswith("sqlite:///") else url
            if path != ":memory:":
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(
                path, check_same_thread=False, isolation_level=None, timeout=30.0
            )
            self._conn.execute("PRAGMA journal_mode=WAL")
            # FULL: an acknowledged trajectory survives a power loss too, not only a crash.
            self._conn.execute("PRAGMA synchronous=FULL")
            serial = "id INTEGER PRIMARY KEY AUTOINCREMENT"
        with self._tx() as cur:
            for table, cols in _TABLES.items():
                cur.execute(f"CREATE TABLE IF NOT EXISTS {table} ({cols.format(serial=serial)})")
            cur.execute(
                "CREATE INDEX IF NOT EXISTS trajectories_consumed ON trajectories (consumed_step)"
            )
        if self.get_meta("schema") is None:
            self.set_meta("schema", SCHEMA_VERSION)
        if run is not None:
            self._claim(run)

    def _claim(self, run: str) -> None:
        """Stamp a new database with ``run``, or refuse one that holds another run."""
        with self._tx() as cur:
            cur.execute("SELECT value FROM meta WHERE name = 'run'")
            row = cur.fetchone()
            if row is None:
                cur.execute("INSERT INTO meta (name, value) VALUES ('run', ?)", (run,))
        held = row[0] if row is not None else run
        if held == run:
            return
        what = self.summary()
        self.close()
        experiment, _, trial = held.partition("/")
        raise StoreInUseError(
            f"the service store {redact_url(self.url)} holds run {held!r} "
            f"({what.pending} acknowledged trajectories not trained yet, {what.trained} "
            f"trained, {what.issued_keys} issued keys), not {run!r}: one store holds one run. "
            f"Give this run a store of its own (service.store=PATH or another PostgreSQL "
            f"database), or resume {held!r} with experiment_name={experiment} "
            f"trial_name={trial}"
        )

    def summary(self) -> StoreSummary:
        def count(query: str) -> int:
            return int(self._all(query)[0][0])

        return StoreSummary(
            run=self.get_meta("run"),
            pending=count("SELECT COUNT(*) FROM trajectories"),
            trained=count("SELECT COUNT(*) FROM consumed WHERE outcome = 'trained'"),
            issued_keys=count("SELECT COUNT(*) FROM keys WHERE issued = 1"),
            sessions=count("SELECT COUNT(*) FROM sessions"),
        )

    # -- plumbing --------------------------------------------------------------------------

    def _sql(self, query: str) -> str:
        return query.replace("?", "%s") if self.dialect == "postgres" else query

    @contextmanager
    def _tx(self) -> Iterator[Any]:
        """One transaction (all or nothing), serialised with every other call."""
        with self._lock:
            if self.dialect == "postgres":
                with self._conn.transaction():
                    with self._conn.cursor() as cur:
                        yield _Cursor(cur, self._sql)
            else:
                cur = self._conn.cursor()
                cur.execute("BEGIN IMMEDIATE")
                try:
                    yield _Cursor(cur, self._sql)
                except BaseException:
                    cur.execute("ROLLBACK")
                    raise
                cur.execute("COMMIT")

    def _all(self, query: str, params: tuple = ()) -> list[tuple]:
        with self._tx() as cur:
            cur.execute(query, params)
            return list(cur.fetchall())

    def close(self) -> None:
        with self._lock:
            try:
                self._conn.close()
            except Exception as e:  # noqa: BLE001 - closing at shutdown must not raise
                logger.debug("closing the store: %s", e)

    # -- meta ------------------------------------------------------------------------------

    def get_meta(self, name: str) -> str | None:
        rows = self._all("SELECT value FROM meta WHERE name = ?", (name,))
        return rows[0][0] if rows else None

    def set_meta(self, name: str, value: str) -> None:
        with self._tx() as cur:
            cur.execute(
                "INSERT INTO meta (name, value) VALUES (?, ?)"
                " ON CONFLICT (name) DO UPDATE SET value = excluded.value",
                (name, value),
            )

    # -- keys ------------------------------------------------------------------------------

    def upsert_key(self, key: KeyRecord) -> None:
        with self._tx() as cur:
            cur.execute(
                "INSERT INTO keys (digest, key_id, name, max_sessions, tokens_per_minute,"
                " max_tokens, issued, revoked, tokens_used, created)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (digest) DO UPDATE SET name = excluded.name,"
                " max_sessions = excluded.max_sessions,"
                " tokens_per_minute = excluded.tokens_per_minute,"
                " max_tokens = excluded.max_tokens, revoked = excluded.revoked",
                (
                    key.digest,
                    key.key_id,
                    key.name,
                    key.max_sessions,
                    key.tokens_per_minute,
                    key.max_tokens,
                    int(key.issued),
                    int(key.revoked),
                    key.tokens_used,
                    key.created or time.time(),
                ),
            )

    _KEY_COLS = (
        "digest, key_id, name, max_sessions, tokens_per_minute, max_tokens, issued, revoked,"
        " tokens_used, created"
    )

    @staticmethod
    def _key(row: tuple) -> KeyRecord:
        return KeyRecord(
            digest=row[0],
            key_id=row[1],
            name=row[2],
            max_sessions=int(row[3]),
            tokens_per_minute=row[4],
            max_tokens=row[5],
            issued=bool(row[6]),
            revoked=bool(row[7]),
            tokens_used=int(row[8]),
            created=float(row[9]),
        )

    def load_keys(self) -> list[KeyRecord]:
        return [self._key(r) for r in self._all(f"SELECT {self._KEY_COLS} FROM keys")]

    def get_key(self, digest: str) -> KeyRecord | None:
        rows = self._all(f"SELECT {self._KEY_COLS} FROM keys WHERE digest = ?", (digest,))
        return self._key(rows[0]) if rows else None

    def revoke_key(self, key_id: str) -> bool:
        with self._tx() as cur:
            cur.execute("UPDATE keys SET revoked = 1 WHERE key_id = ?", (key_id,))
            return cur.rowcount > 0

    def add_key_usage(self, digest: str, tokens: int) -> None:
        with self._tx() as cur:
            cur.execute(
                "UPDATE keys SET tokens_used = tokens_used + ? WHERE digest = ?", (tokens, digest)
            )

    # -- sessions --------------------------------------------------------------------------

    def put_session(self, session: SessionRecord) -> None:
        now = time.time()
        with self._tx() as cur:
            cur.execute(
                "INSERT INTO sessions (id, key_digest, group_id, task_id, metadata, state, error,"
                " rewarded, created, updated, owner) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    session.id,
                    session.key_digest,
                    session.group_id,
                    session.task_id,
                    json.dumps(session.metadata),
                    session.state,
                    session.error,
                    int(session.rewarded),
                    session.created or now,
                    now,
                    session.owner,
                ),
            )

    def update_session(
        self,
        session_id: str,
        state: str | None = None,
        error: str | None = None,
        *,
        rewarded: bool | None = None,
    ) -> None:
        sets: list[str] = ["updated = ?"]
        params: list[Any] = [time.time()]
        if state is not None:
            sets += ["state = ?", "error = ?"]
            params += [state, error]
        if rewarded is not None:
            sets.append("rewarded = ?")
            params.append(int(rewarded))
        with self._tx() as cur:
            cur.execute(
                f"UPDATE sessions SET {', '.join(sets)} WHERE id = ?", (*params, session_id)
            )

    def get_session(self, session_id: str) -> SessionRecord | None:
        rows = self._all(
            "SELECT id, key_digest, group_id, task_id, metadata, state, error, rewarded, created,"
            " updated, owner FROM sessions WHERE id = ?",
            (session_id,),
        )
        if not rows:
            return None
        r = rows[0]
        return SessionRecord(
            id=r[0],
            key_digest=r[1],
            group_id=r[2],
            task_id=r[3],
            metadata=json.loads(r[4]),
            state=r[5],
            error=r[6],
            rewarded=bool(r[7]),
            created=float(r[8]),
            updated=float(r[9]),
            owner=r[10],
        )

    def fail_open_sessions(self, owner: str, reason: str) -> int:
        """Sessions ``owner`` left open in a previous run: their proxy state is gone."""
        with self._tx() as cur:
            cur.execute(
                "UPDATE sessions SET state = 'failed', error = ?, updated = ?"
                " WHERE state IN ('open', 'finalizing') AND owner = ?",
                (reason, time.time(), owner),
            )
            return cur.rowcount

    # -- trajectories ----------------------------------------------------------------------

    def add_trajectory(
        self, session_id: str, group_key: str, record: dict[str, Any], *, state: str = "done"
    ) -> int:
        """Write an acknowledged trajectory and mark its session ``state``, atomically."""
        now = time.time()
        with self._tx() as cur:
            cur.execute(
                "INSERT INTO trajectories (session_id, group_key, record, created)"
                " VALUES (?, ?, ?, ?)" + (" RETURNING id" if self.dialect == "postgres" else ""),
                (session_id, group_key, json.dumps(record), now),
            )
            row_id = cur.fetchone()[0] if self.dialect == "postgres" else cur.lastrowid
            cur.execute(
                "UPDATE sessions SET state = ?, error = NULL, updated = ? WHERE id = ?",
                (state, now, session_id),
            )
        return int(row_id)

    def pending_trajectories(self) -> list[StoredTrajectory]:
        rows = self._all(
            "SELECT id, session_id, group_key, record, created FROM trajectories"
            " WHERE consumed_step IS NULL ORDER BY id"
        )
        return [
            StoredTrajectory(int(r[0]), r[1], r[2], json.loads(r[3]), float(r[4])) for r in rows
        ]

    def mark_consumed(self, row_ids: list[int], step: int) -> None:
        if not row_ids:
            return
        with self._tx() as cur:
            for rid in row_ids:
                cur.execute("UPDATE trajectories SET consumed_step = ? WHERE id = ?", (step, rid))

    def drop_trajectories(self, row_ids: list[int], step: int, outcome: str) -> None:
        """Take trajectories out for good (e.g. ``stale``), keeping a line in the ledger."""
        if not row_ids:
            return
        now = time.time()
        with self._tx() as cur:
            for rid in row_ids:
                cur.execute("SELECT session_id FROM trajectories WHERE id = ?", (rid,))
                row = cur.fetchone()
                if row is None:
                    continue
                cur.execute(
                    "INSERT INTO consumed (session_id, step, outcome, at) VALUES (?, ?, ?, ?)"
                    " ON CONFLICT (session_id) DO NOTHING",
                    (row[0], step, outcome, now),
                )
                cur.execute("DELETE FROM trajectories WHERE id = ?", (rid,))

    def commit_through(self, step: int) -> int:
        """A checkpoint at ``step`` exists: trajectories consumed up to it are trained for good."""
        with self._tx() as cur:
            cur.execute(
                "INSERT INTO consumed (session_id, step, outcome, at)"
                " SELECT session_id, consumed_step, 'trained', ? FROM trajectories"
                " WHERE consumed_step IS NOT NULL AND consumed_step <= ?"
                " ON CONFLICT (session_id) DO NOTHING",
                (time.time(), step),
            )
            cur.execute(
                "DELETE FROM trajectories WHERE consumed_step IS NOT NULL AND consumed_step <= ?",
                (step,),
            )
            committed = cur.rowcount
            cur.execute(
                "INSERT INTO meta (name, value) VALUES ('committed_step', ?)"
                " ON CONFLICT (name) DO UPDATE SET value = excluded.value",
                (str(step),),
            )
        return committed

    def restore_to(self, step: int) -> tuple[int, int]:
        """The trainer resumes at ``step``: commit what that checkpoint holds and hand the
        trajectories consumed after it back (their steps are redone). Returns both counts."""
        committed = self.commit_through(step)
        with self._tx() as cur:
            cur.execute(
                "UPDATE trajectories SET consumed_step = NULL WHERE consumed_step > ?", (step,)
            )
            returned = cur.rowcount
        return committed, returned

    def consumed_ledger(self) -> list[tuple[str, int, str]]:
        """``(session_id, step, outcome)`` of every trajectory taken out for good."""
        return [
            (r[0], int(r[1]), r[2])
            for r in self._all("SELECT session_id, step, outcome FROM consumed ORDER BY at")
        ]

    def trained_groups(self) -> dict[str, int]:
        """Group ids whose members a committed step took (trained, or dropped as stale) ->
        the last such step: those groups take no more members."""
        rows = self._all(
            "SELECT s.group_id, MAX(c.step) FROM consumed c JOIN sessions s ON s.id = c.session_id"
            " WHERE s.group_id IS NOT NULL AND c.outcome IN ('trained', 'stale')"
            " GROUP BY s.group_id"
        )
        return {r[0]: int(r[1]) for r in rows}


class _Cursor:
    """A DB-API cursor that writes ``?`` placeholders in either dialect."""

    def __init__(self, cur: Any, sql: Any) -> None:
        self._cur = cur
        self._sql = sql

    def execute(self, query: str, params: tuple = ()) -> None:
        self._cur.execute(self._sql(query), params)

    def fetchone(self) -> Any:
        return self._cur.fetchone()

    def fetchall(self) -> Any:
        return self._cur.fetchall()

    @property
    def rowcount(self) -> int:
        return self._cur.rowcount

    @property
    def lastrowid(self) -> Any:
        return self._cur.lastrowid


def open_store(url: str | None, run_dir: Path | None = None, *, run: str | None = None) -> SQLStore:
    """The configured store: ``service.store`` (a URL or a path), else ``RUN_DIR/service.db``,
    else (no run dir: a bare gateway) an in-memory SQLite database. ``run``: see ``SQLStore``."""
    if url:
        return SQLStore(url, run=run)
    if run_dir is not None:
        return SQLStore(str(Path(run_dir) / "service.db"), run=run)
    return SQLStore(":memory:", run=run)


def redact_url(url: str) -> str:
    """``url`` without its password (for logs)."""
    if "://" in url and "@" in url:
        scheme, rest = url.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        user = creds.split(":", 1)[0]
        return f"{scheme}://{user}:***@{host}"
    return url
