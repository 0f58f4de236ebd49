"""Proxy overhead: a 20-turn tool-calling conversation through the proxy vs the engine directly.

The engine is an instant fixed-output double (it always "generates" the same tool call), so
only the proxy is measured: HTTP, protocol conversion, parent lookup, splicing, rendering of the
new turns, output parsing, recording and response building. The tokenizer and chat template are
the real default model's. The proxy runs in a child process (as it would next to agents that
live elsewhere); the client is a minimal keep-alive HTTP/1.1 client so that the figures are the
proxy's, not an SDK's.

Run: ``.venv/bin/python bench/proxy_overhead.py [--conversations 20] [--turns 20] [--quick]``.
The last line is one JSON object:
``{"p50_overhead_ms", "p99_overhead_ms", "turn20_vs_turn1", "rps_64_sessions", ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from areal_env.api.io import ModelRequest, ModelResponse, StreamChunk  # noqa: E402

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up a record by its query string.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "what to look up"}},
                "required": ["query"],
            },
        },
    }
]
CALL_TEXT = '<tool_call>[{"name": "lookup", "arguments": {"query": "record 7"}}]</tool_call>'
WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
    "sigma tau upsilon phi chi psi omega"
).split()


def tool_result(turn: int) -> str:
    """~150 tokens of tool output, different per turn."""
    words = [WORDS[(turn * 7 + i * 3) % len(WORDS)] for i in range(110)]
    return f"Record {turn}: " + " ".join(words) + f". Total {turn * 17} units."


class FixedEngine:
    """Instant engine double: every request 'generates' the same tool call."""

    def __init__(self, tokenizer) -> None:
        self.output = tokenizer.encode(CALL_TEXT, add_special_tokens=False) + [
            tokenizer.convert_tokens_to_ids("<|im_end|>")
        ]
        self.max_context_len = 8192
        self.eos_token_ids = [self.output[-1]]
        self.model_path = "fixed"

    def _response(self, req: ModelRequest) -> ModelResponse:
        n = len(self.output)
        return ModelResponse(
            input_tokens=req.input_ids,
            output_tokens=list(self.output),
            output_logprobs=[-0.5] * n,
            output_versions=[0] * n,
            stop_reason="stop",
            rid=req.rid,
        )

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        return self._response(req)

    async def agenerate_stream(self, req: ModelRequest):
        resp = self._response(req)
        yield StreamChunk(
            list(resp.output_tokens), list(resp.output_logprobs), list(resp.output_versions), resp
        )

    def get_version(self) -> int:
        return 0


def load_tokenizer():
    from transformers import AutoTokenizer

    from areal_env.engine.models import DEFAULT_MODEL, resolve_model_path

    return AutoTokenizer.from_pretrained(str(resolve_model_path(DEFAULT_MODEL)))


# ---- the server side (child process) --------------------------------------------------------


def serve() -> None:
    import logging

    from areal_env.api.config import ProxyConfig
    from areal_env.proxy.server import ProxyServer

    logging.basicConfig(level=logging.WARNING)
    if os.environ.get("BENCH_NO_GC"):
        import gc

        gc.disable()
    tok = load_tokenizer()
    server = ProxyServer(FixedEngine(tok), tok, ProxyConfig(max_sessions=4096), model_name="fixed")
    server.start()
    print(json.dumps({"base_url": server.base_url, "admin_key": server.admin_key}), flush=True)
    sys.stdin.read()  # until the parent closes our stdin
    server.stop()


# ---- a minimal HTTP/1.1 keep-alive client -----------------------------------------------------


class RawClient:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def connect(self) -> RawClient:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def post(self, path: str, body: bytes, key: str) -> tuple[int, bytes]:
        assert self.reader and self.writer
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.writer.write(head + body)
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        length = 0
        for line in lines[1:]:
            if line.lower().startswith("content-length:"):
                length = int(line.split(":", 1)[1])
        data = await self.reader.readexactly(length)
        return status, data

    def close(self) -> None:
        if self.writer:
            self.writer.close()


async def start_session(client: RawClient, admin_key: str) -> str:
    status, data = await client.post("/rl/start_session", b"{}", admin_key)
    assert status == 200, data
    return json.loads(data)["api_key"]


def first_messages() -> list[dict]:
    return [
        {"role": "system", "content": "You are a research assistant. Use tools to look things up."},
        {"role": "user", "content": "Collect records 1 to 20 and summarise them."},
    ]


async def turn_request(client: RawClient, key: str, messages: list[dict], turn: int) -> float:
    """One turn: send the history, append the reply and a tool result. Returns the round trip."""
    body = json.dumps(
        {"model": "fixed", "messages": messages, "tools": TOOLS, "max_tokens": 64}
    ).encode()
    t0 = time.perf_counter()
    status, data = await client.post("/v1/chat/completions", body, key)
    dt = time.perf_counter() - t0
    if status != 200:
        raise RuntimeError(f"turn {turn}: HTTP {status}: {data[:300]!r}")
    msg = json.loads(data)["choices"][0]["message"]
    call = msg["tool_calls"][0]
    messages.append(msg)
    messages.append({"role": "tool", "tool_call_id": call["id"], "content": tool_result(turn)})
    return dt


async def conversation(
    client: RawClient, key: str, turns: int, timings: list[list[float]] | None
) -> None:
    messages = first_messages()
    for turn in range(turns):
        dt = await turn_request(client, key, messages, turn)
        if timings is not None:
            timings[turn].append(dt)


async def cpu_per_turn(
    client: RawClient, admin_key: str, pid: int, turns: int, n: int
) -> tuple[float, float]:
    """Server CPU (ms) per first-turn request and per last-turn request, each over ``n`` requests.

    CPU time, unlike wall time, does not depend on what else the machine is running.
    """
    keys = [await start_session(client, admin_key) for _ in range(n)]
    histories = [first_messages() for _ in range(n)]
    cpu0 = cpu_seconds(pid)
    for k, h in zip(keys, histories, strict=True):
        await turn_request(client, k, h, 0)
    first = (cpu_seconds(pid) - cpu0) / n
    for turn in range(1, turns - 1):
        for k, h in zip(keys, histories, strict=True):
            await turn_request(client, k, h, turn)
    cpu0 = cpu_seconds(pid)
    for k, h in zip(keys, histories, strict=True):
        await turn_request(client, k, h, turns - 1)
    last = (cpu_seconds(pid) - cpu0) / n
    return first * 1e3, last * 1e3


async def direct_timings(tok, turns: int, reps: int) -> list[float]:
    """The same engine called directly with each turn's prompt ids (the baseline)."""
    from areal_env.proxy.render import ChatRenderer

    engine = FixedEngine(tok)
    renderer = ChatRenderer(tok)
    ids = renderer.render_prompt([{"role": "user", "content": "x"}], TOOLS)
    out = []
    for _ in range(reps * turns):
        req = ModelRequest(input_ids=ids)
        t0 = time.perf_counter()
        await engine.agenerate(req)
        out.append(time.perf_counter() - t0)
        ids = ids + engine.output
    return out


def cpu_seconds(pid: int) -> float:
    """CPU time of a process so far, all its threads (Linux /proc).

    Nanosecond on-CPU time from each thread's ``schedstat`` where available (the server answers
    in a uvicorn thread, and ``stat``'s clock ticks are 10 ms: too coarse for samples of ~100
    requests of ~1 ms); user + system ticks from ``stat`` otherwise.
    """
    try:
        total = 0
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except FileNotFoundError:  # a thread that just ended
                continue
        if total:
            return total / 1e9
    except (OSError, ValueError):
        pass
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run(args: argparse.Namespace, base_url: str, admin_key: str, tok, pid: int) -> dict:
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    port_i = int(port)

    # warm-up
    c = await RawClient(host, port_i).connect()
    for _ in range(2):
        await conversation(c, await start_session(c, admin_key), args.turns, None)

    # sequential latency: one conversation at a time
    timings: list[list[float]] = [[] for _ in range(args.turns)]
    cpu0 = cpu_seconds(pid)
    for _ in range(args.conversations):
        await conversation(c, await start_session(c, admin_key), args.turns, timings)
    server_cpu_ms = (cpu_seconds(pid) - cpu0) / (args.conversations * (args.turns + 1)) * 1e3
    cpu_turn1, cpu_turn20 = await cpu_per_turn(c, admin_key, pid, args.turns, args.cpu_samples)
    c.close()
    direct = await direct_timings(tok, args.turns, args.conversations)
    direct_p50 = statistics.median(direct)
    overhead = [t - direct_p50 for per_turn in timings for t in per_turn]
    overhead.sort()
    p50 = overhead[len(overhead) // 2]
    p99 = overhead[min(len(overhead) - 1, int(len(overhead) * 0.99))]
    per_turn_p50 = [statistics.median(t) - direct_p50 for t in timings]

    # throughput: 64 concurrent sessions, each a full conversation
    clients = [await RawClient(host, port_i).connect() for _ in range(args.sessions)]
    keys = [await start_session(cl, admin_key) for cl in clients]
    cpu0 = cpu_seconds(pid)
    t0 = time.perf_counter()
    await asyncio.gather(
        *(conversation(cl, k, args.turns, None) for cl, k in zip(clients, keys, strict=True))
    )
    wall = time.perf_counter() - t0
    server_cpu_64 = cpu_seconds(pid) - cpu0
    for cl in clients:
        cl.close()
    rps = args.sessions * args.turns / wall

    return {
        "p50_overhead_ms": round(p50 * 1e3, 3),
        "p99_overhead_ms": round(p99 * 1e3, 3),
        "turn20_vs_turn1": round(per_turn_p50[-1] / per_turn_p50[0], 3),
        "rps_64_sessions": round(rps, 1),
        "turn1_overhead_ms": round(per_turn_p50[0] * 1e3, 3),
        "turn20_overhead_ms": round(per_turn_p50[-1] * 1e3, 3),
        "direct_engine_p50_ms": round(direct_p50 * 1e3, 4),
        "server_cpu_ms_per_request": round(server_cpu_ms, 3),
        "server_cpu_ms_turn1": round(cpu_turn1, 3),
        "server_cpu_ms_turn20": round(cpu_turn20, 3),
        "turn20_vs_turn1_cpu": round(cpu_turn20 / cpu_turn1, 3) if cpu_turn1 else None,
        "server_cpu_bound_rps": round(args.sessions * args.turns / server_cpu_64, 1)
        if server_cpu_64
        else None,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "requests_timed": len(overhead),
        "cpus": os.cpu_count(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=20)
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--cpu-samples", type=int, default=150, help="requests per CPU-time sample")
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer timed conversations and CPU samples (a rough figure in ~1/3 of the time)",
    )
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.conversations = min(args.conversations, 8)
        args.cpu_samples = min(args.cpu_samples, 50)
    if args.serve:
        serve()
        return
    tok = load_tokenizer()
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        info = json.loads(child.stdout.readline())
        result = asyncio.run(run(args, info["base_url"], info["admin_key"], tok, child.pid))
        prompt_tokens = _final_prompt_tokens(tok, args.turns)
        result["final_prompt_tokens"] = prompt_tokens
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    print(json.dumps(result))


def _final_prompt_tokens(tok, turns: int) -> int:
    """Prompt length at the last turn (to show the conversation size)."""
    from areal_env.proxy.render import ChatRenderer

    renderer = ChatRenderer(tok)
    messages: list[dict] = [
        {"role": "system", "content": "You are a research assistant. Use tools to look things up."},
        {"role": "user", "content": "Collect records 1 to 20 and summarise them."},
    ]
    for turn in range(turns - 1):
        call = {
            "id": f"call_{turn}",
            "type": "function",
            "function": {"name": "lookup", "arguments": '{"query": "record 7"}'},
        }
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": tool_result(turn)})
    return len(renderer.render_prompt(messages, TOOLS))


if __name__ == "__main__":
    main()
