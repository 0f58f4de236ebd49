"""The command lines' logging: progress on the console, everything in the run's log file."""

from __future__ import annotations

import logging

import pytest

from areal_env.http.logs import configure_run_logging


@pytest.fixture
def fresh_root():
    root = logging.getLogger()
    saved, level = list(root.handlers), root.level
    yield root
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    for h in saved:
        root.addHandler(h)
    root.setLevel(level)
    logging.getLogger("mcp.client.streamable_http").setLevel(logging.NOTSET)


def test_progress_on_the_console_the_rest_in_the_file(tmp_path, capsys, fresh_root):
    path = configure_run_logging(tmp_path / "run" / "train.log", quiet=("mcp.client",))
    logging.getLogger("areal_env.trainer.ppo").info("training 10 steps")
    logging.getLogger("areal_env.proxy.sessions").info("expired 3 idle session(s)")
    logging.getLogger("areal_env.trainer.eval").info("eval v0: success 20.3%")
    logging.getLogger("mcp.client.streamable_http").info("GET stream disconnected")
    logging.getLogger("areal_env.engine.batch_worker").warning("a row was aborted")
    logging.getLogger("httpx").info("HTTP Request: POST /generate")
    for h in fresh_root.handlers:
        h.flush()
    console = capsys.readouterr().err
    assert "training 10 steps" in console and "eval v0: success 20.3%" in console
    assert "a row was aborted" in console
    assert "expired 3 idle" not in console and "GET stream" not in console
    text = path.read_text()
    assert "training 10 steps" in text and "expired 3 idle session(s)" in text
    assert "a row was aborted" in text
    assert "GET stream" not in text and "HTTP Request" not in text  # quiet everywhere
    # a second call replaces the handlers instead of doubling every line
    configure_run_logging(tmp_path / "run" / "train.log")
    logging.getLogger("areal_env.trainer.ppo").info("once")
    for h in fresh_root.handlers:
        h.flush()
    assert capsys.readouterr().err.count("once") == 1
    assert path.read_text().count("once") == 1
