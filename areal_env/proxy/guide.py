"""Guided episodes: a session that carries a reference solution.

RL reinforces what the policy samples. A step the model almost never takes (the second call of a
tool chain: about 1e-7 per episode for the demo's model, ``bench/chain_probe.py``) is never
found by sampling, so it is never learned. A *guided* session carries what a verified solution
does (``/rl/start_session`` ``guide``: its tool calls ``{"name", "arguments"}`` in order,
optionally ending with the final answer ``{"content"}``). While the calls the conversation has
made so far are the guide's first ones, each sampled reply that may take the guide's next step
is made to start with it: its tokens are written by the engine as a constrained start, each
reporting the model's own logprob, so the trainer treats them as the policy's sample (an
off-policy, deliberately biased one, like an explored tool choice), and the row is marked
explored: a guided episode that did not pay is not pushed down. Past the guide the model replies
on its own. Greedy completions (evaluation) are never guided, and a conversation that left the
guide (another call, a changed argument) runs free from there.

This module has one job: check a guide, and say which of its steps comes next.
"""

from __future__ import annotations

import json
from typing import Any

#: Most steps one guide may hold (a bound on what a request body can make the proxy keep).
MAX_GUIDE_STEPS = 64


def validate_guide(value: Any) -> list[dict[str, Any]] | None:
    """A session's ``guide`` (``ValueError`` naming what is wrong): a list of tool calls
    ``{"name": str, "arguments": object}``, optionally ending with the final answer
    ``{"content": str}``; None or an empty list is no guide."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise ValueError(
            '\'guide\' must be a list of tool calls {"name", "arguments"}, optionally ending '
            'with the answer {"content"}'
        )
    if len(value) > MAX_GUIDE_STEPS:
        raise ValueError(f"'guide' holds {len(value)} steps; at most {MAX_GUIDE_STEPS}")
    out: list[dict[str, Any]] = []
    for i, step in enumerate(value):
        if isinstance(step, dict) and set(step) == {"content"}:
            if i != len(value) - 1:
                raise ValueError(f"'guide[{i}]': the answer {{\"content\"}} must be the last step")
            if not isinstance(step["content"], str) or not step["content"]:
                raise ValueError(f"'guide[{i}].content' must be a non-empty string")
            out.append({"content": step["content"]})
            continue
        if not isinstance(step, dict) or set(step) != {"name", "arguments"}:
            raise ValueError(
                f"'guide[{i}]' must be a tool call with exactly 'name' and 'arguments', or the "
                "final answer with exactly 'content'"
            )
        name, arguments = step["name"], step["arguments"]
        if not isinstance(name, str) or not name:
            raise ValueError(f"'guide[{i}].name' must be a non-empty string")
        if not isinstance(arguments, dict):
            raise ValueError(f"'guide[{i}].arguments' must be an object")
        out.append({"name": name, "arguments": arguments})
    return out or None


def _calls_made(messages: list[dict[str, Any]]) -> list[tuple[Any, Any]]:
    """The ``(name, arguments)`` of every tool call the assistant made in ``messages``, in
    order; arguments given as JSON text are parsed (unreadable text stays text)."""
    made: list[tuple[Any, Any]] = []
    for message in messages:
        if message.get("role") != "assistant":
            continue
        for call in message.get("tool_calls") or []:
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict):
                made.append((None, None))
                continue
            arguments = fn.get("arguments")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    pass
            made.append((fn.get("name"), arguments))
    return made


def next_guided_step(
    guide: list[dict[str, Any]] | None, messages: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """The guide's step the next reply should take (a call, or the final ``content``): the one
    after the calls ``messages`` already hold, if those are the guide's first calls in order
    and no answer was given since the last of them; else None (the guide is done, or the
    conversation left it)."""
    if not guide:
        return None
    made = _calls_made(messages)
    if len(made) >= len(guide):
        return None
    for (name, arguments), step in zip(made, guide, strict=False):
        if name != step.get("name") or arguments != step.get("arguments"):
            return None
    last = next((m for m in reversed(messages) if m.get("role") == "assistant"), None)
    if last is not None and not last.get("tool_calls"):
        return None  # the conversation already answered after its calls
    return guide[len(made)]
