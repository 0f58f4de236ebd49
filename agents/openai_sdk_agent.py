"""``ResponsesAgent``: a plain OpenAI SDK agent (Responses API) on an AEnvironment.

No framework: ``client.responses.create`` in a loop, function tools from the environment,
``function_call_output`` items back, until the model answers without calling a tool. It is the
shape most hand-written agents have, and it trains unchanged:
``workflow="agents/openai_sdk_agent.py:ResponsesAgent"`` with
``workflow_kwargs={"aenv_config": {...}}``. (``areal_env.AenvAgent`` is the same loop on Chat
Completions.)
"""

from __future__ import annotations

from typing import Any

from areal_env.envs.episode import (
    EnvAgentBase,
    EpisodeOutcome,
    compute_reward,
    initial_messages,
    logged_tool_call,
)


class ResponsesAgent(EnvAgentBase):
    """``async def run(data, **kw) -> float`` with the OpenAI Responses API.

    Options: ``aenv_config``, ``aenv_urls``, ``max_turns``, ``system_prompt`` (sent as
    ``instructions``), ``reward_fn``, ``gconfig``/``temperature``/``top_p``/``max_tokens``,
    ``tool_error_policy`` (``append_error``: the model sees the error; ``raise``: abort),
    ``model``.
    """

    # the Responses API calls the output token limit max_output_tokens
    max_tokens_param = "max_output_tokens"

    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> float:
        model = self.model_name(extra_kwargs)
        async with self.openai_client(extra_kwargs) as client:
            async with self.pool.adapter() as env:
                chat_tools, name_map = await env.openai_tools()
                tools = [{"type": "function", "strict": False, **t["function"]} for t in chat_tools]
                items: list[dict[str, Any]] = [
                    {"role": m["role"], "content": m["content"]}
                    for m in initial_messages(data, None)
                ]
                tool_log: list[dict[str, Any]] = []
                final_answer = ""
                for _turn in range(self.max_turns):
                    request: dict[str, Any] = {"model": model, "input": items, **self.sampling}
                    if self.system_prompt:
                        request["instructions"] = self.system_prompt
                    if tools:
                        request["tools"] = tools
                    response = await client.responses.create(**request)
                    final_answer = response.output_text or final_answer
                    calls = [o for o in response.output if o.type == "function_call"]
                    items += [o.model_dump(exclude_none=True) for o in response.output]
                    if not calls:
                        break
                    for call in calls:
                        text = await self._run_tool(env, name_map, call, tool_log)
                        items.append(
                            {
                                "type": "function_call_output",
                                "call_id": call.call_id,
                                "output": text,
                            }
                        )
                outcome = EpisodeOutcome(data, final_answer, items, tool_log)
                return (await compute_reward(outcome, env, self.reward_fn)).value

    async def _run_tool(self, env: Any, name_map: dict[str, str], call: Any, log: list) -> str:
        entry = await logged_tool_call(
            env,
            name_map,
            call.name,
            call.arguments,
            log,
            unknown_text=f"Error: unknown tool {call.name!r}; available: {', '.join(name_map)}",
        )
        text = entry["result"]
        if entry["is_error"] and self.config.tool_error_policy == "raise":
            raise RuntimeError(f"tool call {call.name!r} failed: {text}")
        return text


OpenAISDKAgent = ResponsesAgent  # the name used in docs: a plain OpenAI SDK agent
