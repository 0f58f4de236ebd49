"""Tool errors under both policies, through the real proxy workflow (RUN_AENV_INTEGRATION=1).

The counter environment's ``fail`` tool always raises; the first model call is forced to call it
(the proxy pre-fills the call for a named ``tool_choice``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from areal_env.api.config import RolloutConfig
from areal_env.envs.aenv.adapter import AenvEnvironmentAdapter
from areal_env.envs.aenv.config import AenvConfig
from areal_env.envs.agent import AenvAgent

pytestmark = [pytest.mark.integration, pytest.mark.slow]

COUNTER_ENV = Path(__file__).resolve().parents[1] / "unit" / "aenv_counter_env.py"
ITEM = {"task_id": "f", "question": "Call the fail tool with message 'disk full'."}


@pytest.fixture(scope="module")
def proxy_server(engine):
    """A proxy whose tool prompt carries the worked example (a format-only demonstration).

    The forced call to ``fail`` must reach the tool with valid arguments, so that the tool really
    runs and raises; without the example the small model fills in placeholder argument names.
    """
    from areal_env.api.config import ProxyConfig
    from areal_env.proxy.server import ProxyServer

    server = ProxyServer(
        engine,
        engine.tokenizer,
        ProxyConfig(default_max_tokens=32, worked_example=True),
        model_name="smollm2-test",
    )
    server.start()
    yield server
    server.stop()


def _workflow(agent, proxy_server):
    from areal_env.workflow.resolve import resolve_workflow

    return resolve_workflow(
        agent,
        rollout=RolloutConfig(n_samples=1, episode_timeout=300),
        proxy_base_url=proxy_server.base_url,
        admin_key=proxy_server.admin_key,
    )


async def _fail_count(cfg: AenvConfig) -> int:
    async with AenvEnvironmentAdapter(cfg) as env:
        return (await env.call_function("calls", {})).get("fail", 0)


@pytest.mark.parametrize("policy", ["append_error", "raise"])
async def test_tool_error_policies(policy, proxy_server, engine, aenv_server_factory):
    launcher = aenv_server_factory(1, tools_path=COUNTER_ENV)
    cfg = AenvConfig(env_name="counter@1.0", aenv_url=launcher.urls[0], retry_delay=0.05)
    seen: list[list[dict]] = []

    def reward_fn(tool_calls):
        seen.append(tool_calls)
        return 0.5

    agent = AenvAgent(
        cfg,
        max_turns=1,
        max_tokens=24,
        temperature=0.0,
        first_turn_tool_choice={"type": "function", "function": {"name": "fail"}},
        tool_error_policy=policy,
        reward_fn=reward_fn,
        system_prompt=None,
    )
    wf = _workflow(agent, proxy_server)
    result = await wf.arun_episode(engine, dict(ITEM))
    assert await _fail_count(cfg) == 1  # the tool really ran (once: tool errors are not retried)
    if policy == "append_error":
        assert result is not None and result[0].reward == 0.5
        (calls,) = seen
        assert calls[0]["name"] == "fail" and calls[0]["is_error"]
        assert calls[0]["result"].startswith("Error:")
    else:
        assert result is None and not seen
        assert wf.stats["rejected/agent_error"] == 1
