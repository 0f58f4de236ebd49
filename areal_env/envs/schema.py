"""MCP tool descriptions → OpenAI function tools, and tool-call argument parsing.

The aenvironment SDK lists tools as ``env@1.0.0/add``; OpenAI-compatible APIs accept only
``^[a-zA-Z0-9_-]{1,64}$``. ``normalize_openai_tools`` gives every tool a valid name (the bare
tool name when it is unambiguous: short names are also easier for small models) and returns the
map back to the environment's own names. The result depends only on the *set* of tools, not on
their order, so the same environment always yields the same names.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections import defaultdict
from typing import Any

VALID_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_INVALID_CHARS = re.compile(r"[^a-zA-Z0-9_-]+")
MAX_NAME_LEN = 64


class ToolArgumentsError(ValueError):
    """Tool-call arguments are not a JSON object; the message is meant for the model to read."""


def empty_object_schema() -> dict[str, Any]:
    return {"type": "object", "properties": {}}


def sanitize_tool_name(name: str) -> str:
    """Replace characters OpenAI rejects by ``_`` and cut to 64 characters ("tool" if empty)."""
    out = _INVALID_CHARS.sub("_", name).strip("_") or "tool"
    return out[:MAX_NAME_LEN]


def _with_hash(candidate: str, original: str) -> str:
    digest = hashlib.sha1(original.encode("utf-8")).hexdigest()[:8]
    return f"{candidate[: MAX_NAME_LEN - 9]}_{digest}"


def _bare(name: str) -> str:
    return name.rsplit("/", 1)[-1]


def _schema(tool: dict[str, Any]) -> dict[str, Any]:
    schema = tool.get("inputSchema", tool.get("input_schema", tool.get("parameters")))
    if not isinstance(schema, dict) or not schema:
        return empty_object_schema()
    schema = copy.deepcopy(schema)
    if schema.get("type") is None:
        schema["type"] = "object"
    if schema.get("type") == "object" and not isinstance(schema.get("properties"), dict):
        schema["properties"] = {}
    return schema


def normalize_openai_tools(
    mcp_tools: list[dict[str, Any]], *, strip_prefix: bool = True
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Convert MCP tool descriptions to OpenAI function tools.

    Returns ``(tools, name_map)`` where ``name_map[openai_name] == original_name``.

    Naming: the bare tool name (after the last ``/``) when ``strip_prefix`` and no other tool
    shares it, else the whole name; invalid characters become ``_``, and names are cut to 64
    characters. Names that still collide all get a suffix made from a hash of the original name,
    which keeps the outcome independent of the order of ``mcp_tools``.
    """
    originals: list[str] = []
    by_name: dict[str, dict[str, Any]] = {}
    for tool in mcp_tools:
        name = tool.get("name") if isinstance(tool, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"MCP tool without a name: {tool!r}")
        if name in by_name:
            raise ValueError(f"duplicate MCP tool name {name!r}")
        by_name[name] = tool
        originals.append(name)

    bare_count: dict[str, int] = defaultdict(int)
    for name in originals:
        bare_count[sanitize_tool_name(_bare(name))] += 1

    candidates: dict[str, str] = {}
    for name in originals:
        bare = sanitize_tool_name(_bare(name))
        candidates[name] = (
            bare if strip_prefix and bare_count[bare] == 1 else sanitize_tool_name(name)
        )

    groups: dict[str, list[str]] = defaultdict(list)
    for name, cand in candidates.items():
        groups[cand].append(name)
    final: dict[str, str] = {}
    for cand, names in groups.items():
        for name in names:
            final[name] = _with_hash(cand, name) if len(names) > 1 else cand

    name_map: dict[str, str] = {}
    for name, new in final.items():
        if new in name_map:  # astronomically unlikely: a hash suffix equals another name
            raise ValueError(f"cannot give tools {name!r} and {name_map[new]!r} distinct names")
        name_map[new] = name

    tools = []
    for name in originals:  # keep the environment's order in the prompt
        tool = by_name[name]
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": final[name],
                    "description": str(tool.get("description") or ""),
                    "parameters": _schema(tool),
                },
            }
        )
    return tools, name_map


def parse_tool_arguments(raw: Any) -> dict[str, Any]:
    """Arguments of a tool call as a dict.

    Accepts a dict, a JSON string of an object, or None/empty (no arguments). Anything else
    raises ``ToolArgumentsError`` with a message the agent can show the model as the tool result.
    """
    if raw is None:
        return {}
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, (bytes, bytearray)):
        raw = raw.decode("utf-8", errors="replace")
    if not isinstance(raw, str):
        raise ToolArgumentsError(f"tool arguments must be a JSON object, got {type(raw).__name__}")
    text = raw.strip()
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        shown = text if len(text) <= 200 else text[:200] + "..."
        raise ToolArgumentsError(
            f"tool arguments are not valid JSON ({e.msg} at position {e.pos}): {shown}"
        ) from None
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ToolArgumentsError(
            f"tool arguments must be a JSON object, got {type(value).__name__}: {text[:200]}"
        )
    return value
