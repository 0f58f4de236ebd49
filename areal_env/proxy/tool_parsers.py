"""Per-model-family tool-call parsers and tool prompt formats.

A model calls tools by writing text in the format it was trained on. Each family here knows
two directions of that format:

- ``parse(text)`` turns generated text into ``(content_without_calls, calls, error)``, where every
  call is ``{"name": str, "arguments": str}`` (arguments as a JSON object string). Parsing never
  raises: malformed calls come back as ``(text, [], True)`` so the proxy can return the text and
  count the failure.
- ``format_calls`` / ``format_tool_results`` / ``instructions`` / ``prefill`` write the same format
  into prompts, for chat templates that ignore ``tools`` (the proxy then teaches the format in the
  system prompt and renders earlier calls exactly as the model is told to produce them).

Families: ``hermes`` (``<tool_call>[...]</tool_call>``, JSON list form, as SmolLM2's model card
uses), ``qwen`` (``<tool_call>\\n{...}\\n</tool_call>``, one object per tag), ``llama3`` (bare JSON,
optionally after ``<|python_tag|>``, several separated by ``;``), ``mistral`` (``[TOOL_CALLS]``
followed by a JSON list, or the newer ``name[ARGS]{...}`` form) and ``none``. ``hermes`` and
``qwen`` parse both the object and the list form.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from areal_env.engine.grammar import JSON_LAYOUT
from areal_env.proxy.tool_json import (
    Salvage,
    as_object,
    calls_from_values,
    decode_prefix,
    decode_sequence,
    raw_argument_text,
    recovered_arguments,
    salvage_region,
    strip_fences,
)

logger = logging.getLogger(__name__)

ParseResult = tuple[str | None, list[dict[str, str]], bool]


def call_json(call: dict[str, Any], args_key: str = "arguments") -> str:
    """One call as the JSON object the formats write (``args_key``: llama3 says
    ``parameters``)."""
    args = as_object(call.get("arguments"))
    return json.dumps({"name": call["name"], args_key: args}, ensure_ascii=False)


def call_opening(name: str | None, args_key: str = "arguments") -> str:
    """The start of ``call_json`` up to the arguments (``name`` forced), or up to the name."""
    return f'{{"name": {json.dumps(name)}, "{args_key}":' if name else '{"name": "'


def _plain(text: str) -> ParseResult:
    return (text if text else None), [], False


def _example_value(schema: dict[str, Any], index: int = 0) -> Any:
    """A plausible placeholder value for a JSON-schema property (for the worked example)."""
    if not isinstance(schema, dict):
        return "value"
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if not isinstance(kind, str):
        kind = "string"
    return {
        "integer": 3 + 2 * index,
        "number": 2.5 + index,
        "boolean": True,
        "array": [],
        "object": {},
        "null": None,
    }.get(kind, "example")


def example_arguments(function: dict[str, Any]) -> dict[str, Any]:
    """Placeholder arguments that satisfy a tool's schema shape (required properties first)."""
    params = function.get("parameters") or {}
    props = params.get("properties") or {}
    names = [n for n in (params.get("required") or []) if n in props] or list(props)[:2]
    return {n: _example_value(props[n], i) for i, n in enumerate(names)}


def function_specs(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The ``function`` parts of OpenAI tools (accepts bare function dicts too)."""
    specs = []
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and fn.get("name"):
            specs.append(fn)
    return specs


def tool_choice_name(tool_choice: Any) -> str | None:
    """The forced function name of a named ``tool_choice``, else None."""
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return fn["name"]
        if isinstance(tool_choice.get("name"), str):  # Responses-API style
            return tool_choice["name"]
    return None


class ToolParser:
    """Base family: no tool calls at all (``none``)."""

    name = "none"
    #: What the format looks like, shown to the model in the injected instructions.
    call_format_hint = ""
    #: Text that closes ALL of a reply's calls (one block holds every call), or None. A reply
    #: under ``tool_choice: required`` stops there: what a model writes after its call block
    #: (a guessed result, "The answer is ...") is never sent on, only trained on and shown back.
    calls_end: str | None = None
    #: The call block's text around the calls (``format_calls`` writes exactly this), used to
    #: write the grammar of strict tools (``call_grammar``). ``block_close`` None: no grammar.
    block_open = ""
    call_sep = ""
    block_close: str | None = None
    args_key = "arguments"

    def parse(self, text: str) -> ParseResult:
        """Split ``text`` into content and calls; never raises."""
        return _plain(text)

    def call_grammar(
        self,
        tools: list[dict[str, Any]] | None,
        tool_choice: Any = None,
        answer_schema: dict[str, Any] | None = None,
        parallel: bool = True,
    ) -> str | None:
        """A Lark grammar (llguidance's dialect) for a reply under constrained decoding: calls in
        this family's wrapper whose arguments match their tool's schema (any JSON object for a
        tool that is not ``strict``), and, besides them, free text or, with ``answer_schema``,
        a JSON answer matching it. Under a named or ``required`` tool_choice the reply continues
        the prompt's ``prefill`` and is one or more calls (one, with ``parallel`` False:
        ``parallel_tool_calls: false``). None where this family has no call block to write
        (``none``) and there are no tools to call."""
        specs = function_specs(tools) if tool_choice != "none" else []
        layout = dict(JSON_LAYOUT)
        answer = (
            "%json " + json.dumps({**answer_schema, "x-guidance": layout}, ensure_ascii=False)
            if answer_schema is not None
            else None
        )
        if not specs or self.block_close is None:
            return f"%llguidance {{}}\nstart: {answer}\n" if answer else None
        lines = ["%llguidance {}"]
        names = []
        for i, fn in enumerate(specs):
            lines.append(
                f"args_{i}: %json "
                + json.dumps({**_args_schema(fn), "x-guidance": layout}, ensure_ascii=False)
            )
            names.append(json.dumps(fn["name"], ensure_ascii=False))
        opening = _lark_literal(call_opening("X", self.args_key).split('"X"')[0])
        key = _lark_literal(f', "{self.args_key}": ')
        for i, name in enumerate(names):
            lines.append(f'call_{i}: {opening} {_lark_literal(name)} {key} args_{i} "}}"')
            rest = _lark_literal(name[1:] + f', "{self.args_key}": ')
            lines.append(f'named_rest_{i}: {rest} args_{i} "}}"')
        lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(names))))
        sep, close = _lark_literal(self.call_sep), _lark_literal(self.block_close)
        more = f"({sep} call)*" if self.call_sep and parallel else ""
        forced = tool_choice_name(tool_choice)
        if forced in {fn["name"] for fn in specs}:
            i = [fn["name"] for fn in specs].index(forced)  # after prefill(name): ' {args}}'
            lines.append(f'start: " " args_{i} "}}" {close}')
        elif tool_choice == "required":  # after prefill(None): 'name", "arguments": {args}}'
            first = " | ".join(f"named_rest_{i}" for i in range(len(names)))
            lines.append(f"start: ({first}) {more} {close}")
        elif answer_schema is not None and not self.block_open:
            # bare JSON calls and a JSON answer both start with "{": one schema for either
            calls = [
                {
                    "type": "object",
                    "properties": {"name": {"const": fn["name"]}, self.args_key: _args_schema(fn)},
                    "required": ["name", self.args_key],
                    "additionalProperties": False,
                }
                for fn in specs
            ]
            either = {"anyOf": [answer_schema, *calls], "x-guidance": layout}
            lines.append("start: %json " + json.dumps(either, ensure_ascii=False))
        elif answer:
            block = f"{_lark_literal(self.block_open)} call {more} {close}"
            lines.append(f"start: answer | {block}")
            lines.append(f"answer: {answer}")
        elif self.block_open:
            lines.append(f"start: TEXT | head call {more} {close}")
            lines.append(f"head[lazy]: TEXT {_lark_literal(self.block_open)}")
            lines.append("TEXT: /(.|\\n)*/")
        else:  # the calls are bare JSON: text that does not start with "{" is prose
            lines.append(f"start: TEXT | call {more} {close}")
            lines.append("TEXT: /([^{](.|\\n)*)?/")
        return "\n".join(lines) + "\n"

    def safe_parse(self, text: str) -> ParseResult:
        """``parse`` with a last-resort guard: any unexpected exception → text + error flag."""
        try:
            return self.parse(text)
        except Exception:  # noqa: BLE001 - parsing model output must never crash a request
            logger.exception("tool parser %s failed unexpectedly", self.name)
            return (text if text else None), [], True

    def salvage(self, text: str) -> Salvage:
        """Recover what a failed ``parse`` can still give: the text without call markup, and the
        calls whose names can be read, each with the model's raw arguments text.

        Called only after ``parse`` reported an error. Never raises; families override
        ``split_markup`` (where the markup is), not this.
        """
        try:
            outside, region = self.split_markup(text)
            return salvage_region(region, outside)
        except Exception:  # noqa: BLE001 - recovery must never crash a request
            logger.exception("tool parser %s failed to salvage a call", self.name)
            return Salvage(content=None)

    def split_markup(self, text: str) -> tuple[str, str]:
        """``(text outside any call markup, the markup itself)``; base family: no markup."""
        return text, ""

    # ---- prompt side -------------------------------------------------------------------------
    def format_calls(self, calls: list[dict[str, Any]]) -> str:
        """Text of an assistant turn's calls (``[{"name", "arguments"}]``), in this format."""
        return HermesParser().format_calls(calls)

    def format_tool_results(self, results: list[str]) -> str:
        """Text of a user turn carrying tool results (consecutive tool messages merged)."""
        return "\n".join(f"<tool_response>\n{r}\n</tool_response>" for r in results)

    def prefill(self, name: str | None) -> str:
        """Text that starts a call (``name`` forced or any): prefilled for required/named."""
        return ""

    def json_opening(self, name: str | None) -> str:
        """The JSON text that ``prefill(name)`` ends with, after the family's wrapper (a tag, a
        marker): where the value of a required call begins; "" for a family without one."""
        return ""

    def required_call_starts(self, tools: list[dict[str, Any]]) -> list[str]:
        """Texts that may follow ``prefill(None)`` under ``tool_choice: required``: an offered
        tool's name and the start of its arguments (up to the first property's value). Empty
        when this family has no open name slot to constrain."""
        return []

    def guided_call_text(self, name: str, arguments: dict[str, Any]) -> str | None:
        """The text that follows ``prefill(None)`` in a call of ``name`` with ``arguments``, up
        to the end of the call's object (what comes after it, a list's ``]`` or the closing tag,
        is the model's): the reference call a guided reply is made to start with. None when
        this family has no open name slot to write it into."""
        return None

    def instructions(self, tools: list[dict[str, Any]], tool_choice: Any = None) -> str:
        """System-prompt text that offers ``tools`` and teaches this family's call format."""
        specs = function_specs(tools)
        if not specs or not self.call_format_hint:
            return ""
        forced = tool_choice_name(tool_choice)
        lines = [
            "You solve tasks by composing function calls. You get a question and a set of "
            "functions (tools); decide which calls answer the question and make them.",
            "You have access to these tools:",
            f"<tools>{json.dumps(specs, ensure_ascii=False)}</tools>",
            "A call MUST strictly follow this format, with NO other text:",
            self.call_format_hint,
            "Tool results come back inside <tool_response></tool_response>; "
            "then give the final answer in plain text.",
        ]
        if tool_choice == "required":
            lines.append("In this reply you must call at least one tool.")
        elif forced:
            lines.append(f"In this reply you must call the tool `{forced}`.")
        return "\n".join(lines)

    def worked_example(
        self, tools: list[dict[str, Any]], tool_choice: Any = None
    ) -> list[dict[str, str]]:
        """One example exchange (a user request and the assistant's call) to show the format.

        Small models follow the format far more often with one worked example turn than with
        instructions alone (SmolLM2: 0/5 calls without, 3/4 with; shared/FACTS.md). The example
        calls the forced tool, else the first one, with placeholder arguments from its schema.
        """
        specs = function_specs(tools)
        if not specs or not self.call_format_hint:
            return []
        forced = tool_choice_name(tool_choice)
        fn = next((s for s in specs if s["name"] == forced), specs[0])
        args = example_arguments(fn)
        spoken = " and ".join(f"{k} = {json.dumps(v, ensure_ascii=False)}" for k, v in args.items())
        request = f"Use the {fn['name']} tool" + (f" with {spoken}." if spoken else ".")
        call = self.format_calls([{"name": fn["name"], "arguments": args}])
        return [{"role": "user", "content": request}, {"role": "assistant", "content": call}]


def _args_schema(fn: dict[str, Any]) -> dict[str, Any]:
    """What a call's arguments must match: a ``strict`` tool's parameters, else any object."""
    params = fn.get("parameters") if fn.get("strict") else None
    return params if isinstance(params, dict) else {"type": "object"}


def _lark_literal(text: str) -> str:
    """``text`` as a Lark string literal (JSON's escapes are Lark's); nothing for ``""``."""
    return json.dumps(text, ensure_ascii=False) if text else ""


class HermesParser(ToolParser):
    """``<tool_call>`` tags holding a JSON object or a JSON list of objects.

    Formats calls in the list form (``<tool_call>[{...}, ...]</tool_call>``): that is the form in
    SmolLM2's model card, and the one it follows with a worked example (shared/FACTS.md).
    """

    name = "hermes"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    calls_end: str | None = "</tool_call>"  # the list form: one block holds every call
    block_open = "<tool_call>["
    call_sep = ", "
    block_close: str | None = "]</tool_call>"
    call_format_hint = (
        '<tool_call>[{"name": "func_name1", "arguments": {"argument1": "value1", '
        '"argument2": "value2"}}]</tool_call>'
    )
    _block_re = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def parse(self, text: str) -> ParseResult:
        if self.open_tag not in text:
            return _plain(text)
        calls: list[dict[str, str]] = []
        for block in self._block_re.findall(text):
            body = strip_fences(block.strip()).strip()
            try:
                values, _rest = decode_sequence(body)
            except ValueError:
                return text, [], True
            parsed = calls_from_values(values)
            if parsed is None:
                return text, [], True
            calls.extend(parsed)
        content = self._block_re.sub("", text).replace(self.close_tag, "").strip()
        return (content or None), calls, False

    def split_markup(self, text: str) -> tuple[str, str]:
        region = "\n".join(b.replace(self.close_tag, "") for b in self._block_re.findall(text))
        outside = self._block_re.sub("", text).replace(self.close_tag, "")
        return outside, region

    def format_calls(self, calls: list[dict[str, Any]]) -> str:
        return f"<tool_call>[{', '.join(call_json(c) for c in calls)}]</tool_call>"

    def prefill(self, name: str | None) -> str:
        return "<tool_call>" + self.json_opening(name)

    def json_opening(self, name: str | None) -> str:
        return "[" + call_opening(name)

    def required_call_starts(self, tools: list[dict[str, Any]]) -> list[str]:
        out = []
        for fn in function_specs(tools):
            name = json.dumps(fn["name"], ensure_ascii=False)[1:-1]
            params = fn.get("parameters") or {}
            props = list((params.get("properties") or {}).keys())
            first = next((n for n in params.get("required") or [] if n in props), None)
            first = first or (props[0] if props else None)
            args = "{" + (json.dumps(first, ensure_ascii=False) + ": " if first else "")
            out.append(f'{name}", "arguments": {args}')
        return out

    def guided_call_text(self, name: str, arguments: dict[str, Any]) -> str | None:
        quoted = json.dumps(name, ensure_ascii=False)[1:-1]
        return f'{quoted}", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}'


class QwenParser(HermesParser):
    """Like hermes, but formats one JSON object per ``<tool_call>`` tag (Qwen2.5/Hermes-2 style)."""

    name = "qwen"
    calls_end = None  # one tag per call: parallel calls follow the first closing tag
    block_open = "<tool_call>\n"
    call_sep = "\n</tool_call>\n<tool_call>\n"
    block_close = "\n</tool_call>"
    call_format_hint = (
        '<tool_call>\n{"name": "func_name1", "arguments": {"argument1": "value1"}}\n</tool_call>'
    )

    def format_calls(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"<tool_call>\n{call_json(c)}\n</tool_call>" for c in calls)

    def prefill(self, name: str | None) -> str:
        return "<tool_call>\n" + self.json_opening(name)

    def json_opening(self, name: str | None) -> str:
        return call_opening(name)


class Llama3Parser(ToolParser):
    """Bare JSON ``{"name": ..., "parameters"|"arguments": ...}``, maybe after ``<|python_tag|>``.

    Several calls may be separated by ``;``. Text that merely starts with a JSON value without a
    ``name`` is ordinary content (a model may answer in JSON), not a failed call.
    """

    name = "llama3"
    python_tag = "<|python_tag|>"
    block_open = ""
    call_sep = "; "
    block_close = ""
    args_key = "parameters"
    call_format_hint = '{"name": "func_name1", "parameters": {"argument1": "value1"}}'
    _looks_like_call = re.compile(r'^\s*[\[{]\s*\{?\s*"(name|function)"\s*:')

    def parse(self, text: str) -> ParseResult:
        tagged = self.python_tag in text
        before, body = text.split(self.python_tag, 1) if tagged else ("", text)
        body = strip_fences(body.strip()).strip()
        if not body.startswith(("{", "[")):
            return (text, [], True) if tagged else _plain(text)
        try:
            values, rest = decode_sequence(body)
        except ValueError:
            if tagged or self._looks_like_call.match(body):
                return text, [], True
            return _plain(text)
        calls = calls_from_values(values)
        if calls is None:
            if tagged or self._looks_like_call.match(body):
                return text, [], True
            return _plain(text)
        content = (before.strip() + "\n" + rest.strip()).strip()
        return (content or None), calls, False

    def split_markup(self, text: str) -> tuple[str, str]:
        if self.python_tag in text:
            before, body = text.split(self.python_tag, 1)
            return before, body
        if self._looks_like_call.match(strip_fences(text.strip()).strip()):
            return "", text
        return text, ""

    def format_calls(self, calls: list[dict[str, Any]]) -> str:
        return "; ".join(call_json(c, "parameters") for c in calls)

    def prefill(self, name: str | None) -> str:
        return self.json_opening(name)

    def json_opening(self, name: str | None) -> str:
        return call_opening(name, "parameters")


class MistralParser(ToolParser):
    """``[TOOL_CALLS]`` followed by a JSON list (v3) or by ``name[ARGS]{...}`` (v11+)."""

    name = "mistral"
    marker = "[TOOL_CALLS]"
    block_open = "[TOOL_CALLS]["
    call_sep = ", "
    block_close = "]"
    call_format_hint = '[TOOL_CALLS][{"name": "func_name1", "arguments": {"argument1": "value1"}}]'
    _args_re = re.compile(r"^\s*([^\[\]{}\s]+)\s*(?:\[CALL_ID\]\s*\S+?\s*)?\[ARGS\]", re.DOTALL)

    def parse(self, text: str) -> ParseResult:
        if self.marker not in text:
            return _plain(text)
        before, *segments = text.split(self.marker)
        calls: list[dict[str, str]] = []
        trailing: list[str] = []
        for seg in segments:
            body = strip_fences(seg.strip()).strip()
            if body.startswith(("[", "{")):
                try:
                    values, rest = decode_sequence(body)
                except ValueError:
                    return text, [], True
                parsed = calls_from_values(values)
            else:
                m = self._args_re.match(body)
                if not m:
                    return text, [], True
                try:
                    args, rest = decode_prefix(body[m.end() :])
                except ValueError:
                    return text, [], True
                parsed = calls_from_values([{"name": m.group(1), "arguments": args}])
            if parsed is None:
                return text, [], True
            calls.extend(parsed)
            trailing.append(rest.strip())
        content = "\n".join(p for p in [before.strip(), *trailing] if p).strip()
        return (content or None), calls, False

    def split_markup(self, text: str) -> tuple[str, str]:
        if self.marker not in text:
            return text, ""
        before, rest = text.split(self.marker, 1)
        return before, rest

    def salvage(self, text: str) -> Salvage:
        found = super().salvage(text)
        if found.calls or self.marker not in text:
            return found
        # the newer ``name[ARGS]{...}`` form carries the name outside any JSON
        for seg in text.split(self.marker)[1:]:
            m = self._args_re.match(seg.strip())
            if m:
                raw = raw_argument_text(seg.strip()[m.end() :])
                found.calls.append({"name": m.group(1), "arguments": recovered_arguments(raw)})
                if found.raw_arguments is None:
                    found.raw_arguments = raw
        return found

    def format_calls(self, calls: list[dict[str, Any]]) -> str:
        return f"{self.marker}[{', '.join(call_json(c) for c in calls)}]"

    def prefill(self, name: str | None) -> str:
        return self.marker + self.json_opening(name)

    def json_opening(self, name: str | None) -> str:
        return "[" + call_opening(name)


_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen": QwenParser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
    "none": ToolParser,
}


def available_tool_parsers() -> list[str]:
    """Names accepted by ``get_tool_parser`` (plus ``auto`` in configs)."""
    return sorted(_PARSERS)


def get_tool_parser(name: str) -> ToolParser:
    """A parser instance by family name; ``ValueError`` listing the valid names otherwise."""
    try:
        return _PARSERS[name.lower()]()
    except (KeyError, AttributeError):
        raise ValueError(
            f"unknown tool parser {name!r}; valid: {available_tool_parsers()} or 'auto'"
        ) from None


def register_tool_parser(name: str, parser_cls: type[ToolParser]) -> None:
    """Add a family (for models whose format is not built in)."""
    _PARSERS[name.lower()] = parser_cls


def detect_tool_parser(chat_template: str | None) -> str:
    """Guess the family from a chat template's text.

    Templates that render ``<tool_call>`` natively use one object per tag → ``qwen``;
    ``[TOOL_CALLS]`` → ``mistral``; ``<|python_tag|>``/``ipython`` → ``llama3``. Templates with
    no tool syntax (plain ChatML such as SmolLM2's) → ``hermes``: the proxy then injects the
    hermes list-form instructions itself.
    """
    tpl = chat_template or ""
    if "[TOOL_CALLS]" in tpl:
        return "mistral"
    if "<tool_call>" in tpl:
        return "qwen"
    if "<|python_tag|>" in tpl or "ipython" in tpl or "<|eom_id|>" in tpl:
        return "llama3"
    return "hermes"
