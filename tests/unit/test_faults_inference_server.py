"""An inference server killed mid-generation and restarted (issue 15, item 3).

The server is a real ``areal-env serve`` app (SGLang's protocol over HTTP) in its own process,
on a scripted engine so a generation takes a known second; the client is the real
``SGLangEngine``. The process is SIGKILLed while a request is in flight, and started again on the
same port:

- a plain request is re-sent to the restarted server and completes, once (one answer, no
  duplicate tokens): nothing lost, and the next requests go on;
- a stream that had started cannot be re-sent without duplicating tokens: it fails with a clear
  ``EngineUnavailableError`` naming the server (the proxy answers 503, the agent's episode is
  rejected and counted), and the next request succeeds on the restarted server.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_env.api.engine import EngineUnavailableError
from areal_env.api.io import GenerationConfig, ModelRequest
from areal_env.engine.sglang import SGLangEngine
from areal_env.http.net import bind_socket

ROOT = Path(__file__).resolve().parents[2]
SERVER = """
import sys
from transformers import AutoTokenizer
from areal_env.engine.models import DEFAULT_MODEL, resolve_model_path
from areal_env.engine.server import create_app
from areal_env.engine.testing import Reply, ScriptedEngine
from areal_env.http.net import bind_socket
from areal_env.http.runner import serve_forever

port, delay = int(sys.argv[1]), float(sys.argv[2])
tok = AutoTokenizer.from_pretrained(str(resolve_model_path(DEFAULT_MODEL)))
engine = ScriptedEngine(tok, default=Reply(text="The answer is 5.", delay=delay))
serve_forever(create_app(engine), bind_socket("127.0.0.1", port),
              on_ready=lambda: print("READY", flush=True), log_level="error")
"""


def _start(port: int, delay: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(port), str(delay)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    line = proc.stdout.readline()
    assert "READY" in line, line
    return proc


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


@pytest.fixture
def port():
    s = bind_socket("127.0.0.1", 0)
    p = s.getsockname()[1]
    s.close()
    return p


def _req(rid: str) -> ModelRequest:
    return ModelRequest(rid=rid, input_ids=[1, 2, 3], gconfig=GenerationConfig(max_new_tokens=16))


@pytest.mark.slow
def test_plain_request_survives_a_killed_and_restarted_server(port, tokenizer):
    procs = [_start(port, delay=1.0)]
    eng = SGLangEngine([f"127.0.0.1:{port}"], max_retries=8, retry_backoff=0.25)
    try:
        eng.initialize()

        async def scenario():
            task = asyncio.create_task(eng.agenerate(_req("r1")))
            await asyncio.sleep(0.4)  # the generation is in flight on the server
            await asyncio.to_thread(_kill, procs[0])
            await asyncio.sleep(0.3)
            procs.append(await asyncio.to_thread(_start, port, 0.05))
            return await task

        t0 = time.monotonic()
        resp = asyncio.run(scenario())
        expected = tokenizer.encode("The answer is 5.", add_special_tokens=False)
        assert resp.output_tokens[: len(expected)] == expected  # one answer, not two
        assert len(resp.output_tokens) == len(expected) + 1  # + eos
        assert resp.stop_reason == "stop"
        assert time.monotonic() - t0 < 30
        # and the work goes on
        again = asyncio.run(eng.agenerate(_req("r2")))
        assert again.output_tokens == resp.output_tokens
    finally:
        eng.destroy()
        for p in procs:
            if p.poll() is None:
                _kill(p)


@pytest.mark.slow
def test_broken_stream_fails_clearly_and_the_next_request_succeeds(port, tokenizer):
    procs = [_start(port, delay=0.3)]  # 0.3 s between streamed tokens
    eng = SGLangEngine([f"127.0.0.1:{port}"], max_retries=8, retry_backoff=0.25)
    try:
        eng.initialize()

        async def scenario():
            got = []
            with pytest.raises(EngineUnavailableError, match=f"127.0.0.1:{port}"):
                async for chunk in eng.agenerate_stream(_req("s1")):
                    got.extend(chunk.token_ids)
                    if got:
                        await asyncio.to_thread(_kill, procs[0])
            assert got  # it had started
            procs.append(await asyncio.to_thread(_start, port, 0.0))
            return await eng.agenerate(_req("s2"))

        resp = asyncio.run(scenario())
        assert resp.stop_reason == "stop" and resp.output_tokens
    finally:
        eng.destroy()
        for p in procs:
            if p.poll() is None:
                _kill(p)
