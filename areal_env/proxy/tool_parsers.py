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
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

ParseResult = tuple[str | None, list[dict[str, str]], bool]

_FENCE_RE = re.compile(r"^\s*```[a-zA-Z0-9_-]*\s*\n?(.*?)\n?\s*```\s*$", re.DOTALL)
_DECODER = json.JSONDecoder()


def _strip_fences(text: str) -> str:
    """Remove a surrounding markdown code fence (```json ... ```), if any."""
    m = _FENCE_RE.match(text)
    return m.group(1) if m else text


def _decode_prefix(text: str) -> tuple[Any, str]:
    """Decode the JSON value at the start of ``text`` (after whitespace); return it and the rest.

    Raises ``ValueError`` when there is no JSON value there.
    """
    stripped = text.lstrip()
    obj, end = _DECODER.raw_decode(stripped)
    return obj, stripped[end:]


def _decode_sequence(text: str, separators: str = ",;") -> tuple[list[Any], str]:
    """Decode consecutive JSON values separated by whitespace or ``separators``.

    Returns the values and the undecoded rest. Raises ``ValueError`` if the first value is bad.
    """
    values: list[Any] = []
    rest = text
    while True:
        obj, rest = _decode_prefix(rest)
        values.append(obj)
        probe = rest.lstrip()
        while probe[:1] and probe[0] in separators:
            probe = probe[1:].lstrip()
        if probe[:1] in ("{", "["):
            rest = probe
            continue
        return values, rest


def normalize_arguments(args: Any) -> str | None:
    """Arguments as a JSON object string, or None if they are not a JSON object.

    Accepts a dict, a JSON string holding an object, or None/"" (no arguments → ``"{}"``).
    """
    if args is None or args == "":
        return "{}"
    if isinstance(args, str):
        try:
            args = json.loads(_strip_fences(args))
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return json.dumps(args, ensure_ascii=False)


def _normalize_call(obj: Any) -> dict[str, str] | None:
    """One call object → ``{"name", "arguments"}``; None if it is not a valid call.

    Tolerates ``parameters`` instead of ``arguments`` (Llama) and the OpenAI wrapper
    ``{"type": "function", "function": {...}}``.
    """
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict) and "name" not in obj:
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    raw = obj.get("arguments", obj.get("parameters"))
    arguments = normalize_arguments(raw)
    if arguments is None:
        return None
    return {"name": name.strip(), "arguments": arguments}


def _calls_from_values(values: list[Any]) -> list[dict[str, str]] | None:
    """Flatten decoded JSON values (objects or lists of objects) into calls; None on any bad one."""
    calls: list[dict[str, str]] = []
    for value in values:
        items = value if isinstance(value, list) else [value]
        if not items:
            return None
        for item in items:
            call = _normalize_call(item)
            if call is None:
                return None
            calls.append(call)
    return calls


def _as_object(arguments: Any) -> Any:
    """Arguments (JSON string or dict) as a Python object for re-serialisation in prompts."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments if arguments is not None else {}


@dataclass
class Salvage:
    """What can be recovered from tool-call markup that did not parse (see ``ToolParser.salvage``).

    ``content``: the text with every piece of call markup removed (None when nothing is left).
    ``calls``: ``{"name", "arguments"}`` for each call whose name could be read; ``arguments`` is
    the model's own text (normalised JSON when it happens to be a valid object, else verbatim,
    possibly invalid JSON, possibly empty), as OpenAI's contract allows.
    ``raw_arguments``: the first arguments text found even without a readable name (used when
    the request forced a call).
    """

    content: str | None
    calls: list[dict[str, str]] = field(default_factory=list)
    raw_arguments: str | None = None


_NAME_RE = re.compile(r'"name"\s*:\s*"((?:[^"\\\n]|\\.){1,256})"')
_ARGS_KEY_RE = re.compile(r'"(?:arguments|parameters)"\s*:')
_CLOSERS = {"{": "}", "[": "]"}


def _balanced_end(text: str) -> int | None:
    """Index just past the JSON-ish value opening ``text[0]`` (string-aware), None if unclosed.

    Used on text that did NOT parse as JSON, so it only tracks brackets and string quotes.
    """
    if not text:
        return None
    if text[0] == '"':
        i = 1
        while i < len(text):
            if text[i] == "\\":
                i += 2
                continue
            if text[i] == '"':
                return i + 1
            i += 1
        return None
    stack = [_CLOSERS[text[0]]]
    in_str = False
    i = 1
    while i < len(text):
        ch = text[i]
        if in_str:
            if ch == "\\":
                i += 1
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in _CLOSERS:
            stack.append(_CLOSERS[ch])
        elif ch in "}]":
            if ch != stack[-1]:
                return None
            stack.pop()
            if not stack:
                return i + 1
        i += 1
    return None


def raw_argument_text(segment: str, wrapper_closers: str = "}]") -> str:
    """The model's arguments text at the start of ``segment`` (what follows ``"arguments":``).

    A balanced ``{...}``/``[...]``/``"..."`` value is taken as written (even if it is not valid
    JSON inside); otherwise the rest of the segment, minus the closers of the call wrapper.
    """
    seg = segment.strip()
    if seg[:1] in ("{", "[", '"'):
        end = _balanced_end(seg)
        if end is not None:
            return seg[:end]
        return seg
    return seg.rstrip(wrapper_closers + " \n\t,")


def _name_text(raw: str) -> str:
    try:
        name = json.loads(f'"{raw}"')
    except ValueError:
        name = raw
    return name.strip() if isinstance(name, str) else ""


def _recovered_arguments(raw: str) -> str:
    """Normalised JSON if ``raw`` is a valid object, else the raw text itself."""
    normalized = normalize_arguments(raw) if raw else None
    return normalized if normalized is not None else raw


def salvage_region(region: str, content: str | None) -> Salvage:
    """Read call names and raw arguments out of markup ``region`` by pattern, not by parsing."""
    calls: list[dict[str, str]] = []
    names = list(_NAME_RE.finditer(region))
    first_args: str | None = None
    for i, m in enumerate(names):
        stop = names[i + 1].start() if i + 1 < len(names) else len(region)
        seg = region[m.end() : stop]
        key = _ARGS_KEY_RE.search(seg)
        raw = raw_argument_text(seg[key.end() :]) if key else ""
        if first_args is None and key:
            first_args = raw
        name = _name_text(m.group(1))
        if name:
            calls.append({"name": name, "arguments": _recovered_arguments(raw)})
    if first_args is None:
        key = _ARGS_KEY_RE.search(region)
        if key:
            first_args = raw_argument_text(region[key.end() :])
    return Salvage(
        content=(content.strip() or None) if content else None,
        calls=calls,
        raw_arguments=first_args,
    )


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

    def parse(self, text: str) -> ParseResult:
        """Split ``text`` into content and calls; never raises."""
        return _plain(text)

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


class HermesParser(ToolParser):
    """``<tool_call>`` tags holding a JSON object or a JSON list of objects.

    Formats calls in the list form (``<tool_call>[{...}, ...]</tool_call>``): that is the form in
    SmolLM2's model card, and the one it follows with a worked example (shared/FACTS.md).
    """

    name = "hermes"
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
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
            body = _strip_fences(block.strip()).strip()
            try:
                values, _rest = _decode_sequence(body)
            except ValueError:
                return text, [], True
            parsed = _calls_from_values(values)
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
        items = [{"name": c["name"], "arguments": _as_object(c.get("arguments"))} for c in calls]
        return f"<tool_call>{json.dumps(items, ensure_ascii=False)}</tool_call>"

    def prefill(self, name: str | None) -> str:
        if name:
            return f'<tool_call>[{{"name": {json.dumps(name)}, "arguments":'
        return '<tool_call>[{"name": "'


class QwenParser(HermesParser):
    """Like hermes, but formats one JSON object per ``<tool_call>`` tag (Qwen2.5/Hermes-2 style)."""

    name = "qwen"
    call_format_hint = (
        '<tool_call>\n{"name": "func_name1", "arguments": {"argument1": "value1"}}\n</tool_call>'
    )

    def format_calls(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(
            "<tool_call>\n"
            + json.dumps(
                {"name": c["name"], "arguments": _as_object(c.get("arguments"))},
                ensure_ascii=False,
            )
            + "\n</tool_call>"
            for c in calls
        )

    def prefill(self, name: str | None) -> str:
        if name:
            return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments":'
        return '<tool_call>\n{"name": "'


class Llama3Parser(ToolParser):
    """Bare JSON ``{"name": ..., "parameters"|"arguments": ...}``, maybe after ``<|python_tag|>``.

    Several calls may be separated by ``;``. Text that merely starts with a JSON value without a
    ``name`` is ordinary content (a model may answer in JSON), not a failed call.
    """

    name = "llama3"
    python_tag = "<|python_tag|>"
    call_format_hint = '{"name": "func_name1", "parameters": {"argument1": "value1"}}'
    _looks_like_call = re.compile(r'^\s*[\[{]\s*\{?\s*"(name|function)"\s*:')

    def parse(self, text: str) -> ParseResult:
        tagged = self.python_tag in text
        before, body = text.split(self.python_tag, 1) if tagged else ("", text)
        body = _strip_fences(body.strip()).strip()
        if not body.startswith(("{", "[")):
            return (text, [], True) if tagged else _plain(text)
        try:
            values, rest = _decode_sequence(body)
        except ValueError:
            if tagged or self._looks_like_call.match(body):
                return text, [], True
            return _plain(text)
        calls = _calls_from_values(values)
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
        if self._looks_like_call.match(_strip_fences(text.strip()).strip()):
            return "", text
        return text, ""

    def format_calls(self, calls: list[dict[str, Any]]) -> str:
        return "; ".join(
            json.dumps(
                {"name": c["name"], "parameters": _as_object(c.get("arguments"))},
                ensure_ascii=False,
            )
            for c in calls
        )

    def prefill(self, name: str | None) -> str:
        if name:
            return f'{{"name": {json.dumps(name)}, "parameters":'
        return '{"name": "'


class MistralParser(ToolParser):
    """``[TOOL_CALLS]`` followed by a JSON list (v3) or by ``name[ARGS]{...}`` (v11+)."""

    name = "mistral"
    marker = "[TOOL_CALLS]"
    call_format_hint = '[TOOL_CALLS][{"name": "func_name1", "arguments": {"argument1": "value1"}}]'
    _args_re = re.compile(r"^\s*([^\[\]{}\s]+)\s*(?:\[CALL_ID\]\s*\S+?\s*)?\[ARGS\]", re.DOTALL)

    def parse(self, text: str) -> ParseResult:
        if self.marker not in text:
            return _plain(text)
        before, *segments = text.split(self.marker)
        calls: list[dict[str, str]] = []
        trailing: list[str] = []
        for seg in segments:
            body = _strip_fences(seg.strip()).strip()
            if body.startswith(("[", "{")):
                try:
                    values, rest = _decode_sequence(body)
                except ValueError:
                    return text, [], True
                parsed = _calls_from_values(values)
            else:
                m = self._args_re.match(body)
                if not m:
                    return text, [], True
                try:
                    args, rest = _decode_prefix(body[m.end() :])
                except ValueError:
                    return text, [], True
                parsed = _calls_from_values([{"name": m.group(1), "arguments": args}])
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
                found.calls.append({"name": m.group(1), "arguments": _recovered_arguments(raw)})
                if found.raw_arguments is None:
                    found.raw_arguments = raw
        return found

    def format_calls(self, calls: list[dict[str, Any]]) -> str:
        items = [{"name": c["name"], "arguments": _as_object(c.get("arguments"))} for c in calls]
        return self.marker + json.dumps(items, ensure_ascii=False)

    def prefill(self, name: str | None) -> str:
        if name:
            return f'{self.marker}[{{"name": {json.dumps(name)}, "arguments":'
        return f'{self.marker}[{{"name": "'


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
