"""Anthropic Messages API: request → internal form, result → ``message`` / Anthropic SSE.

``tool_use`` blocks become assistant ``tool_calls`` and ``tool_result`` blocks become ``tool``
messages, so a tool round trip is rendered as real tool turns (and splices onto the earlier
completion) instead of being flattened to prose.
"""

from __future__ import annotations

import json
from typing import Any

from areal_env.http import routes
from areal_env.http.errors import HTTPError, anthropic_error_body
from areal_env.proxy.protocols import common
from areal_env.proxy.protocols.common import Answer, CompletionRequest, WireProtocol, sse


def convert_messages(system: Any, raw: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if system is not None:
        out.append({"role": "system", "content": common.request_text(system, "system")})
    if not isinstance(raw, list) or not raw:
        raise common.bad_request("messages: must be a non-empty list")
    for i, m in enumerate(raw):
        p = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise common.bad_request(f"{p}.role: must be 'user' or 'assistant'")
        role, content = m["role"], m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise common.bad_request(f"{p}.content: must be a string or a list of content blocks")
        if role == "assistant":
            texts: list[str] = []
            calls: list[dict[str, Any]] = []
            for j, b in enumerate(content):
                kind = b.get("type") if isinstance(b, dict) else None
                if kind == "text" and isinstance(b.get("text"), str):
                    texts.append(b["text"])
                elif kind == "tool_use":
                    if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                        raise common.bad_request(
                            f"{p}.content.{j}: tool_use needs string 'id' and 'name'"
                        )
                    inp = b.get("input", {})
                    if not isinstance(inp, dict):
                        raise common.bad_request(f"{p}.content.{j}.input: must be an object")
                    calls.append(
                        {
                            "id": b["id"],
                            "type": "function",
                            "function": {
                                "name": b["name"],
                                "arguments": _arguments_of_input(inp),
                            },
                        }
                    )
                elif kind in ("thinking", "redacted_thinking"):
                    continue
                else:
                    raise common.bad_request(
                        f"{p}.content.{j}: block type {kind!r} is not supported for assistant turns"
                    )
            msg: dict[str, Any] = {
                "role": "assistant",
                "content": "".join(texts) if texts else None,
            }
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        # user turn: tool_result blocks become tool messages, text runs become user messages
        pending: list[str] = []
        for j, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                pending.append(b["text"])
            elif kind == "tool_result":
                if pending:
                    out.append({"role": "user", "content": "".join(pending)})
                    pending = []
                if not isinstance(b.get("tool_use_id"), str):
                    raise common.bad_request(f"{p}.content.{j}.tool_use_id: must be a string")
                text = common.request_text(b.get("content"), f"{p}.content.{j}.content")
                if b.get("is_error"):
                    text = f"Error: {text}" if text else "Error"
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
            else:
                raise common.bad_request(
                    f"{p}.content.{j}: block type {kind!r} is not supported (this model takes text only)"
                )
        if pending:
            out.append({"role": "user", "content": "".join(pending)})
    return out


def convert_tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise common.bad_request("tools: must be a list")
    tools = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or t.get("type") not in (None, "custom"):
            kind = t.get("type") if isinstance(t, dict) else None
            raise common.bad_request(
                f"tools.{i}: tool type {kind!r} is not supported (client tools only)"
            )
        tools.append(
            common.validate_function_tool(
                t.get("name"),
                t.get("description"),
                t.get("input_schema"),
                f"tools.{i}",
                t.get("strict"),
            )
        )
    return tools or None


def convert_tool_choice(raw: Any, tools: list[dict] | None) -> Any:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise common.bad_request('tool_choice: must be an object like {"type": "auto"}')
    kind = raw.get("type")
    if kind == "auto":
        choice: Any = "auto"
    elif kind == "any":
        choice = "required"
    elif kind == "none":
        choice = "none"
    elif kind == "tool":
        choice = {"type": "function", "function": {"name": raw.get("name")}}
    else:
        raise common.bad_request("tool_choice.type: must be auto, any, tool or none")
    common.check_tool_choice(choice, tools, "tool_choice")
    return choice


def _disable_parallel_tool_use(raw: Any) -> bool:
    """``tool_choice.disable_parallel_tool_use`` (a boolean; at most one tool use when true)."""
    value = raw.get("disable_parallel_tool_use") if isinstance(raw, dict) else None
    if value is not None and not isinstance(value, bool):
        raise common.bad_request(
            "tool_choice.disable_parallel_tool_use: must be a boolean", "tool_choice"
        )
    return bool(value)


def parse_request(body: Any) -> CompletionRequest:
    body = common.require_object(body)
    max_tokens = common.opt_int(body, "max_tokens", 1)
    if max_tokens is None:
        raise common.bad_request("max_tokens: Field required")
    tools = convert_tools(body.get("tools"))
    model = body.get("model")
    return CompletionRequest(
        output_format=_output_format(body),
        messages=convert_messages(body.get("system"), body.get("messages")),
        tools=tools,
        tool_choice=convert_tool_choice(body.get("tool_choice"), tools),
        parallel_tool_calls=not _disable_parallel_tool_use(body.get("tool_choice")),
        max_tokens=max_tokens,
        temperature=common.opt_number(body, "temperature", 0.0, 1.0),
        top_p=common.opt_number(body, "top_p", 0.0, 1.0),
        top_k=common.opt_int(body, "top_k", 0),
        stop=common.stop_list(body.get("stop_sequences"), "stop_sequences"),
        stream=bool(common.opt_bool(body, "stream")),
        model=model if isinstance(model, str) else None,
    )


def _output_format(body: dict[str, Any]) -> common.OutputFormat | None:
    """Structured outputs: ``output_config.format`` (the messages API) or the beta's top-level
    ``output_format``, ``{"type": "json_schema", "schema": {...}}``."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise common.bad_request("output_config: must be an object", "output_config")
    raw, param = (config or {}).get("format"), "output_config.format"
    if raw is None:
        raw, param = body.get("output_format"), "output_format"
    if raw is None:
        return None
    if not isinstance(raw, dict) or raw.get("type") != "json_schema":
        kind = raw.get("type") if isinstance(raw, dict) else None
        raise common.bad_request(f"{param}.type: must be json_schema, got {kind!r}", param)
    schema = raw.get("schema")
    if not isinstance(schema, dict):
        raise common.bad_request(f"{param}.schema: must be a JSON schema object", param)
    return common.OutputFormat(schema, param, strict=True, echo=raw)


def stop_reason(finish_reason: str, stop_hit: str | None) -> str:
    if finish_reason == "tool_calls":
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    if stop_hit is not None:
        return "stop_sequence"
    return "end_turn"


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for c in message.get("tool_calls") or []:
        blocks.append(
            {"type": "tool_use", "id": c["id"], "name": c["function"]["name"], "input": _input(c)}
        )
    return blocks


RAW_ARGUMENTS_KEY = "_raw_arguments"
"""``tool_use.input`` must be an object. When the model's arguments are not a JSON object, the
proxy sends ``{"_raw_arguments": "<the model's text>"}``: the tool sees an argument it does not
accept and answers with its own validation error (the same training signal an OpenAI client gets
from invalid ``arguments``), and when the client sends that block back the proxy restores the
exact text, so the next turn still splices onto the model's own tokens."""


def _input(call: dict[str, Any]) -> dict[str, Any]:
    raw = call["function"]["arguments"]
    try:
        v = json.loads(raw or "{}")
    except (TypeError, ValueError):
        return {RAW_ARGUMENTS_KEY: raw if isinstance(raw, str) else ""}
    return v if isinstance(v, dict) else {RAW_ARGUMENTS_KEY: raw}


def _arguments_of_input(inp: dict[str, Any]) -> str:
    """``tool_use.input`` back to an arguments string (inverse of ``_input``)."""
    if set(inp) == {RAW_ARGUMENTS_KEY} and isinstance(inp[RAW_ARGUMENTS_KEY], str):
        return inp[RAW_ARGUMENTS_KEY]
    return json.dumps(inp, ensure_ascii=False)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "output_tokens": completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def build_response(answer: Answer) -> dict[str, Any]:
    return {
        "id": answer.id,
        "type": "message",
        "role": "assistant",
        "model": answer.model,
        "content": content_blocks(answer.message),
        "stop_reason": stop_reason(answer.finish_reason, answer.stop_hit),
        "stop_sequence": answer.stop_hit,
        "usage": usage(answer.prompt_tokens, answer.completion_tokens),
    }


class EventWriter:
    """Anthropic SSE: message_start, content blocks (text / tool_use), message_delta, stop
    (a StreamWriter)."""

    def __init__(
        self, message_id: str, model: str, creq: CompletionRequest, prompt_tokens: int
    ) -> None:
        self._id = message_id
        self._model = model
        self._prompt_tokens = prompt_tokens
        self._index = -1
        self._text_open = False

    def start(self) -> bytes:
        msg: dict[str, Any] = {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(self._prompt_tokens, 0),
        }
        return sse({"type": "message_start", "message": msg}, "message_start")

    def text(self, delta: str, logprobs: list[dict[str, Any]] | None = None) -> bytes:
        out = b""
        if not self._text_open:
            self._index += 1
            self._text_open = True
            out += sse(
                {
                    "type": "content_block_start",
                    "index": self._index,
                    "content_block": {"type": "text", "text": ""},
                },
                "content_block_start",
            )
        return out + sse(
            {
                "type": "content_block_delta",
                "index": self._index,
                "delta": {"type": "text_delta", "text": delta},
            },
            "content_block_delta",
        )

    def _close_text(self) -> bytes:
        if not self._text_open:
            return b""
        self._text_open = False
        return sse({"type": "content_block_stop", "index": self._index}, "content_block_stop")

    def tool_calls(self, calls: list[dict[str, Any]]) -> bytes:
        out = self._close_text()
        for c in calls:
            self._index += 1
            block = {"type": "tool_use", "id": c["id"], "name": c["function"]["name"], "input": {}}
            out += sse(
                {"type": "content_block_start", "index": self._index, "content_block": block},
                "content_block_start",
            )
            out += sse(
                {
                    "type": "content_block_delta",
                    "index": self._index,
                    "delta": {
                        "type": "input_json_delta",
                        "partial_json": json.dumps(_input(c), ensure_ascii=False),
                    },
                },
                "content_block_delta",
            )
            out += sse({"type": "content_block_stop", "index": self._index}, "content_block_stop")
        return out

    def finish(self, answer: Answer, logprobs: list[dict[str, Any]] | None = None) -> bytes:
        out = self._close_text()
        out += sse(
            {
                "type": "message_delta",
                "delta": {
                    "stop_reason": stop_reason(answer.finish_reason, answer.stop_hit),
                    "stop_sequence": answer.stop_hit,
                },
                "usage": {"output_tokens": answer.completion_tokens},
            },
            "message_delta",
        )
        return out + sse({"type": "message_stop"}, "message_stop")

    @staticmethod
    def error(err: HTTPError) -> bytes:
        return sse(anthropic_error_body(err), "error")


PROTOCOL = WireProtocol(
    "anthropic",
    routes.MESSAGES,
    "msg_",
    parse_request,
    build_response,
    EventWriter,
    anthropic_error_body,
)
