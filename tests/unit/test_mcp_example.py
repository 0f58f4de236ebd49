"""examples/mcp: the repository it builds, its reward, and an episode of its config through the
real proxy (scripted engine) and the real ``mcp-server-git``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from areal_env.api.imports import import_string, load_file_module
from tests.fixtures.proxy import open_session

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "mcp"


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    build = load_file_module(str(EXAMPLE / "build_repo.py"))
    return build.build(tmp_path_factory.mktemp("mcp-example") / "example")


def test_repository_answers_every_question(repo):
    log = subprocess.run(
        ["git", "log", "--reverse", "--format=%an|%s"],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    assert len(log) == 6 and log[0] == "Ada Lovelace|Initial commit: add README"
    items = [json.loads(line) for line in (EXAMPLE / "dataset.jsonl").read_text().splitlines()]
    assert len(items) >= 10
    history = "\n".join(log)
    for item in items:  # every expected answer is in the history (or is its length)
        assert item["answer"] in history or item["answer"] == str(len(log)), item


def test_reward_grades():
    reward = import_string(str(EXAMPLE / "reward.py") + ":reward")
    item = {"answer": "Alan Turing"}
    hit = {"name": "git_log", "is_error": False, "result": "Author: Alan Turing"}
    other = {"name": "git_log", "is_error": False, "result": "Author: Ada Lovelace"}
    failed = {"name": "git_log", "is_error": True, "result": "Error: bad path"}
    assert reward(item, "It was alan turing.", []) == 1.0
    assert reward(item, "Ada", [hit]) == 0.25
    assert reward(item, "Ada", [other]) == 0.1
    assert reward(item, "Ada", [failed]) == 0.0


@pytest.fixture
def proxy_server(scripted_proxy):
    return scripted_proxy


@pytest.mark.parametrize(
    "workflow", ["areal_env.AenvAgent", "agents/openai_agents_runner.py:RunnerAgent"]
)
async def test_an_episode_of_the_example_config(workflow, repo, proxy_server):
    cfg = yaml.safe_load((EXAMPLE / "config.yaml").read_text())
    assert cfg["workflow"] == "areal_env.AenvAgent"
    kwargs = dict(cfg["workflow_kwargs"])
    kwargs["mcp_config"] = {
        **kwargs["mcp_config"],
        "args": [str(EXAMPLE / "serve_git.py"), str(repo)],
    }
    kwargs["reward_fn"] = str(EXAMPLE / "reward.py") + ":reward"
    spec = str(ROOT / workflow) if workflow.startswith("agents/") else workflow
    agent = import_string(spec)(**kwargs)  # the README's override trains this one unchanged
    engine = proxy_server.state.engine
    engine.push(
        '<tool_call>[{"name": "git_log", "arguments": {"repo_path": "example"}}]</tool_call>',
        "Alan Turing wrote it.",
    )
    _, key = open_session(proxy_server)
    item = {"question": "Who wrote the commit 'Speed up tokenizer'?", "answer": "Alan Turing"}
    assert await agent.run(item, base_url=proxy_server.openai_base_url, api_key=key) == 1.0
    prompt = proxy_server.state.tokenizer.decode(engine.requests[-1].input_ids)
    assert "Author: Alan Turing" in prompt and "Message: Speed up tokenizer" in prompt
    assert engine.pending == 0
