"""The JSON side of tool calls: decoding model text leniently, normalising calls and their
arguments, and salvaging what can be read from markup that did not parse.

Shared by every parser family in :mod:`areal_env.proxy.tool_parsers`.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any

_FENCE_RE = re.compile(r"^\s*```[a-zA-Z0-9_-]*\s*\n?(.*?)\n?\s*```\s*$", re.DOTALL)
_DECODER = json.JSONDecoder()


def strip_fences(text: str) -> str:
    """Remove a surrounding markdown code fence (```json ... ```), if any."""
    m = _FENCE_RE.match(text)
    return m.group(1) if m else text


def decode_prefix(text: str) -> tuple[Any, str]:
    """Decode the JSON value at the start of ``text`` (after whitespace); return it and the rest.

    Raises ``ValueError`` when there is no JSON value there.
    """
    stripped = text.lstrip()
    obj, end = _DECODER.raw_decode(stripped)
    return obj, stripped[end:]


def decode_sequence(text: str, separators: str = ",;") -> tuple[list[Any], str]:
    """Decode consecutive JSON values separated by whitespace or ``separators``.

    Returns the values and the undecoded rest. Raises ``ValueError`` if the first value is bad.
    """
    values: list[Any] = []
    rest = text
    while True:
        obj, rest = decode_prefix(rest)
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
            args = json.loads(strip_fences(args))
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return json.dumps(args, ensure_ascii=False)


@functools.lru_cache(maxsize=4096)
def normalize_arguments_text(raw: str) -> str | None:
    """``normalize_arguments`` of a string, cached: histories repeat the same calls each turn."""
    return normalize_arguments(raw)


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


def calls_from_values(values: list[Any]) -> list[dict[str, str]] | None:
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


def as_object(arguments: Any) -> Any:
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


def recovered_arguments(raw: str) -> str:
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
            calls.append({"name": name, "arguments": recovered_arguments(raw)})
    if first_args is None:
        key = _ARGS_KEY_RE.search(region)
        if key:
            first_args = raw_argument_text(region[key.end() :])
    return Salvage(
        content=(content.strip() or None) if content else None,
        calls=calls,
        raw_arguments=first_args,
    )
