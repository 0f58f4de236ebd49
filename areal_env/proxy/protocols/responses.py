"""OpenAI Responses API: ``input`` items → internal messages, result → ``response`` / events.

``function_call`` items join the assistant turn before them (one turn may hold text and calls)
and ``function_call_output`` items become ``tool`` messages; a client that echoes the previous
output items back therefore extends the earlier completion and is spliced token-exactly.
``previous_response_id`` is resolved from the session's own tree.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from areal_env.http import routes
from areal_env.http.errors import HTTPError
from areal_env.proxy.protocols import common
from areal_env.proxy.protocols.common import Answer, CompletionRequest, WireProtocol, sse


def convert_input(instructions: Any, raw: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise common.bad_request("'instructions' must be a string", "instructions")
        out.append({"role": "system", "content": instructions})
    if isinstance(raw, str):
        out.append({"role": "user", "content": raw})
        return out
    if not isinstance(raw, list) or not raw:
        raise common.bad_request("'input' must be a string or a non-empty list of items", "input")
    for i, item in enumerate(raw):
        p = f"input[{i}]"
        if not isinstance(item, dict):
            raise common.bad_request(f"'{p}' must be an object", p)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise common.bad_request(
                    f"'{p}.role' must be user, assistant, system or developer", p
                )
            role = "system" if role == "developer" else role
            text = common.request_text(item.get("content"), f"{p}.content")
            if (
                role == "assistant"
                and out
                and out[-1]["role"] == "assistant"
                and out[-1].get("tool_calls")
            ):
                # text after calls in the same turn cannot be expressed; start a new turn
                out.append({"role": "assistant", "content": text})
            elif (
                role == "assistant"
                and out
                and out[-1]["role"] == "assistant"
                and out[-1]["content"] is not None
            ):
                out[-1]["content"] += text
            else:
                out.append({"role": role, "content": text})
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise common.bad_request(
                    f"'{p}' function_call needs string 'call_id' and 'name'", p
                )
            call = {
                "id": call_id,
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": common.arguments_string(item.get("arguments"), f"{p}.arguments"),
                },
            }
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise common.bad_request(f"'{p}.call_id' must be a string", p)
            output = item.get("output")
            text = output if isinstance(output, str) else common.request_text(output, f"{p}.output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            continue
        else:
            raise common.bad_request(f"input item type {kind!r} is not supported", p)
    return out


def convert_tools(raw: Any) -> list[dict[str, Any]] | None:
    return common.openai_tool_list(raw, _convert_tool)


def _convert_tool(t: Any, p: str) -> dict[str, Any]:
    if not isinstance(t, dict) or t.get("type") != "function":
        kind = t.get("type") if isinstance(t, dict) else None
        raise common.bad_request(f"tool type {kind!r} is not supported (function tools only)", p)
    name = t.get("name")
    if not isinstance(name, str) or not name:
        raise common.bad_request(f"'{p}.name' must be a non-empty string", p)
    params = t.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise common.bad_request(f"'{p}.parameters' must be a JSON schema object", p)
    fn: dict[str, Any] = {"name": name}
    if isinstance(t.get("description"), str) and t["description"]:
        fn["description"] = t["description"]
    fn["parameters"] = params if params is not None else {"type": "object", "properties": {}}
    strict = t.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise common.bad_request(f"'{p}.strict' must be a boolean", f"{p}.strict")
    if strict:
        fn["strict"] = True
    return {"type": "function", "function": fn}


def convert_tool_choice(raw: Any, tools: list[dict] | None) -> Any:
    named = (
        isinstance(raw, dict) and raw.get("type") == "function" and isinstance(raw.get("name"), str)
    )
    name = raw["name"] if named else None
    return common.openai_tool_choice(raw, tools, named, name, "{type: function, name}")


def parse_request(body: Any) -> CompletionRequest:
    body = common.require_object(body)
    tools = convert_tools(body.get("tools"))
    model = body.get("model")
    text = body.get("text")
    if text is not None and not isinstance(text, dict):
        raise common.bad_request("'text' must be an object", "text")
    output_format = common.openai_output_format((text or {}).get("format"), "text.format", False)
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise common.bad_request("'reasoning' must be an object", "reasoning")
    store = common.opt_bool(body, "store")
    include = body.get("include")
    if include is not None and not (
        isinstance(include, list) and all(isinstance(x, str) for x in include)
    ):
        raise common.bad_request("'include' must be a list of strings", "include")
    top_logprobs = common.opt_int(body, "top_logprobs", 0, 20)
    req = CompletionRequest(
        messages=convert_input(body.get("instructions"), body.get("input")),
        tools=tools,
        tool_choice=convert_tool_choice(body.get("tool_choice"), tools),
        max_tokens=common.opt_int(body, "max_output_tokens", 1),
        temperature=common.opt_number(body, "temperature", 0.0, 2.0),
        top_p=common.opt_number(body, "top_p", 0.0, 1.0),
        stream=bool(common.opt_bool(body, "stream")),
        model=model if isinstance(model, str) else None,
        output_format=output_format,
        # logprobs of the output text: asked for by ``include`` (OpenAI's way) or implied by
        # ``top_logprobs``; other ``include`` values (encrypted reasoning, ...) have nothing here
        logprobs=LOGPROBS_INCLUDE in (include or []) or bool(top_logprobs),
        top_logprobs=top_logprobs or 0,
        parallel_tool_calls=common.opt_bool(body, "parallel_tool_calls") is not False,
    )
    prev = common.opt_str(body, "previous_response_id")
    if prev:
        req.extra["previous_response_id"] = prev
    req.extra["echo"] = {
        "instructions": body.get("instructions"),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_logprobs": top_logprobs,
        "max_output_tokens": req.max_tokens,
        "previous_response_id": prev,
        "metadata": body.get("metadata") if isinstance(body.get("metadata"), dict) else {},
        "parallel_tool_calls": req.parallel_tool_calls,
        "store": True if store is None else store,
        "reasoning": {"effort": None, "summary": None, **(reasoning or {})},
        "text": {
            **(text or {}),
            "format": output_format.echo if output_format else {"type": "text"},
        },
    }
    return req


#: The ``include`` value that asks for the logprobs of the output text.
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def message_item(
    text: str,
    item_id: str | None = None,
    status: str = "completed",
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {
        "type": "message",
        "id": item_id or _item_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [part],
    }


def text_logprobs(entries: list[dict[str, Any]] | None, text: str) -> list[dict[str, Any]]:
    """The entries of the tokens that wrote ``text``, the start of the output: a reply that also
    calls tools has the calls' tokens after its text, and those belong to no text part."""
    out: list[dict[str, Any]] = []
    written = 0
    for e in entries or []:
        if written >= len(text):
            break
        out.append(e)
        written += len(e["token"])
    return out


def function_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": _item_id("fc"),
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": status,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def response_object(
    *,
    response_id: str,
    model: str,
    echo: dict[str, Any],
    output: list[dict[str, Any]],
    status: str,
    finish_reason: str | None,
    usage_obj: dict[str, Any] | None,
    created_at: float | None = None,
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(created_at or time.time()),
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"}
        if finish_reason == "length"
        else None,
        "instructions": echo.get("instructions"),
        "max_output_tokens": echo.get("max_output_tokens"),
        "model": model,
        "output": output,
        "parallel_tool_calls": bool(echo.get("parallel_tool_calls", True)),
        "previous_response_id": echo.get("previous_response_id"),
        "reasoning": echo.get("reasoning", {"effort": None, "summary": None}),
        "store": bool(echo.get("store", True)),
        "temperature": echo.get("temperature"),
        "text": echo.get("text", {"format": {"type": "text"}}),
        "tool_choice": echo.get("tool_choice", "auto"),
        "tools": echo.get("tools", []),
        "top_p": echo.get("top_p"),
        "top_logprobs": echo.get("top_logprobs"),
        "truncation": "disabled",
        "usage": usage_obj,
        "metadata": echo.get("metadata", {}),
    }


def output_items(
    message: dict[str, Any], logprobs: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """The output items of an assistant message; ``logprobs`` (OpenAI entries of the whole
    output) go with its text."""
    items = []
    if message.get("content"):
        text = message["content"]
        items.append(message_item(text, logprobs=text_logprobs(logprobs, text)))
    for c in message.get("tool_calls") or []:
        items.append(function_item(c))
    return items


def status_of(finish_reason: str) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


class EventWriter:
    """Responses streaming events, with sequence numbers, for one response (a StreamWriter)."""

    def __init__(
        self, response_id: str, model: str, creq: CompletionRequest, prompt_tokens: int = 0
    ) -> None:
        self._id = response_id
        self._model = model
        self._echo: dict[str, Any] = creq.extra.get("echo", {})
        self._seq = 0
        self._created = time.time()
        self._output: list[dict[str, Any]] = []
        self._msg: dict[str, Any] | None = None
        self._text = ""
        self._logprobs: list[dict[str, Any]] = []  # of the open text part

    def _ev(self, obj: dict[str, Any]) -> bytes:
        obj["sequence_number"] = self._seq
        self._seq += 1
        return sse(obj, obj["type"])

    def _resp(self, status: str, finish: str | None = None, usage_obj: dict | None = None) -> dict:
        return response_object(
            response_id=self._id,
            model=self._model,
            echo=self._echo,
            output=list(self._output),
            status=status,
            finish_reason=finish,
            usage_obj=usage_obj,
            created_at=self._created,
        )

    def start(self) -> bytes:
        r = self._resp("in_progress")
        return self._ev({"type": "response.created", "response": r}) + self._ev(
            {"type": "response.in_progress", "response": r}
        )

    def text(self, delta: str, logprobs: list[dict[str, Any]] | None = None) -> bytes:
        out = b""
        if self._msg is None:
            self._msg = message_item("", status="in_progress")
            self._msg["content"] = []
            out += self._ev(
                {
                    "type": "response.output_item.added",
                    "output_index": len(self._output),
                    "item": self._msg,
                }
            )
            out += self._ev(
                {
                    "type": "response.content_part.added",
                    "item_id": self._msg["id"],
                    "output_index": len(self._output),
                    "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": []},
                }
            )
        self._text += delta
        self._logprobs.extend(logprobs or [])
        return out + self._ev(
            {
                "type": "response.output_text.delta",
                "item_id": self._msg["id"],
                "output_index": len(self._output),
                "content_index": 0,
                "delta": delta,
                "logprobs": logprobs or [],
            }
        )

    def _close_text(self) -> bytes:
        if self._msg is None:
            return b""
        idx = len(self._output)
        item = message_item(self._text, self._msg["id"], logprobs=self._logprobs)
        part = item["content"][0]
        out = self._ev(
            {
                "type": "response.output_text.done",
                "item_id": item["id"],
                "output_index": idx,
                "content_index": 0,
                "text": self._text,
                "logprobs": self._logprobs,
            }
        )
        out += self._ev(
            {
                "type": "response.content_part.done",
                "item_id": item["id"],
                "output_index": idx,
                "content_index": 0,
                "part": part,
            }
        )
        out += self._ev({"type": "response.output_item.done", "output_index": idx, "item": item})
        self._output.append(item)
        self._msg = None
        self._logprobs = []
        return out

    def tool_calls(self, calls: list[dict[str, Any]]) -> bytes:
        out = self._close_text()
        for c in calls:
            idx = len(self._output)
            item = function_item(c)
            added = dict(item, arguments="", status="in_progress")
            out += self._ev(
                {"type": "response.output_item.added", "output_index": idx, "item": added}
            )
            out += self._ev(
                {
                    "type": "response.function_call_arguments.delta",
                    "item_id": item["id"],
                    "output_index": idx,
                    "delta": item["arguments"],
                }
            )
            out += self._ev(
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": idx,
                    "arguments": item["arguments"],
                }
            )
            out += self._ev(
                {"type": "response.output_item.done", "output_index": idx, "item": item}
            )
            self._output.append(item)
        return out

    def finish(self, answer: Answer, logprobs: list[dict[str, Any]] | None = None) -> bytes:
        out = self._close_text()
        status = status_of(answer.finish_reason)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        use = usage(answer.prompt_tokens, answer.completion_tokens)
        r = self._resp(status, answer.finish_reason, use)
        return out + self._ev({"type": kind, "response": r})

    def error(self, err: HTTPError) -> bytes:
        return self._ev({"type": "error", "code": err.code, "message": err.message, "param": None})


def build_response(answer: Answer) -> dict[str, Any]:
    return response_object(
        response_id=answer.id,
        model=answer.model,
        echo=answer.creq.extra.get("echo", {}),
        output=output_items(answer.message, answer.logprobs),
        status=status_of(answer.finish_reason),
        finish_reason=answer.finish_reason,
        usage_obj=usage(answer.prompt_tokens, answer.completion_tokens),
    )


# ``previous_response_id`` is resolved by the pipeline, which owns the conversation tree.
PROTOCOL = WireProtocol(
    "responses", routes.RESPONSES, "resp_", parse_request, build_response, EventWriter
)
