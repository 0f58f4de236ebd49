"""A completion's text as an OpenAI-style assistant message: reasoning, content, tool calls."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from areal_env.proxy.tool_parsers import ToolParser, function_specs, tool_choice_name


@dataclass
class ParsedOutput:
    """A completion turned into an OpenAI-style assistant message."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str = "stop"
    """``stop`` | ``length`` | ``tool_calls``."""
    tool_parse_error: bool = False
    """The text looked like a tool call but could not be parsed (then see ``tool_call_recovery``)."""
    tool_call_recovery: str | None = None
    """After a parse error: ``raw_arguments`` (returned as tool calls carrying the model's raw
    arguments text) or ``markup_removed`` (returned as plain text with the markup taken out)."""
    reasoning: str | None = None
    """Text inside a leading ``<think>...</think>`` block, if the model wrote one."""
    text: str = ""
    """The full generated text (with any prefilled call start), for logs and debugging."""

    def to_message(self) -> dict[str, Any]:
        """The OpenAI assistant message (what the cache stores as ``output_message``)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


Recover = Callable[[str], tuple[str | None, list[dict[str, str]], str]]


def parse_completion(
    text: str,
    stop_reason: str,
    parser: ToolParser | None,
    clean: Callable[[str], str],
    *,
    recover: Recover | None = None,
) -> ParsedOutput:
    """Parse ``text`` (the decoded completion, with any prefilled call start); never raises.

    ``parser``: the tool-call parser when tools were offered, else ``None`` (no calls parsed).
    Calls naming tools that were not offered are still returned (the agent decides).
    ``clean`` removes special-token text from content. ``recover(body)``: what to answer when
    call markup did not parse (content, calls, how it recovered). ``finish_reason``: ``tool_calls`` when
    calls were parsed, ``length`` when the output was cut (by length or an abort), else
    ``stop``.
    """
    reasoning = None
    body = text
    stripped = body.lstrip()
    if stripped.startswith("<think>") and "</think>" in stripped:
        inner, body = stripped[len("<think>") :].split("</think>", 1)
        reasoning = inner.strip() or None
        body = body.lstrip()
    calls: list[dict[str, str]] = []
    error = False
    recovery: str | None = None
    content: str | None = body
    if parser is not None:
        content, calls, error = parser.safe_parse(body)
        if error and recover is not None:
            content, calls, recovery = recover(body)
    content = clean(content or "")
    if calls:
        finish = "tool_calls"
    else:
        finish = "length" if stop_reason in ("length", "abort") else "stop"
    return ParsedOutput(
        content=(content or None) if calls else content,
        tool_calls=[
            {
                "id": new_call_id(),
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for c in calls
        ],
        finish_reason=finish,
        tool_parse_error=error,
        tool_call_recovery=recovery,
        reasoning=reasoning,
        text=text,
    )


def recover_calls(
    parser: ToolParser, body: str, tools: Any, tool_choice: Any
) -> tuple[str | None, list[dict[str, str]], str]:
    """Keep the protocol's promises for call markup that did not parse.

    OpenAI's contract: a forced (named or ``required``) tool_choice always yields a tool
    call, and ``arguments`` is the model's text, which may be invalid JSON (agent frameworks
    answer that with their own validation error: a training signal). So: calls whose name
    can be read come back as tool calls with their raw arguments; under a forced choice with
    no readable name the forced (or, for ``required``, the only/first offered) tool is called
    with the raw arguments text; otherwise the reply is plain text with the markup removed.
    Never markup in the content.
    """
    found = parser.salvage(body)
    calls = list(found.calls)
    forced = tool_choice_name(tool_choice)
    if not calls and (forced or tool_choice == "required"):
        names = [f["name"] for f in function_specs(tools)]
        name = forced or (names[0] if names else None)
        if name:
            calls = [{"name": name, "arguments": found.raw_arguments or ""}]
    if calls:
        return found.content, calls, "raw_arguments"
    return found.content, [], "markup_removed"
