"""OpenAI Chat Completions: request → internal form, result → ``chat.completion`` / chunks.

The internal format *is* chat completions, so conversion is mostly validation: roles,
content as a string or text parts (``developer`` becomes ``system``; list-of-text content is
joined so the same turn always hashes the same), tool calls with string arguments.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from areal_env.proxy.protocols.common import (
    CompletionRequest,
    arguments_string,
    bad_request,
    openai_tool_choice,
    openai_tool_list,
    opt_bool,
    opt_int,
    opt_number,
    require_object,
    sse,
    stop_list,
    validate_function_tool,
)

_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
_TEXT_PARTS = {"text", "input_text", "output_text", "refusal"}


def _content(content: Any, param: str | Callable[[], str], *, allow_none: bool) -> str | None:
    """Content as text. ``param`` may be a callable: error paths only build the name."""
    if isinstance(content, str):  # the common case first
        return content
    if content is None:
        if allow_none:
            return None
        name = param() if callable(param) else param
        raise bad_request(f"'{name}' is required", name)
    name = param() if callable(param) else param
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                continue
            if not isinstance(part, dict):
                raise bad_request(f"'{name}[{j}]' must be a content part object", name)
            kind = part.get("type")
            if kind in _TEXT_PARTS:
                text = part.get("text", part.get("refusal"))
                if not isinstance(text, str):
                    raise bad_request(f"'{name}[{j}].text' must be a string", name)
                texts.append(text)
            else:
                raise bad_request(
                    f"content part type {kind!r} is not supported (this model takes text only)",
                    name,
                )
        return "".join(texts)
    raise bad_request(f"'{name}' must be a string or a list of content parts", name)


def convert_messages(raw: Any) -> list[dict[str, Any]]:
    """Validate and convert messages. Runs over the whole history on every request, so the
    valid path does no string formatting (parameter names are built only for errors)."""
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    append = out.append
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            p = f"messages[{i}]"
            raise bad_request(f"'{p}' must be an object", p)
        role = m.get("role")
        if role not in _ROLES:
            p = f"messages[{i}]"
            raise bad_request(
                f"'{p}.role' must be one of system, developer, user, assistant, tool; got {role!r}",
                f"{p}.role",
            )

        def param(i: int = i) -> str:
            return f"messages[{i}].content"

        if role == "assistant":
            msg: dict[str, Any] = {
                "role": "assistant",
                "content": _content(m.get("content"), param, allow_none=True),
            }
            calls = m.get("tool_calls")
            if calls:
                if not isinstance(calls, list):
                    p = f"messages[{i}]"
                    raise bad_request(f"'{p}.tool_calls' must be a list", f"{p}.tool_calls")
                msg["tool_calls"] = [_tool_call(c, i, j) for j, c in enumerate(calls)]
            elif m.get("function_call"):  # legacy single call
                fc = m["function_call"]
                msg["tool_calls"] = [
                    _tool_call({"id": "call_0", "function": fc}, i, None, "function_call")
                ]
            append(msg)
        elif role == "tool" or role == "function":
            tid = m.get("tool_call_id") or m.get("name")
            if not isinstance(tid, str):
                p = f"messages[{i}]"
                raise bad_request(f"'{p}.tool_call_id' must be a string", f"{p}.tool_call_id")
            append(
                {
                    "role": "tool",
                    "tool_call_id": tid,
                    "content": _content(m.get("content"), param, allow_none=True) or "",
                }
            )
        else:
            append(
                {
                    "role": "system" if role == "developer" else role,
                    "content": _content(m.get("content"), param, allow_none=False),
                }
            )
    return out


def _tool_call(c: Any, i: int, j: int | None, field: str = "tool_calls") -> dict[str, Any]:
    fn = c.get("function") if isinstance(c, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    cid = c.get("id") if isinstance(c, dict) else None
    if isinstance(name, str) and name and isinstance(cid, str):
        args = fn.get("arguments")
        return {
            "id": cid,
            "type": "function",
            "function": {
                "name": name,
                "arguments": args
                if isinstance(args, str)
                else arguments_string(args, _call_param(i, j, field) + ".function.arguments"),
            },
        }
    p = _call_param(i, j, field)
    if not isinstance(fn, dict):
        raise bad_request(f"'{p}' must be an object with a 'function'", p)
    if not isinstance(name, str) or not name:
        raise bad_request(f"'{p}.function.name' must be a non-empty string", p)
    raise bad_request(f"'{p}.id' must be a string", p)


def _call_param(i: int, j: int | None, field: str) -> str:
    return f"messages[{i}].{field}" + (f"[{j}]" if j is not None else "")


def convert_tools(raw: Any) -> list[dict[str, Any]] | None:
    return openai_tool_list(raw, _convert_tool)


def _convert_tool(t: Any, p: str) -> dict[str, Any]:
    if (
        not isinstance(t, dict)
        or t.get("type", "function") != "function"
        or not isinstance(t.get("function"), dict)
    ):
        raise bad_request(f"'{p}' must be a function tool {{type: function, function: {{...}}}}", p)
    fn = t["function"]
    return validate_function_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), p)


def convert_tool_choice(raw: Any, tools: list[dict] | None) -> Any:
    named = (
        isinstance(raw, dict)
        and raw.get("type") == "function"
        and isinstance(raw.get("function"), dict)
    )
    name = raw["function"].get("name") if named else None
    return openai_tool_choice(raw, tools, named, name, "{type: function, function: {name}}")


def parse_request(body: Any) -> CompletionRequest:
    body = require_object(body)
    n = opt_int(body, "n", 1)
    if n not in (None, 1):
        raise bad_request("only n=1 is supported; send several requests for several samples", "n")
    tools = convert_tools(body.get("tools"))
    stream = bool(opt_bool(body, "stream"))
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    logprobs = bool(opt_bool(body, "logprobs"))
    top = opt_int(body, "top_logprobs", 0, 20) or 0
    if top and not logprobs:
        raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    max_tokens = opt_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = opt_int(body, "max_tokens", 1)
    model = body.get("model")
    return CompletionRequest(
        messages=convert_messages(body.get("messages")),
        tools=tools,
        tool_choice=convert_tool_choice(body.get("tool_choice"), tools),
        max_tokens=max_tokens,
        temperature=opt_number(body, "temperature", 0.0, 2.0),
        top_p=opt_number(body, "top_p", 0.0, 1.0),
        stop=stop_list(body.get("stop"), "stop"),
        seed=opt_int(body, "seed"),
        stream=stream,
        include_usage=bool(stream and opts and opts.get("include_usage")),
        logprobs=logprobs,
        top_logprobs=top,
        model=model if isinstance(model, str) else None,
    )


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def build_response(
    *,
    completion_id: str,
    model: str,
    message: dict[str, Any],
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    logprobs: list[dict[str, Any]] | None,
) -> dict[str, Any]:
    msg = {"role": "assistant", "content": message.get("content"), "refusal": None}
    if message.get("tool_calls"):
        msg["tool_calls"] = message["tool_calls"]
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": msg,
                "logprobs": {"content": logprobs, "refusal": None}
                if logprobs is not None
                else None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage(prompt_tokens, completion_tokens),
        "system_fingerprint": None,
    }


class ChunkWriter:
    """Builds ``chat.completion.chunk`` SSE events for one streamed completion."""

    def __init__(self, completion_id: str, model: str, include_usage: bool) -> None:
        self._head = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": None,
        }
        self._include_usage = include_usage

    def _chunk(
        self, delta: dict[str, Any], finish: str | None = None, logprobs: list | None = None
    ) -> bytes:
        obj = dict(self._head)
        obj["choices"] = [
            {
                "index": 0,
                "delta": delta,
                "logprobs": {"content": logprobs, "refusal": None} if logprobs else None,
                "finish_reason": finish,
            }
        ]
        if self._include_usage:
            obj["usage"] = None
        return sse(obj)

    def role(self) -> bytes:
        return self._chunk({"role": "assistant", "content": ""})

    def content(self, text: str, logprobs: list | None = None) -> bytes:
        return self._chunk({"content": text}, logprobs=logprobs)

    def tool_calls(self, calls: list[dict[str, Any]]) -> bytes:
        """One delta per call: index, id, type, name and the whole arguments string."""
        out = b""
        for i, c in enumerate(calls):
            out += self._chunk(
                {
                    "tool_calls": [
                        {
                            "index": i,
                            "id": c["id"],
                            "type": "function",
                            "function": {
                                "name": c["function"]["name"],
                                "arguments": c["function"]["arguments"],
                            },
                        }
                    ]
                }
            )
        return out

    def finish(self, finish_reason: str, logprobs: list | None = None) -> bytes:
        return self._chunk({}, finish_reason, logprobs)

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        obj = dict(self._head)
        obj["choices"] = []
        obj["usage"] = usage(prompt_tokens, completion_tokens)
        return sse(obj)

    @staticmethod
    def done() -> bytes:
        return b"data: [DONE]\n\n"
