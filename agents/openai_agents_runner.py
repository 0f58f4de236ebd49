"""``RunnerAgent``: an OpenAI Agents SDK agent (``Runner.run``) on a tool environment.

Train it unchanged: ``workflow="agents/openai_agents_runner.py:RunnerAgent"`` with
``workflow_kwargs={"aenv_config": {...}}`` (an aenvironment server) or
``{"mcp_config": {...}, "reward_fn": "module:fn"}`` (any MCP server). The environment's tools
become ``FunctionTool``\\ s with OpenAI-valid names (``calculator@1.0.0/add`` → ``add``),
executed through the environment adapter (safe retries, release on every exit). The Agents SDK talks to the
injected ``base_url`` with Chat Completions (it does not stream with ``Runner.run``), so the proxy
records every model call.

Agents SDK behaviour worth knowing (openai-agents 0.24): a tool name the model invents aborts
the run (``ModelBehaviorError``), and so does running out of turns (``MaxTurnsExceeded``). Both
still get a reward here (the final answer is then whatever the model last said), so the policy
learns from those episodes instead of losing them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from areal_env.envs.aenv.config import AenvConfig
from areal_env.envs.base import EnvError, ToolEnvironment
from areal_env.envs.episode import (
    EnvAgentBase,
    EpisodeOutcome,
    compute_reward,
    initial_messages,
    logged_tool_call,
)
from areal_env.envs.mcp.config import McpConfig

logger = logging.getLogger(__name__)


class ToolErrorRaised(RuntimeError):
    """A tool reported an error and ``tool_error_policy`` is ``raise``."""


class RunnerAgent(EnvAgentBase):
    """Agents SDK agent over an AEnvironment; ``async def run(data, **kw) -> float``.

    Args mirror ``areal_env.AenvAgent``: ``aenv_config``, ``aenv_urls``, ``max_turns``,
    ``system_prompt`` (the agent's instructions), ``reward_fn``, ``gconfig``/``temperature``/
    ``top_p``/``max_tokens``, ``tool_error_policy``, ``model``, ``first_turn_tool_choice``
    (e.g. ``required``; the SDK resets it to auto after the first tool use).
    """

    def __init__(
        self,
        aenv_config: AenvConfig | dict[str, Any] | None = None,
        *,
        aenv_urls: list[str] | None = None,
        max_turns: int = 3,
        system_prompt: str | None = "Use the tools to compute, then give the final number.",
        reward_fn: Callable[..., Any] | str | None = None,
        gconfig: Any = None,
        temperature: float | None = None,
        top_p: float | None = None,
        max_tokens: int | None = None,
        tool_error_policy: str | None = None,
        model: str | None = None,
        mcp_config: McpConfig | dict[str, Any] | None = None,
        first_turn_tool_choice: str | dict[str, Any] | None = None,
    ) -> None:
        super().__init__(
            aenv_config,
            aenv_urls=aenv_urls,
            max_turns=max_turns,
            system_prompt=system_prompt,
            reward_fn=reward_fn,
            gconfig=gconfig,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            tool_error_policy=tool_error_policy,
            model=model,
            mcp_config=mcp_config,
        )
        self.first_turn_tool_choice = first_turn_tool_choice

    # ------------------------------------------------------------------------------------------
    def _function_tools(
        self,
        env: ToolEnvironment,
        tools: list[dict[str, Any]],
        name_map: dict[str, str],
        tool_log: list[dict[str, Any]],
        failures: list[BaseException],
    ) -> list[Any]:
        from agents import FunctionTool

        def make_invoke(openai_name: str) -> Callable[[Any, str], Any]:
            async def invoke(_ctx: Any, raw_args: str) -> str:
                # Transport failures (EnvToolCallError) and ToolErrorRaised must reject the
                # episode. The Agents SDK may turn a tool's exception into a message for the
                # model, so they are also recorded here and raised again after the run.
                try:
                    entry = await logged_tool_call(
                        env,
                        name_map,
                        openai_name,
                        raw_args,
                        tool_log,
                        unknown_text=f"Error: unknown tool {openai_name!r}",
                    )
                except EnvError as e:
                    failures.append(e)
                    raise
                text = entry["result"]
                if entry["is_error"] and self.config.tool_error_policy == "raise":
                    failures.append(ToolErrorRaised(f"tool call {openai_name!r} failed: {text}"))
                    raise failures[-1]
                return text

            return invoke

        return [
            FunctionTool(
                name=t["function"]["name"],
                description=t["function"]["description"],
                params_json_schema=t["function"]["parameters"],
                on_invoke_tool=make_invoke(t["function"]["name"]),
                strict_json_schema=False,  # MCP schemas are not strict-mode schemas
            )
            for t in tools
        ]

    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> float:
        """One episode: ``Runner.run`` with the environment's tools; returns the reward."""
        from agents import (
            Agent,
            ItemHelpers,
            MaxTurnsExceeded,
            ModelBehaviorError,
            ModelSettings,
            OpenAIChatCompletionsModel,
            RunConfig,
            Runner,
        )

        model_name = self.model_name(extra_kwargs)
        settings = ModelSettings(
            temperature=self.sampling.get("temperature"),
            top_p=self.sampling.get("top_p"),
            max_tokens=self.sampling.get("max_tokens"),
            tool_choice=_sdk_tool_choice(self.first_turn_tool_choice),
        )
        messages = initial_messages(data, None)
        async with self.openai_client(extra_kwargs) as client:
            async with self.pool.adapter() as env:
                tools, name_map = await env.openai_tools()
                tool_log: list[dict[str, Any]] = []
                failures: list[BaseException] = []
                agent = Agent(
                    name="aenv-runner",
                    instructions=self.system_prompt,
                    tools=self._function_tools(env, tools, name_map, tool_log, failures),
                    model=OpenAIChatCompletionsModel(model=model_name, openai_client=client),
                    model_settings=settings,
                )
                run_config = RunConfig(tracing_disabled=True)
                items: list[Any] = []
                try:
                    result = await Runner.run(
                        agent, messages, max_turns=self.max_turns, run_config=run_config
                    )
                    final_answer = str(result.final_output or "")
                    items = list(result.new_items)
                except Exception as e:
                    if failures:
                        raise failures[0] from e
                    if not isinstance(e, (MaxTurnsExceeded, ModelBehaviorError)):
                        raise
                    logger.debug("run ended early: %s", e)
                    run_data = getattr(e, "run_data", None)
                    items = list(getattr(run_data, "new_items", []) or [])
                    texts = [
                        ItemHelpers.text_message_output(i)
                        for i in items
                        if getattr(i, "type", "") == "message_output_item"
                    ]
                    final_answer = texts[-1] if texts else ""
                if failures:
                    raise failures[0]
                transcript = [*messages, *(_item_dict(i) for i in items)]
                outcome = EpisodeOutcome(data, final_answer, transcript, tool_log)
                return (await compute_reward(outcome, env, self.reward_fn)).value


def _sdk_tool_choice(choice: str | dict[str, Any] | None) -> str | None:
    """The Agents SDK takes ``auto``/``required``/``none`` or a bare function name."""
    if isinstance(choice, dict):
        fn = choice.get("function") if isinstance(choice.get("function"), dict) else choice
        name = fn.get("name")
        if not isinstance(name, str):
            raise ValueError(f"cannot read a tool name from tool_choice {choice!r}")
        return name
    return choice


def _item_dict(item: Any) -> dict[str, Any]:
    """A run item as a plain dict (for reward functions that look at the conversation)."""
    raw = getattr(item, "raw_item", item)
    if hasattr(raw, "model_dump"):
        return raw.model_dump(exclude_none=True)
    if isinstance(raw, dict):
        return json.loads(json.dumps(raw, default=str))
    return {"type": getattr(item, "type", "item"), "value": str(raw)}
