"""The one interface every tool environment implements, and what its callers share.

Two families implement ``ToolEnvironment``: aenvironment servers (``AenvEnvironmentAdapter``:
MCP tools plus an HTTP reward endpoint and a control plane that creates instances) and any MCP
server (``McpEnvironmentAdapter``: stdio or streamable HTTP; the reward comes from a user
``reward_fn``). Agents only see this protocol, so one agent trains on either family.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

# Tool output is cut by characters: agents have no tokenizer, and about 4 characters per token
# is the usual estimate for English text under BPE vocabularies (code and JSON run lower).
CHARS_PER_TOKEN = 4
TRUNCATION_MARKER = "\n[... tool output truncated: {dropped} of {total} characters omitted ...]"


def _failed(what: str, where: str, attempts: int, cause: BaseException) -> str:
    return f"{what} on {where} failed after {attempts} attempt(s): {type(cause).__name__}: {cause}"


class EnvError(RuntimeError):
    """Base class of every environment adapter error."""

    rejection_reason = "env_error"
    """The reason the training workflow counts when this error rejects an episode."""


class EnvUnavailableError(EnvError):
    """The environment could not be opened, or could not be reached after the safe retries."""

    rejection_reason = "env_unavailable"


class EnvToolCallError(EnvError):
    """A tool call failed in transport (not a tool error result): names tool, attempts, cause."""

    rejection_reason = "env_tool_transport"

    def __init__(self, tool_name: str, attempts: int, cause: BaseException, where: str):
        self.tool_name, self.attempts, self.cause = tool_name, attempts, cause
        super().__init__(_failed(f"tool {tool_name!r}", where, attempts, cause))


class EnvServerDiedError(EnvToolCallError):
    """The server died while a call was in flight: the call may have run, so it is not retried
    and the episode is rejected; the next episode gets a new server."""

    rejection_reason = "env_server_died"


class EnvCallError(EnvError):
    """A reward or function call failed (after the safe retries)."""

    rejection_reason = "env_reward_error"

    def __init__(self, what: str, attempts: int, cause: BaseException, where: str):
        self.what, self.attempts, self.cause = what, attempts, cause
        super().__init__(_failed(what, where, attempts, cause))


@dataclass
class ToolCallResult:
    """What a tool returned. ``is_error`` = the tool ran (or was refused) and reported an error.

    ``text`` is what the model sees (truncated, non-text parts as placeholders); ``content`` the
    MCP content blocks as plain dicts, untouched, for reward functions.
    """

    text: str
    is_error: bool = False
    content: list[dict[str, Any]] = field(default_factory=list)
    truncated: bool = False


@runtime_checkable
class ToolEnvironment(Protocol):
    """One environment for one episode: open it, list and call tools, get the reward, release.

    ``async with env:`` opens and always releases. Implementations retry only where the call
    cannot have run (connection refused, 502/503/504, a restarted server that did not know the
    session) and raise ``EnvToolCallError`` otherwise; a tool that ran and failed is a
    ``ToolCallResult(is_error=True)``, not an exception.
    """

    @property
    def where(self) -> str: ...

    @property
    def tool_error_policy(self) -> str: ...

    async def __aenter__(self) -> ToolEnvironment: ...

    async def __aexit__(self, *exc: Any) -> None: ...

    async def initialize(self) -> None: ...

    async def release(self) -> None: ...

    async def list_tools(self) -> list[dict[str, Any]]:
        """MCP tool descriptions: ``name``, ``description``, ``inputSchema``."""
        ...

    async def openai_tools(self) -> tuple[list[dict[str, Any]], dict[str, str]]:
        """OpenAI function tools and ``{openai_name: environment_name}``."""
        ...

    async def call_tool(
        self, name: str, arguments: dict[str, Any] | None = None, *, timeout: float | None = None
    ) -> ToolCallResult: ...

    @property
    def has_reward(self) -> bool:
        """True when the environment computes the reward itself (``call_reward``)."""
        ...

    async def call_reward(self, arguments: dict[str, Any]) -> Any: ...


def reward_value(result: Any) -> float:
    """A float from a reward function's result: a number, or a dict with ``reward``/``score``."""
    if isinstance(result, bool):
        return float(result)
    if isinstance(result, (int, float)):
        return float(result)
    if isinstance(result, str):
        return float(result.strip())
    if isinstance(result, dict):
        for key in ("reward", "score", "value"):
            if key in result:
                return reward_value(result[key])
    raise ValueError(f"cannot read a reward from {result!r} (expected a number or {{'reward': x}})")


def _placeholder(block: dict[str, Any]) -> str:
    kind = block.get("type", "content")
    mime = block.get("mimeType") or block.get("mime_type")
    if kind in ("image", "audio"):
        data = block.get("data") or ""
        try:
            size = len(base64.b64decode(data, validate=False))
        except (ValueError, TypeError):
            size = len(data)
        return f"[{kind} content: {mime or 'unknown type'}, {size} bytes, not shown]"
    if kind == "resource":
        res = block.get("resource") or {}
        uri = res.get("uri", "?")
        if isinstance(res.get("text"), str):
            return f"[resource {uri}]\n{res['text']}"
        return f"[resource {uri}: {res.get('mimeType') or res.get('mime_type') or 'binary'}]"
    if kind == "resource_link":
        return f"[resource link {block.get('uri', '?')}: {block.get('name', '')}]".strip()
    return json.dumps(block, ensure_ascii=False, default=str)


def render_tool_output(
    content: list[dict[str, Any]],
    *,
    max_tokens: int | None,
    images: bool = False,
) -> tuple[str, bool]:
    """The text the model sees for MCP content blocks, and whether it was truncated.

    Text blocks are joined by newlines; images, audio and binary resources become a short
    placeholder (an image stays a data-URL line when ``images``: for models that take images).
    The result is cut to about ``max_tokens`` tokens with a marker saying how much was dropped,
    so that one long result cannot push the next request past the context length.
    """
    parts = []
    for block in content:
        if not isinstance(block, dict):
            parts.append(str(block))
        elif block.get("type") == "text" and "text" in block:
            parts.append(str(block["text"]))
        elif images and block.get("type") == "image":
            parts.append(f"data:{block.get('mimeType') or 'image/png'};base64,{block.get('data')}")
        else:
            parts.append(_placeholder(block))
    text = "\n".join(parts)
    if max_tokens is None:
        return text, False
    limit = max_tokens * CHARS_PER_TOKEN
    if len(text) <= limit:
        return text, False
    total = len(text)
    return text[:limit] + TRUNCATION_MARKER.format(dropped=total - limit, total=total), True


TOOL_ERROR_POLICIES = ("append_error", "raise")


def check_common_options(cfg: Any, bad: Callable[[str, str], Exception]) -> None:
    """Validation shared by both environment configs (timeouts, the retry policy, the
    tool-error policy, tool output); ``bad(field, why)`` builds the error to raise."""
    for name in ("timeout", "startup_timeout", "tool_call_timeout"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise bad(name, "expected a number of seconds > 0")
    retries = cfg.max_retries
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise bad("max_retries", "expected an integer >= 0")
    delay = cfg.retry_delay
    if isinstance(delay, bool) or not isinstance(delay, (int, float)) or delay < 0:
        raise bad("retry_delay", "expected a number of seconds >= 0")
    if cfg.tool_error_policy not in TOOL_ERROR_POLICIES:
        raise bad("tool_error_policy", f"valid values: {', '.join(TOOL_ERROR_POLICIES)}")
    limit = cfg.max_tool_output_tokens
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise bad("max_tool_output_tokens", "expected an integer >= 1, or null for no limit")
    if not isinstance(cfg.tool_images, bool):
        raise bad("tool_images", "expected true/false")
