"""OpenAI Chat Completions: request → internal form, result → ``chat.completion`` / chunks.

The internal format *is* chat completions, so conversion is mostly validation: roles,
content as a string or text parts (``developer`` becomes ``system``; list-of-text content is
joined so the same turn always hashes the same), tool calls with string arguments.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

from areal_env.http import routes
from areal_env.http.errors import HTTPError, openai_error_body
from areal_env.proxy.protocols import common
from areal_env.proxy.protocols.common import Answer, CompletionRequest, WireProtocol, sse

_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
MAX_CHOICES = 16
"""Most choices (``n``) one request may ask for."""


def _content(content: Any, param: str | Callable[[], str], *, allow_none: bool) -> str | None:
    """Content as text; ``None`` only where the role allows it."""
    if content is None:
        if allow_none:
            return None
        name = param() if callable(param) else param
        raise common.bad_request(f"'{name}' is required", name)
    return common.request_text(content, param)


def convert_messages(raw: Any) -> list[dict[str, Any]]:
    """Validate and convert messages. Runs over the whole history on every request, so the
    valid path does no string formatting (parameter names are built only for errors)."""
    if not isinstance(raw, list) or not raw:
        raise common.bad_request("'messages' must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    append = out.append
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            p = f"messages[{i}]"
            raise common.bad_request(f"'{p}' must be an object", p)
        role = m.get("role")
        if role not in _ROLES:
            p = f"messages[{i}]"
            raise common.bad_request(
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
                    raise common.bad_request(f"'{p}.tool_calls' must be a list", f"{p}.tool_calls")
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
                raise common.bad_request(
                    f"'{p}.tool_call_id' must be a string", f"{p}.tool_call_id"
                )
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
    if isinstance(fn, dict) and isinstance(name, str) and name and isinstance(cid, str):
        args = fn.get("arguments")
        return {
            "id": cid,
            "type": "function",
            "function": {
                "name": name,
                "arguments": args
                if isinstance(args, str)
                else common.arguments_string(
                    args, _call_param(i, j, field) + ".function.arguments"
                ),
            },
        }
    p = _call_param(i, j, field)
    if not isinstance(fn, dict):
        raise common.bad_request(f"'{p}' must be an object with a 'function'", p)
    if not isinstance(name, str) or not name:
        raise common.bad_request(f"'{p}.function.name' must be a non-empty string", p)
    raise common.bad_request(f"'{p}.id' must be a string", p)


def _call_param(i: int, j: int | None, field: str) -> str:
    return f"messages[{i}].{field}" + (f"[{j}]" if j is not None else "")


def convert_tools(raw: Any) -> list[dict[str, Any]] | None:
    return common.openai_tool_list(raw, _convert_tool)


def _convert_tool(t: Any, p: str) -> dict[str, Any]:
    if (
        not isinstance(t, dict)
        or t.get("type", "function") != "function"
        or not isinstance(t.get("function"), dict)
    ):
        raise common.bad_request(
            f"'{p}' must be a function tool {{type: function, function: {{...}}}}", p
        )
    fn = t["function"]
    return common.validate_function_tool(
        fn.get("name"), fn.get("description"), fn.get("parameters"), p, fn.get("strict")
    )


def convert_tool_choice(raw: Any, tools: list[dict] | None) -> Any:
    named = (
        isinstance(raw, dict)
        and raw.get("type") == "function"
        and isinstance(raw.get("function"), dict)
    )
    name = raw["function"].get("name") if named else None
    return common.openai_tool_choice(raw, tools, named, name, "{type: function, function: {name}}")


def parse_request(body: Any) -> CompletionRequest:
    body = common.require_object(body)
    n = common.opt_int(body, "n", 1, MAX_CHOICES) or 1
    tools = convert_tools(body.get("tools"))
    stream = bool(common.opt_bool(body, "stream"))
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise common.bad_request("'stream_options' must be an object", "stream_options")
    logprobs = bool(common.opt_bool(body, "logprobs"))
    top = common.opt_int(body, "top_logprobs", 0, 20) or 0
    if top and not logprobs:
        raise common.bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    max_tokens = common.opt_int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = common.opt_int(body, "max_tokens", 1)
    model = body.get("model")
    return CompletionRequest(
        messages=convert_messages(body.get("messages")),
        tools=tools,
        tool_choice=convert_tool_choice(body.get("tool_choice"), tools),
        max_tokens=max_tokens,
        temperature=common.opt_number(body, "temperature", 0.0, 2.0),
        top_p=common.opt_number(body, "top_p", 0.0, 1.0),
        stop=common.stop_list(body.get("stop"), "stop"),
        seed=common.opt_int(body, "seed"),
        stream=stream,
        include_usage=bool(stream and opts and opts.get("include_usage")),
        logprobs=logprobs,
        top_logprobs=top,
        model=model if isinstance(model, str) else None,
        n=n,
        output_format=common.openai_output_format(
            body.get("response_format"), "response_format", nested=True
        ),
        parallel_tool_calls=common.opt_bool(body, "parallel_tool_calls") is not False,
    )


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _choice(answer: Answer, index: int) -> dict[str, Any]:
    message = answer.message
    msg = {"role": "assistant", "content": message.get("content"), "refusal": None}
    if message.get("tool_calls"):
        msg["tool_calls"] = message["tool_calls"]
    lp = answer.logprobs
    return {
        "index": index,
        "message": msg,
        "logprobs": {"content": lp, "refusal": None} if lp is not None else None,
        "finish_reason": answer.finish_reason,
    }


def build_response(answer: Answer) -> dict[str, Any]:
    answers = [answer, *answer.alternatives]
    return {
        "id": answer.id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": answer.model,
        "choices": [_choice(a, i) for i, a in enumerate(answers)],
        "usage": usage(answer.prompt_tokens, sum(a.completion_tokens for a in answers)),
        "system_fingerprint": None,
    }


class ChunkWriter:
    """``chat.completion.chunk`` SSE events for one streamed completion (a ChoicesWriter).

    With ``n > 1`` each choice writes through ``choice(i)`` (its chunks carry ``index: i``) and
    the usage chunk and ``[DONE]`` come once, from ``end``, after every choice finished."""

    def __init__(
        self,
        completion_id: str,
        model: str,
        creq: CompletionRequest,
        prompt_tokens: int = 0,
        *,
        index: int = 0,
        trailer: bool = True,
    ) -> None:
        self._logprobs = creq.logprobs
        self._head = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": None,
        }
        self._include_usage = creq.include_usage
        self._index = index
        self._trailer = trailer

    def choice(self, index: int) -> ChunkWriter:
        other = copy.copy(self)
        other._index, other._trailer = index, False
        return other

    def _chunk(
        self, delta: dict[str, Any], finish: str | None = None, logprobs: list | None = None
    ) -> bytes:
        obj = dict(self._head)
        obj["choices"] = [
            {
                "index": self._index,
                "delta": delta,
                "logprobs": {"content": logprobs, "refusal": None} if logprobs else None,
                "finish_reason": finish,
            }
        ]
        if self._include_usage:
            obj["usage"] = None
        return sse(obj)

    def start(self) -> bytes:
        return self._chunk({"role": "assistant", "content": ""})

    def text(self, text: str, logprobs: list[dict[str, Any]]) -> bytes:
        return self._chunk({"content": text}, logprobs=logprobs if self._logprobs else None)

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

    def finish(self, answer: Answer, logprobs: list[dict[str, Any]]) -> bytes:
        out = self._chunk({}, answer.finish_reason, logprobs if self._logprobs else None)
        return out + self.end([answer]) if self._trailer else out

    def end(self, answers: list[Answer]) -> bytes:
        """The usage chunk (when asked for: completion tokens summed over the choices) and
        ``[DONE]``."""
        out = b""
        if self._include_usage and answers:
            obj = dict(self._head)
            obj["choices"] = []
            completion = sum(a.completion_tokens for a in answers)
            obj["usage"] = usage(answers[0].prompt_tokens, completion)
            out += sse(obj)
        return out + DONE

    def error(self, err: HTTPError) -> bytes:
        return sse(openai_error_body(err)) + DONE


DONE = b"data: [DONE]\n\n"

PROTOCOL = WireProtocol(
    "openai_chat", routes.CHAT_COMPLETIONS, "chatcmpl-", parse_request, build_response, ChunkWriter
)
