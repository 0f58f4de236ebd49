"""``ResponsesAgent``: a plain OpenAI SDK agent (Responses API) on an AEnvironment.

No framework: ``client.responses.create`` in a loop, function tools from the environment,
``function_call_output`` items back, until the model answers without calling a tool. It is the
shape most hand-written agents have, and it trains unchanged:
``workflow="agents/openai_sdk_agent.py:ResponsesAgent"`` with
``workflow_kwargs={"aenv_config": {...}}``. (``areal_env.AenvAgent`` is the same loop on Chat
Completions.)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from areal_env.infra.aenv.config import AenvConfig
from areal_env.infra.aenv.episode import (
    EnvironmentPool,
    EpisodeOutcome,
    compute_reward,
    initial_messages,
    make_config,
    resolve_reward_fn,
    sampling_kwargs,
)
from areal_env.infra.aenv.schema import ToolArgumentsError, parse_tool_arguments


class ResponsesAgent:
    """``async def run(data, **kw) -> float`` with the OpenAI Responses API.

    Options: ``aenv_config``, ``aenv_urls``, ``max_turns``, ``system_prompt`` (sent as
    ``instructions``), ``reward_fn``, ``gconfig``/``temperature``/``top_p``/``max_tokens``,
    ``tool_error_policy`` (``append_error``: the model sees the error; ``raise``: abort),
    ``model``.
    """

    def __init__(
        self,
        aenv_config: AenvConfig | dict[str, Any] | None = None,
        *,
        aenv_urls: list[str] | None = None,
        max_turns: int = 3,
        system_prompt: str | None = None,
        reward_fn: Callable[..., Any] | str | None = None,
        gconfig: Any = None,
        temperature: float | None = None,
        top_p: float | None = None,
        max_tokens: int | None = None,
        tool_error_policy: str | None = None,
        model: str | None = None,
    ) -> None:
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
            raise ValueError(f"max_turns={max_turns!r} must be an integer >= 1")
        self.config = make_config(aenv_config, tool_error_policy=tool_error_policy)
        self.pool = EnvironmentPool(self.config, aenv_urls)
        self.max_turns = max_turns
        self.system_prompt = system_prompt
        self.reward_fn = resolve_reward_fn(reward_fn)
        s = sampling_kwargs(gconfig, temperature=temperature, top_p=top_p, max_tokens=max_tokens)
        self.sampling = {("max_output_tokens" if k == "max_tokens" else k): v for k, v in s.items()}
        self.model = model

    async def run(self, data: dict[str, Any], **extra_kwargs: Any) -> float:
        from openai import AsyncOpenAI

        http_client = extra_kwargs.get("http_client")
        client = AsyncOpenAI(
            base_url=extra_kwargs.get("base_url") or os.environ.get("OPENAI_BASE_URL"),
            api_key=extra_kwargs.get("api_key") or os.environ.get("OPENAI_API_KEY", "none"),
            http_client=http_client,
            max_retries=0,
        )
        model = extra_kwargs.get("model") or self.model or os.environ.get("OPENAI_MODEL", "default")
        try:
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
                return await compute_reward(outcome, env, self.reward_fn)
        finally:
            if http_client is None:
                await client.close()

    async def _run_tool(self, env: Any, name_map: dict[str, str], call: Any, log: list) -> str:
        entry: dict[str, Any] = {"name": call.name, "arguments": None, "is_error": True}
        log.append(entry)
        if call.name not in name_map:
            text = f"Error: unknown tool {call.name!r}; available: {', '.join(name_map)}"
        else:
            try:
                args = parse_tool_arguments(call.arguments)
            except ToolArgumentsError as e:
                text = f"Error: {e}"
            else:
                entry["arguments"] = args
                result = await env.call_tool(name_map[call.name], args)
                entry["is_error"] = result.is_error
                text = f"Error: {result.text}" if result.is_error else result.text
        entry["result"] = text
        if entry["is_error"] and self.config.tool_error_policy == "raise":
            raise RuntimeError(f"tool call {call.name!r} failed: {text}")
        return text


OpenAISDKAgent = ResponsesAgent  # the name used in docs: a plain OpenAI SDK agent
