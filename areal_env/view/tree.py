"""A session's dump lines -> its conversation tree, as the page draws it.

Each completion is a node: what it added to its parent's conversation (the new messages: tool
results, user turns; or, in dumps without them, the new part of the rendered prompt), what the
model produced (text and parsed tool calls), its reward, why it stopped, and whether it was
spliced onto its parent's exact tokens. Children of one parent are branches (parallel tool calls,
sub-agents, retries).
"""

from __future__ import annotations

import json
import re
from typing import Any

_TOOL_CALL_MARKUP = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _parsed_tool_calls(output: Any, completion: str | None) -> list[dict[str, Any]]:
    """``[{name, arguments}]`` from the assistant message, or from the raw markup in the text
    (older dumps kept only the text)."""
    calls = (output or {}).get("tool_calls") if isinstance(output, dict) else None
    if calls:
        out = []
        for c in calls:
            fn = c.get("function") or {} if isinstance(c, dict) else {}
            out.append({"name": fn.get("name"), "arguments": fn.get("arguments")})
        return out
    out = []
    for m in _TOOL_CALL_MARKUP.finditer(completion or ""):
        body = m.group(1).strip()
        try:
            value = json.loads(body)
        except ValueError:
            out.append({"name": None, "arguments": body, "unparsed": True})
            continue
        for c in value if isinstance(value, list) else [value]:
            if isinstance(c, dict):
                out.append({"name": c.get("name"), "arguments": c.get("arguments")})
    return out


def _interaction_fields(line: dict[str, Any]) -> dict[str, Any]:
    """A workflow dump line or an external session's interaction summary, in one shape."""
    return {
        "id": line.get("interaction_id") or line.get("id"),
        "parent_id": line.get("parent_id"),
        "prompt": line.get("prompt") if "prompt" in line else line.get("prompt_text"),
        "completion": line.get("completion")
        if "completion" in line
        else line.get("completion_text"),
        "reward": line.get("reward"),
        "stop_reason": line.get("stop_reason"),
        "prompt_len": line.get("prompt_len", line.get("num_prompt_tokens")),
        "completion_len": line.get("completion_len", line.get("num_output_tokens")),
        "versions": line.get("versions"),
        "spliced": line.get("spliced"),
        "messages": line.get("messages"),
        "output": line.get("output", line.get("output_message")),
        "tool_calls": line.get("tool_calls"),
        "valid_tool_calls": line.get("valid_tool_calls"),
        "tool_parse_error": line.get("tool_parse_error"),
    }


def build_tree(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The nodes of one session, parents before children, each with its ``children`` ids and
    ``depth``. Lines without a completion (a rejected episode) give no node."""
    items: list[dict[str, Any]] = []
    for line in lines:
        if "interactions" in line and "interaction_id" not in line:
            items += [_interaction_fields(it) for it in line.get("interactions") or []]
        elif line.get("interaction_id"):
            items.append(_interaction_fields(line))
    by_id: dict[str, dict[str, Any]] = {}
    nodes: list[dict[str, Any]] = []
    for it in items:
        if not it["id"] or it["id"] in by_id:
            continue
        parent = by_id.get(it["parent_id"]) if it["parent_id"] else None
        prompt = it["prompt"] or ""
        spliced = it["spliced"]
        new_text = prompt
        if parent is not None:
            head = (parent["prompt"] or "") + (parent["completion"] or "")
            starts = bool(head) and prompt.startswith(head)
            if spliced is None:
                spliced = starts
            if starts:
                new_text = prompt[len(head) :]
        names = it["tool_calls"] if isinstance(it["tool_calls"], list) else []
        valid = it["valid_tool_calls"]
        failed = (len(names) - int(valid) if isinstance(valid, int) else 0) + bool(
            it["tool_parse_error"]
        )
        node = {
            **it,
            "parent_id": parent["id"] if parent is not None else None,
            "orphan_parent": it["parent_id"] if parent is None and it["parent_id"] else None,
            "spliced": bool(spliced) if parent is not None else None,
            "new_prompt": new_text,
            "calls": _parsed_tool_calls(it["output"], it["completion"]),
            "failed_tool_calls": max(0, failed),
            "children": [],
            "depth": parent["depth"] + 1 if parent is not None else 0,
        }
        by_id[node["id"]] = node
        nodes.append(node)
        if parent is not None:
            parent["children"].append(node["id"])
    return nodes


def rows_through(nodes: list[dict[str, Any]], row_ids: list[str]) -> dict[str, list[str]]:
    """For each node, the token rows whose tokens contain its output: the row ending at it
    (one row per completion) and the rows of its spliced descendants (one row per chain)."""
    by_id = {n["id"]: n for n in nodes}
    rows = set(row_ids)
    out: dict[str, list[str]] = {n["id"]: [] for n in nodes}
    for rid in row_ids:
        node = by_id.get(rid)
        while node is not None:
            out[node["id"]].append(rid)
            if not node.get("spliced"):
                break
            node = by_id.get(node.get("parent_id"))
            if node is not None and node["id"] in rows:
                break  # that completion has a row of its own (one row per completion)
    return out
