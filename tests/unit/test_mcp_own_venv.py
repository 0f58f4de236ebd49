"""An MCP server from its own venv: ``mcp-server-sqlite`` (published by the MCP project) needs
``mcp<2`` and crashes on the core's mcp 2.x, so it runs from a venv of its own (``make venv``
makes ``.venv-mcp-sqlite``; without it the test makes one), named by a path relative to the
user's config file, its database too. An episode of ``AenvAgent`` built from that config runs
through the real proxy (scripted engine) against the real server process."""

from __future__ import annotations

import importlib.metadata
import json
import sqlite3
import subprocess
from pathlib import Path

import pytest

from areal_env.api.config import ExperimentConfig, load_config
from areal_env.envs.agent import AenvAgent
from tests.fixtures.proxy import export_session, open_session

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def sqlite_server_venv(tmp_path_factory) -> Path:
    """The venv that runs ``mcp-server-sqlite``: ``make venv``'s, else one made now by the
    same Makefile target (so CI on a clean machine and a developer's checkout agree)."""
    venv = REPO / ".venv-mcp-sqlite"
    if not (venv / ".installed").is_file():
        venv = tmp_path_factory.mktemp("mcp-sqlite") / "venv"
        subprocess.run(
            ["make", "-C", str(REPO), "venv-mcp-sqlite", f"MCP_SQLITE_VENV={venv}"],
            check=True,
            capture_output=True,
            timeout=900,
        )
    return venv


@pytest.fixture
def proxy_server(scripted_proxy):
    return scripted_proxy


def _call(name: str, args: dict) -> str:
    return f'<tool_call>[{{"name": "{name}", "arguments": {json.dumps(args)}}}]</tool_call>'


def test_the_server_needs_an_sdk_of_its_own(sqlite_server_venv):
    """The premise: the server's venv holds mcp 1.x, the core's holds mcp 2.x."""
    assert int(importlib.metadata.version("mcp").split(".")[0]) >= 2
    theirs = subprocess.run(
        [
            str(sqlite_server_venv / "bin" / "python"),
            "-c",
            "import importlib.metadata as m; print(m.version('mcp'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert theirs.startswith("1."), theirs


async def test_an_episode_on_mcp_server_sqlite_from_its_own_venv(
    sqlite_server_venv, proxy_server, tmp_path, monkeypatch
):
    project = tmp_path / "project"
    project.mkdir()
    (project / "servers").symlink_to(sqlite_server_venv)  # the user's venv, beside the config
    db = sqlite3.connect(project / "shop.db")
    db.execute("CREATE TABLE items (name TEXT)")
    db.executemany("INSERT INTO items VALUES (?)", [("pen",), ("cup",), ("hat",)])
    db.commit()
    db.close()
    (project / "reward.py").write_text(
        "def reward(data, final_answer, tool_calls):\n"
        "    ok = [c['name'] for c in tool_calls if not c['is_error']]\n"
        "    return float(ok == ['write_query', 'read_query'] and data['answer'] in final_answer)\n"
    )
    (project / "config.yaml").write_text(
        "workflow: areal_env.AenvAgent\n"
        "workflow_kwargs:\n"
        "  mcp_config:\n"
        "    name: shop\n"
        "    command: servers/bin/mcp-server-sqlite\n"
        "    args: [--db-path, shop.db]\n"
        "  reward_fn: reward.py:reward\n"
        "  max_turns: 3\n"
    )
    monkeypatch.chdir(tmp_path)  # the command runs elsewhere: paths follow the config file
    cfg = load_config(ExperimentConfig, project / "config.yaml")
    agent = AenvAgent(**cfg.workflow_kwargs)
    engine = proxy_server.state.engine
    engine.push(
        _call("write_query", {"query": "INSERT INTO items VALUES ('mug')"}),
        _call("read_query", {"query": "SELECT COUNT(*) AS n FROM items"}),
        "There are 4 items.",
    )
    sid, key = open_session(proxy_server)
    item = {"question": "Add a mug, then count the items.", "answer": "4"}
    reward = await agent.run(item, base_url=proxy_server.openai_base_url, api_key=key)
    assert reward == 1.0
    last_prompt = proxy_server.state.tokenizer.decode(engine.requests[-1].input_ids)
    assert "4" in last_prompt.split("<tool_call>")[-1]  # the server's answer reached the model
    assert len(export_session(proxy_server, sid)["interactions"]) == 3
    rows = sqlite3.connect(project / "shop.db").execute("SELECT name FROM items").fetchall()
    assert sorted(r[0] for r in rows) == ["cup", "hat", "mug", "pen"]
