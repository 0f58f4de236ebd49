"""Stop, restart and kill ``areal-env serve-training`` while agents run: nothing lost, nothing dropped.

    python bench/service_restart.py [--store sqlite|postgres|both] [--agents 3] [--items 48]
        [--group 2] [--batch 2] [--restarts 6] [--seed 0] [--think 2] [--model tiny|default]

``--agents`` agent processes (``AgentRunner`` of the light client, each over its share of the
``--items`` items, ``--group`` samples per item, one GRPO group per item) train one service
while the bench stops it ``--restarts`` times at random points of the run (a seeded random
delay after each start), with SIGTERM, SIGINT and SIGKILL in a seeded order that uses each, and
starts it again on the same config and store. The last start trains to
``trainer.total_train_steps = items / batch``, the steps the items fill exactly. Counted per
store, from the agents' results and the store's ledger:

- ``attempted``: samples the agents set out to run (items x group);
- ``acknowledged``: samples whose finalize the service answered 200;
- ``trained``: acknowledged samples the store's ledger holds as trained;
- ``lost``: acknowledged, never trained (target 0);
- ``dropped``: samples the runner gave up on (target 0);
- ``trained_twice``: sessions in the surviving run's trajectory dumps more than once (target 0);
- ``attempts`` / ``waits``: episodes run and "not now" answers (429/503/unreachable) waited out;
- ``stops``: each signal, the delay before it, the exit status (0 after a clean stop, -9 after
  SIGKILL) and the service's last words ("stopped at step N").

The last line printed is JSON: ``{"sqlite": {...}, "postgres": {...}, "lost": N, "dropped": N}``.
The default model is a tiny random Llama with the default model's tokenizer (the bench counts
samples, not what a model learns; ``--model default`` runs SmolLM2-135M, slower). PostgreSQL is
a throwaway server started from Debian's binaries (``apt-get install postgresql``), or
``--postgres-url``. Run folders and databases are removed at the end unless ``--keep``. On a
shared machine run it under the heavy-work lock.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
KEY = "bench-restart-key"
SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT, "SIGKILL": signal.SIGKILL}


# -- the agents (run as `service_restart.py --agent-worker JSON`: the light client only) --------


def agent_worker(spec: dict[str, Any]) -> None:
    """One agent process: ``AgentRunner`` over items ``[first, last)``; writes its results."""
    import asyncio

    import httpx
    from areal_env_client import AgentRunner

    base = os.environ["OPENAI_BASE_URL"]

    async def agent(item: dict) -> float:
        async with httpx.AsyncClient(timeout=120) as http:  # tagged with the session by the hook
            r = await http.post(
                base + "/chat/completions",
                json={"model": "policy", "messages": [{"role": "user", "content": item["q"]}]},
                headers={"Authorization": f"Bearer {KEY}"},
            )
            r.raise_for_status()
            text = r.json()["choices"][0]["message"]["content"] or ""
        await asyncio.sleep(spec["think"])  # the session stays open, as a real agent's does
        return float(len(text) % 2)

    items = [{"q": f"Name thing number {i}."} for i in range(spec["first"], spec["last"])]
    results = asyncio.run(
        AgentRunner(base.removesuffix("/v1"), KEY).run(
            agent,
            items,
            concurrency=spec["concurrency"],
            group_size=spec["group"],
            group_prefix=spec["prefix"],
            progress=False,
            backoff=0.5,
            max_backoff=3.0,
            retry_for=900.0,
        )
    )
    out = [
        {"sessions": r.session_ids, "errors": r.errors, "attempts": r.attempts, "waits": r.waits}
        for r in results
    ]
    Path(spec["out"]).write_text(json.dumps(out))


# -- the service -------------------------------------------------------------------------------


class Server:
    """One ``areal-env serve-training`` process, its output collected in the background."""

    def __init__(self, cfg_path: Path, env: dict[str, str], log: Path) -> None:
        self.log_file = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "areal_env.cli", "serve-training", str(cfg_path)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.lines.append(line)
            self.log_file.write(line)
            self.log_file.flush()

    def said(self, text: str) -> str | None:
        """The first line that starts with ``text`` (the service's own words, not its logs)."""
        return next((x.strip() for x in self.lines if x.startswith(text)), None)

    def wait_listening(self, timeout: float = 600) -> bool:
        """True once listening; False if it exited first (e.g. the trial already finished)."""
        deadline = time.monotonic() + timeout
        while not self.said("areal-env any-agent server listening at"):
            if self.proc.poll() is not None:
                return False
            if time.monotonic() > deadline:
                raise TimeoutError("serve-training did not start:\n" + "".join(self.lines[-40:]))
            time.sleep(0.2)
        return True

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            time.sleep(0.2)  # the last lines
            self.log_file.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_model(folder: Path) -> str:
    from areal_env.engine.models import DEFAULT_MODEL, resolve_model_path
    from tests.gpu.make_tiny_model import make_tiny_model

    return str(make_tiny_model(str(resolve_model_path(DEFAULT_MODEL)), str(folder)))


def _ledger(store: str, run_dir: Path) -> tuple[list[tuple[str, int, str]], int]:
    """The store's ``consumed`` ledger and how many trajectories are still pending."""
    if store.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(store) as conn:
            ledger = conn.execute("SELECT session_id, step, outcome FROM consumed").fetchall()
            pending = conn.execute("SELECT COUNT(*) FROM trajectories").fetchone()[0]
        return [tuple(r) for r in ledger], int(pending)  # type: ignore[misc]
    import sqlite3

    db = sqlite3.connect(run_dir / "service.db")
    try:
        ledger = db.execute("SELECT session_id, step, outcome FROM consumed").fetchall()
        pending = db.execute("SELECT COUNT(*) FROM trajectories").fetchone()[0]
    finally:
        db.close()
    return ledger, int(pending)


def _fresh_database(server_url: str) -> str:
    """A new, empty database on the PostgreSQL server at ``server_url``: one run, one store."""
    import psycopg

    name = f"bench_{os.getpid()}_{int(time.time() * 1000)}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return server_url.rsplit("/", 1)[0] + "/" + name


def _drop_database(server_url: str | None, store: str) -> None:
    import psycopg

    assert server_url is not None
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {store.rsplit('/', 1)[1]}")


def run_once(args: argparse.Namespace, store_kind: str, postgres_url: str | None) -> dict:
    rng = random.Random(f"{args.seed}-{store_kind}")
    work = Path(tempfile.mkdtemp(prefix=f"service-restart-{store_kind}-"))
    steps = args.items // args.batch
    port = _free_port()
    model = _tiny_model(work / "tiny-model") if args.model == "tiny" else "smollm2-135m-instruct"
    service: dict[str, Any] = {
        "port": port,
        "api_keys": [KEY],
        "health_interval": 1.0,
        "drain_timeout": args.drain_timeout,
        "drain_retry_after": 1,
        "admission_timeout": 5,
    }
    store = ""
    if store_kind == "postgres":
        assert postgres_url is not None
        store = service["store"] = _fresh_database(postgres_url)
    config = {
        "experiment_name": "bench",
        "trial_name": f"restart-{store_kind}",
        "fileroot": str(work / "outputs"),
        "model": {"path": model, "num_threads": 1},
        "proxy": {"default_max_tokens": 6},
        "gconfig": {"max_new_tokens": 6, "temperature": 1.0},
        "rollout": {"n_samples": args.group, "batch_size": args.batch, "max_head_offpolicyness": 1},
        "actor": {"ppo_n_minibatches": 1, "lr": 1e-5},
        "trainer": {
            "total_train_steps": steps,
            "save_freq_steps": 1,
            "tensorboard": False,
            "progress": False,
        },
        "service": service,
    }
    cfg_path = work / "service.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    run_dir = work / "outputs" / "bench" / f"restart-{store_kind}"
    pythonpath = os.pathsep.join([str(ROOT), str(ROOT / "client")])
    env = {**os.environ, "PYTHONPATH": pythonpath, "PYTHONUNBUFFERED": "1"}
    kinds = list(SIGNALS)
    order = [kinds[i % len(kinds)] for i in range(args.restarts)]
    rng.shuffle(order)

    t0 = time.monotonic()
    servers = [Server(cfg_path, env, work / "server-0.log")]
    agents: list[tuple[subprocess.Popen, Path]] = []
    stops: list[dict[str, Any]] = []
    try:
        if not servers[0].wait_listening():
            raise RuntimeError("serve-training exited at first:\n" + "".join(servers[0].lines))
        per_agent = -(-args.items // args.agents)
        for k in range(args.agents):
            first, last = k * per_agent, min(args.items, (k + 1) * per_agent)
            if first >= last:
                break
            out = work / f"agent-{k}.json"
            spec = {
                "first": first,
                "last": last,
                "group": args.group,
                "prefix": f"agent{k}",
                "think": args.think,
                "concurrency": args.concurrency,
                "out": str(out),
            }
            proc = subprocess.Popen(
                [sys.executable, __file__, "--agent-worker", json.dumps(spec)],
                env={
                    **env,
                    "OPENAI_BASE_URL": f"http://127.0.0.1:{port}/v1",
                    "OPENAI_API_KEY": KEY,
                },
                stdout=subprocess.DEVNULL,
                stderr=(work / f"agent-{k}.log").open("w"),
            )
            agents.append((proc, out))
        for name in order:
            server = servers[-1]
            delay = rng.uniform(args.min_delay, args.max_delay)
            time.sleep(delay)
            if server.proc.poll() is not None:
                break  # training finished before this stop
            server.proc.send_signal(SIGNALS[name])
            status = server.wait(timeout=600)
            said = server.said("stopped at step") or server.said("training finished")
            stops.append({"signal": name, "after_s": round(delay, 1), "exit": status, "said": said})
            servers.append(Server(cfg_path, env, work / f"server-{len(servers)}.log"))
            if not servers[-1].wait_listening():
                break  # the trial had finished: the new start says so and exits
        agent_results = []
        for proc, out in agents:
            proc.wait(timeout=args.timeout)
            agent_results += json.loads(out.read_text()) if out.is_file() else []
        final_status = servers[-1].wait(timeout=args.timeout)
    finally:
        for proc in [p for p, _ in agents] + [s.proc for s in servers]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    wall = time.monotonic() - t0

    ledger, pending = _ledger(store, run_dir)
    trained = {sid for sid, _, outcome in ledger if outcome == "trained"}
    samples = [
        (sid, err)
        for r in agent_results
        for sid, err in zip(r["sessions"], r["errors"], strict=True)
    ]
    acknowledged = {sid for sid, err in samples if err is None and sid is not None}
    dumped = Counter(
        json.loads(line)["session_id"]
        for f in (run_dir / "rollout").rglob("*.jsonl")
        for line in f.read_text().splitlines()
        if line.strip()
    )
    steps_done = [
        json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x
    ]
    starts = [s.said("service store") for s in servers]
    if not args.keep:  # checkpoints of every step: hundreds of MB
        shutil.rmtree(work, ignore_errors=True)
        if store:
            _drop_database(postgres_url, store)
    return {
        "store": store_kind,
        "attempted": args.items * args.group,
        "acknowledged": len(acknowledged),
        "trained": len(acknowledged & trained),
        "lost": len(acknowledged - trained),
        "dropped": sum(1 for _, err in samples if err is not None)
        + (args.items * args.group - len(samples)),
        "trained_twice": sum(1 for n in dumped.values() if n > 1),
        "pending_left": pending,
        "attempts": sum(sum(r["attempts"]) for r in agent_results),
        "waits": sum(sum(r["waits"]) for r in agent_results),
        "steps": max(steps_done, default=0),
        "total_steps": steps,
        "final_exit": final_status,
        "stops": stops,
        "starts": len(servers),
        "store_at_last_start": starts[-1],
        "errors": sorted({err for _, err in samples if err is not None})[:5],
        "wall_s": round(wall, 1),
        "work_dir": str(work) if args.keep else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", choices=["sqlite", "postgres", "both"], default="both")
    ap.add_argument("--agents", type=int, default=3, help="agent processes")
    ap.add_argument("--concurrency", type=int, default=2, help="sessions at once per agent")
    ap.add_argument("--items", type=int, default=48, help="items (one GRPO group each)")
    ap.add_argument("--group", type=int, default=2, help="samples per item (rollout.n_samples)")
    ap.add_argument("--batch", type=int, default=2, help="groups per step (rollout.batch_size)")
    ap.add_argument("--restarts", type=int, default=6, help="stops (TERM/INT/KILL) and restarts")
    ap.add_argument("--min-delay", type=float, default=1.0, help="seconds after a start, at least")
    ap.add_argument("--max-delay", type=float, default=6.0, help="... and at most")
    ap.add_argument("--think", type=float, default=2.0, help="seconds each episode thinks")
    ap.add_argument("--drain-timeout", type=float, default=10.0, help="service.drain_timeout")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", choices=["tiny", "default"], default="tiny")
    ap.add_argument("--postgres-url", default=None, help="a PostgreSQL server to use")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for the agents")
    ap.add_argument("--keep", action="store_true", help="keep the run folders and databases")
    ap.add_argument("--agent-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.agent_worker is not None:
        agent_worker(json.loads(args.agent_worker))
        return 0
    if args.items % args.batch:
        ap.error("--items must be a multiple of --batch (the steps train every item)")
    sys.path.insert(0, str(ROOT))
    kinds = ["sqlite", "postgres"] if args.store == "both" else [args.store]
    out: dict[str, Any] = {}
    with _postgres(args, "postgres" in kinds) as pg_url:
        for kind in kinds:
            result = run_once(args, kind, pg_url)
            print(json.dumps(result), flush=True)
            out[kind] = {
                k: result[k]
                for k in (
                    "attempted",
                    "acknowledged",
                    "trained",
                    "lost",
                    "dropped",
                    "trained_twice",
                )
            }
            out[kind]["stops"] = [s["signal"] for s in result["stops"]]
    out["lost"] = sum(v["lost"] for v in out.values() if isinstance(v, dict))
    out["dropped"] = sum(v["dropped"] for k, v in out.items() if isinstance(v, dict))
    print(json.dumps(out), flush=True)
    return 0 if out["lost"] == 0 and out["dropped"] == 0 else 1


class _postgres:
    """``--postgres-url``, or a throwaway server for the run (None when not needed)."""

    def __init__(self, args: argparse.Namespace, needed: bool) -> None:
        self.url, self.needed, self.server = args.postgres_url, needed, None

    def __enter__(self) -> str | None:
        if not self.needed or self.url:
            return self.url
        from tests.fixtures.postgres import postgres_server

        self.server = postgres_server()
        return self.server.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.server is not None:
            self.server.__exit__(*exc)


if __name__ == "__main__":
    sys.exit(main())
