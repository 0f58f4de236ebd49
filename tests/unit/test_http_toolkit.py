"""The shared HTTP toolkit: body limits, keys, one error vocabulary, the threaded runner."""

from __future__ import annotations

import socket

import httpx
import pytest
from fastapi import FastAPI, Request

from areal_env.http import routes
from areal_env.http.body import read_json, request_key
from areal_env.http.client import error_message
from areal_env.http.codec import dumps, json_response, loads
from areal_env.http.errors import (
    ANTHROPIC_ERROR_TYPES,
    OPENAI_ERROR_TYPES,
    HTTPError,
    install_error_handlers,
)
from areal_env.http.net import bind_socket, is_loopback, url_host
from areal_env.http.runner import ServerThread


def _app() -> tuple[FastAPI, dict[str, int]]:
    app = FastAPI()
    counters: dict[str, int] = {}
    install_error_handlers(app, counters)

    @app.post("/echo")
    async def echo(request: Request):
        body = await read_json(request, max_bytes=1000, object_only=True)
        return json_response({"body": body, "key": request_key(request)})

    @app.post(routes.MESSAGES)
    async def messages(request: Request):
        raise HTTPError(503, "busy")

    @app.get("/gone")
    async def gone():
        raise HTTPError(410, "ended", code="session_ended")

    @app.get("/boom")
    async def boom():
        raise RuntimeError("secret detail")

    return app, counters


@pytest.fixture(scope="module")
def server():
    app, counters = _app()
    srv = ServerThread(app, "127.0.0.1", 0, name="toolkit-test")
    srv.start()
    srv.counters = counters  # type: ignore[attr-defined]
    yield srv
    srv.stop()
    assert not srv.running


def test_keys_limits_and_error_shapes(server):
    with httpx.Client(base_url=server.base_url) as c:
        r = c.post("/echo", json={"a": 1}, headers={"Authorization": "bearer  k1"})
        assert r.json() == {"body": {"a": 1}, "key": "k1"}
        r = c.post("/echo", json={"a": 1}, headers={"x-api-key": "k2"})
        assert r.json()["key"] == "k2"
        # over the limit, declared and chunked
        r = c.post("/echo", content=b'{"a": "' + b"x" * 2000 + b'"}')
        assert r.status_code == 413 and "exceeds 1000 bytes" in r.json()["error"]["message"]
        r = c.post("/echo", content=iter([b'{"a": "', b"x" * 2000, b'"}']))
        assert r.status_code == 413
        for body, msg in ((b"", "empty"), (b"{nope", "not valid JSON"), (b"[1]", "JSON object")):
            r = c.post("/echo", content=body)
            assert r.status_code == 400 and msg in r.json()["error"]["message"]
            assert r.json()["error"]["type"] == "invalid_request_error"
        # one vocabulary: OpenAI shape off the Anthropic routes, Anthropic shape on them
        r = c.get("/gone")
        assert r.status_code == 410
        assert r.json()["error"] == {
            "message": "ended",
            "type": OPENAI_ERROR_TYPES[410],
            "param": None,
            "code": "session_ended",
        }
        r = c.post(routes.MESSAGES, json={})
        assert r.status_code == 503
        assert r.json() == {
            "type": "error",
            "error": {"type": ANTHROPIC_ERROR_TYPES[503], "message": "busy"},
        }
        r = c.get("/nowhere")
        assert r.status_code == 404 and "no route GET /nowhere" in error_message(r.json(), "")
        r = c.get("/boom")
        assert r.status_code == 500 and "secret" not in r.text
    assert server.counters["errors"] >= 9


def test_status_tables_cover_the_same_statuses():
    assert set(OPENAI_ERROR_TYPES) == set(ANTHROPIC_ERROR_TYPES)


def test_bind_sets_nodelay_capable_socket_and_loopback_rules():
    sock = bind_socket("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP and sock.getsockname()[1] > 0
    finally:
        sock.close()
    assert is_loopback("127.0.0.5") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1")
    assert url_host("0.0.0.0") == "127.0.0.1" and url_host("::1") == "[::1]"


def test_codec_round_trips_what_orjson_refuses():
    assert loads(dumps({1: "a"})) == {"1": "a"}
    assert loads(dumps({"n": 2**70})) == {"n": 2**70}
    assert error_message({"detail": "d"}, "x") == "d" and error_message(3, "x") == "x"


def test_console_logging_keeps_http_libraries_to_warnings():
    import logging

    from areal_env.http.logs import NOISY_HTTP_LOGGERS, configure_console_logging

    saved = {n: logging.getLogger(n).level for n in (*NOISY_HTTP_LOGGERS, "mcp")}
    try:
        for n in saved:
            logging.getLogger(n).setLevel(logging.NOTSET)
        configure_console_logging(quiet=("mcp",))
        assert {n: logging.getLogger(n).level for n in saved} == dict.fromkeys(
            saved, logging.WARNING
        )
        assert not logging.getLogger("httpx2").isEnabledFor(logging.INFO)
    finally:
        for n, level in saved.items():
            logging.getLogger(n).setLevel(level)
