"""Two roles, two policies, one conversation: a planner that calls the calculator's tools and a
writer that turns their results into the final answer.

Both talk to the same OpenAI-compatible endpoint; the ``model`` of each request names the
policy that answers it (``planner`` / ``writer``: the names under ``policies:`` in
``config.yaml``). The writer continues the planner's conversation (same messages, same tools
offered, ``tool_choice: none``), so its prompt is spliced onto the planner's exact tokens and
each policy is trained on its own completions only.

Each role is rewarded for its own job, per completion (``{completion_id: reward}``):

- every planner completion: 1.0 when its tool calls reached the answer (the last tool result is
  the expected number), else 0.0;
- the writer's completion: 1.0 when its reply is a plain answer (no tool markup) whose every
  number is the last tool result (a faithful write-up of what the tools found), else 0.0;
  without any tool result, only the right answer pays.

So the planner learns which tool and arguments a question needs, and the writer learns to
state a result instead of copying markup or the question's numbers; a right final answer needs
both (evaluation reports it as ``team/success_rate``: episodes where every policy succeeded).
With ``rollout.discount: 0`` neither role's reward flows into the other's.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from areal_env.envs.agent import DEFAULT_SYSTEM_PROMPT
from areal_env.envs.episode import EnvAgentBase, initial_messages, logged_tool_call

logger = logging.getLogger(__name__)


def _numbers(text: str) -> list[float]:
    import re

    return [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))]


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)


def last_result(tool_log: list[dict[str, Any]]) -> float | None:
    """The number the last successful tool call returned (None: no successful call)."""
    for entry in reversed(tool_log):
        if not entry.get("is_error"):
            found = _numbers(str(entry.get("result", "")))
            if found:
                return found[-1]
    return None


def planner_reward(task: dict[str, Any], tool_log: list[dict[str, Any]]) -> float:
    """1.0 when the tool calls reached the expected answer."""
    got = last_result(tool_log)
    return float(got is not None and _same(got, float(task["answer"])))


def writer_reward(task: dict[str, Any], answer: str, tool_log: list[dict[str, Any]]) -> float:
    """1.0 for a plain answer whose every number is the last tool result (or, without one,
    the expected answer)."""
    if not answer.strip() or "<tool_" in answer or "<|im_" in answer:
        return 0.0
    numbers = _numbers(answer)
    target = last_result(tool_log)
    if target is None:
        target = float(task["answer"])
    return float(bool(numbers) and all(_same(x, target) for x in numbers))


class PlannerWriterAgent(EnvAgentBase):
    """The planner calls tools (its first call is required) for up to ``planner_turns`` turns,
    then the writer answers from the conversation. ``planner`` / ``writer``: the policy names
    sent as ``model``. Other options are ``AenvAgent``'s (``aenv_config``, ``temperature``,
    ``max_tokens``, ...)."""

    def __init__(
        self,
        aenv_config: Any = None,
        *,
        planner: str = "planner",
        writer: str = "writer",
        planner_turns: int = 3,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        **options: Any,
    ) -> None:
        super().__init__(
            aenv_config, system_prompt=system_prompt, max_turns=planner_turns + 1, **options
        )
        self.planner, self.writer = planner, writer
        self.planner_turns = planner_turns

    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> dict[str, float]:
        async with self.openai_client(extra_kwargs) as client, self.pool.adapter() as env:
            tools, name_map = await env.openai_tools()
            messages = initial_messages(data, self.system_prompt)
            tool_log: list[dict[str, Any]] = []
            planned: list[str] = []
            for turn in range(self.planner_turns):
                resp = await client.chat.completions.create(
                    model=self.planner,
                    messages=messages,
                    tools=tools,
                    tool_choice="required" if turn == 0 else "auto",
                    **self.sampling,
                )
                planned.append(resp.id)
                msg = resp.choices[0].message
                if not msg.tool_calls:  # done planning (its words are not the answer)
                    break
                messages.append(
                    {
                        "role": "assistant",
                        "content": msg.content,
                        "tool_calls": [
                            {
                                "id": c.id,
                                "type": "function",
                                "function": {
                                    "name": c.function.name,
                                    "arguments": c.function.arguments,
                                },
                            }
                            for c in msg.tool_calls
                        ],
                    }
                )
                for call in msg.tool_calls:
                    name = call.function.name
                    entry = await logged_tool_call(
                        env,
                        name_map,
                        name,
                        call.function.arguments,
                        tool_log,
                        unknown_text=f"Error: unknown tool {name!r}; available: "
                        + ", ".join(name_map),
                    )
                    messages.append(
                        {"role": "tool", "tool_call_id": call.id, "content": entry["result"]}
                    )
            written = await client.chat.completions.create(
                model=self.writer,
                messages=messages,
                tools=tools,
                tool_choice="none",  # same tools as the planner's turns: the prompt splices
                **self.sampling,
            )
            answer = written.choices[0].message.content or ""
        rewards = dict.fromkeys(planned, planner_reward(data, tool_log))
        rewards[written.id] = writer_reward(data, answer, tool_log)
        logger.debug("episode %s: rewards %s (answer %r)", data.get("task_id"), rewards, answer)
        return rewards
