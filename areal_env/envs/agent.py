"""``AenvAgent``: a tool-using chat agent on an AEnvironment, trainable through the proxy.

It is an ordinary OpenAI SDK agent (``AsyncOpenAI`` pointed at whatever ``base_url`` it is given)
so the same code runs against a hosted model or, during training, against the interception
proxy that records every completion. One episode:

1. open an environment instance (``AenvEnvironmentAdapter``) and list its tools;
2. chat: the model answers or calls tools; tool calls run in the environment and their results
   go back as ``tool`` messages; stop at a reply without tool calls (the final answer), at a
   call of the answer tool (``answer_tool``: its argument is the final answer) or after
   ``max_turns`` model calls;
3. reward: the environment's ``@register_reward`` function (or ``reward_fn``);
4. release the environment (always) and return the reward as a float.

A tool the model invents (not offered to it) is refused with a tool error message, never sent
to the environment. Transport failures that survive the adapter's safe retries raise, which
rejects the episode (training goes on without it).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from areal_env.envs.aenv.config import AenvConfig
from areal_env.envs.base import ToolEnvironment
from areal_env.envs.episode import (
    EnvAgentBase,
    EpisodeOutcome,
    compute_reward,
    initial_messages,
    logged_tool_call,
)

logger = logging.getLogger(__name__)

DEFAULT_SYSTEM_PROMPT = (
    "You are a careful assistant. Use the tools to compute. When you know the answer, "
    "reply with the final number only."
)


ANSWER_ARGUMENT = "answer"
"""The answer tool's one parameter: the final answer, as text."""


def answer_tool_schema(name: str) -> dict[str, Any]:
    """The OpenAI function the agent adds when it has an answer tool (``answer_tool``)."""
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": "Give the final answer. Call this once you know it; it ends the task.",
            "parameters": {
                "type": "object",
                "properties": {ANSWER_ARGUMENT: {"type": "string", "description": "the answer"}},
                "required": [ANSWER_ARGUMENT],
            },
        },
    }


def answer_text(raw_arguments: str | None) -> str:
    """The final answer an answer-tool call gives: its ``answer`` argument as text (a number the
    model wrote unquoted becomes its JSON text); the raw arguments when they are not a JSON
    object with that key, so that the reward still sees what the model said."""
    try:
        args = json.loads(raw_arguments or "")
    except ValueError:
        return raw_arguments or ""
    if not isinstance(args, dict) or ANSWER_ARGUMENT not in args:
        return raw_arguments or ""
    value = args[ANSWER_ARGUMENT]
    return value if isinstance(value, str) else json.dumps(value)


class ToolErrorRaised(RuntimeError):
    """A tool reported an error and ``tool_error_policy`` is ``raise``: the episode is aborted."""


class AenvAgent(EnvAgentBase):
    """Multi-turn tool-calling agent over an AEnvironment (``async def run(data, **kw) -> float``).

    Args:
        aenv_config: ``AenvConfig`` or a mapping of its fields (YAML ``workflow_kwargs``).
        aenv_urls: several servers of the same environment; each episode uses the least busy.
        max_turns: most model calls per episode.
        system_prompt: prepended unless the item's chat has its own system message.
        reward_fn: callable or import string; default = the environment's reward function.
        gconfig: a ``GenerationConfig`` (or mapping) for ``temperature``/``top_p``/``max_tokens``;
            ``temperature``, ``top_p``, ``max_tokens`` override it.
        tool_error_policy: ``append_error`` (show the error to the model) or ``raise`` (abort);
            default: ``aenv_config.tool_error_policy``.
        model: the model name sent with requests (the proxy accepts any).
        tool_choice: sent with every request (``auto``/``required``/``none``/a named function);
            default: not sent (the server's ``auto``).
        first_turn_tool_choice: overrides ``tool_choice`` on the first model call only, e.g.
            ``required`` so that a weak model calls a tool once and then answers from its result.
        parallel_tool_calls: sent with every request that offers tools when set; ``False``: at
            most one call per reply (the proxy ends a reply with its first call), so a weak
            model's run-on list of calls cannot spoil a right first one.
        answer_tool: the name of a tool the agent adds to the environment's (one string
            parameter, ``answer``): calling it ends the episode, and its argument is the final
            answer. With ``tool_choice: required`` every reply is then a call, and whether to
            call another tool or to answer becomes a choice among tool names, which the
            trainer can explore (``gconfig.choice_exploration``) like any other tool choice.
            The call never reaches the environment and is not among the reward's
            ``tool_calls``. Default: none (the answer is a reply without tool calls).
    """

    def __init__(
        self,
        aenv_config: AenvConfig | dict[str, Any] | None = None,
        *,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        tool_choice: str | dict[str, Any] | None = None,
        first_turn_tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        answer_tool: str | None = None,
        **options: Any,
    ) -> None:
        # ``options`` are ``EnvAgentBase``'s keyword arguments (documented above), unchanged.
        super().__init__(aenv_config, system_prompt=system_prompt, **options)
        self.tool_choice = tool_choice
        self.first_turn_tool_choice = first_turn_tool_choice
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise ValueError(
                f"parallel_tool_calls must be true, false or unset, got {parallel_tool_calls!r}"
            )
        self.parallel_tool_calls = parallel_tool_calls
        if answer_tool is not None and not (isinstance(answer_tool, str) and answer_tool.strip()):
            raise ValueError(
                f"answer_tool must be a tool name (a non-empty string), got {answer_tool!r}"
            )
        self.answer_tool = answer_tool

    # ------------------------------------------------------------------------------------------
    async def run(
        self, data: dict[str, Any], **extra_kwargs: Any
    ) -> float | dict[str, float | None]:
        """Run one episode on ``data`` and return its reward.

        ``extra_kwargs``: ``base_url``, ``api_key``, ``http_client`` (injected by the training
        workflow; else ``OPENAI_BASE_URL``/``OPENAI_API_KEY``), ``model``, ``is_eval`` (True in a
        held-out evaluation: the proxy session is greedy then; the episode itself is the same).

        A float, or ``{completion_id: reward}`` when the reward function credits tool calls
        (``call_rewards``): each call's credit goes to the completion that made it; the answer's
        completion is ``None`` (left out of the loss) when the reward function says the answer
        was out of reach (``answer_in_reach: false``: a wrong call broke the chain). A held-out
        evaluation always gets the episode's reward alone (success is the final answer's).
        """
        model = self.model_name(extra_kwargs)
        async with self.openai_client(extra_kwargs) as client:
            async with self.open_environment(data) as env:
                outcome = await self._episode(client, model, env, data)
                reward = await compute_reward(outcome, env, self.reward_fn)
        logger.debug("episode done: reward=%s answer=%r", reward, outcome.final_answer[:80])
        if extra_kwargs.get("is_eval"):
            return reward.value
        return reward.per_completion(outcome)

    def open_environment(self, data: dict[str, Any]) -> Any:
        """The environment for one episode (``async with``); override to pick one per item."""
        return self.pool.adapter()

    async def _episode(
        self, client: Any, model: str, env: ToolEnvironment, data: dict[str, Any]
    ) -> EpisodeOutcome:
        tools, name_map = await env.openai_tools()
        if self.answer_tool is not None:
            if self.answer_tool in name_map:
                raise ValueError(
                    f"answer_tool {self.answer_tool!r} is also a tool of {env.where}: "
                    "give the answer tool another name"
                )
            tools = [*tools, answer_tool_schema(self.answer_tool)]
        messages = initial_messages(data, self.system_prompt)
        tool_log: list[dict[str, Any]] = []
        final_answer: str | None = None
        completion_ids: list[str] = []
        request: dict[str, Any] = {"model": model, **self.sampling}
        if tools:
            request["tools"] = tools
            if self.parallel_tool_calls is not None:
                request["parallel_tool_calls"] = self.parallel_tool_calls
        for turn in range(self.max_turns):
            choice = self.tool_choice
            if turn == 0 and self.first_turn_tool_choice is not None:
                choice = self.first_turn_tool_choice
            extra = {"tool_choice": choice} if tools and choice is not None else {}
            resp = await client.chat.completions.create(messages=messages, **request, **extra)
            completion_ids.append(resp.id)
            msg = resp.choices[0].message
            assistant: dict[str, Any] = {"role": "assistant", "content": msg.content}
            calls = list(msg.tool_calls or [])
            if calls:
                assistant["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": c.function.arguments},
                    }
                    for c in calls
                ]
            messages.append(assistant)
            if not calls:
                final_answer = msg.content or ""
                break
            answer = next((c for c in calls if c.function.name == self.answer_tool), None)
            if answer is not None:  # the answer ends the episode; calls beside it are not run
                final_answer = answer_text(answer.function.arguments)
                break
            for call in calls:
                messages.append(await self._run_tool(env, name_map, call, tool_log))
                tool_log[-1]["completion_id"] = resp.id  # who made the call (call credit)
        if final_answer is None:  # out of turns: the last thing the model said counts
            final_answer = next(
                (m.get("content") or "" for m in reversed(messages) if m["role"] == "assistant"),
                "",
            )
        return EpisodeOutcome(data, final_answer, messages, tool_log, completion_ids)

    async def _run_tool(
        self,
        env: ToolEnvironment,
        name_map: dict[str, str],
        call: Any,
        tool_log: list[dict[str, Any]],
    ) -> dict[str, Any]:
        name = call.function.name
        entry = await logged_tool_call(
            env,
            name_map,
            name,
            call.function.arguments,
            tool_log,
            unknown_text=(
                f"Error: unknown tool {name!r}; available tools: {', '.join(name_map) or 'none'}"
            ),
        )
        text = entry["result"]
        if entry["is_error"] and self.config.tool_error_policy == "raise":
            raise ToolErrorRaised(f"tool call {name!r} failed: {text}")
        return {"role": "tool", "tool_call_id": call.id, "content": text}
