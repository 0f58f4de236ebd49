"""Tool environments behind one ``ToolEnvironment`` protocol (``base``): aenvironment servers
(``infra.aenv``) and any MCP server (``infra.mcp``)."""

from areal_env.infra.base import (
    EnvCallError,
    EnvError,
    EnvServerDiedError,
    EnvToolCallError,
    EnvUnavailableError,
    ToolCallResult,
    ToolEnvironment,
    render_tool_output,
    reward_value,
)

__all__ = [
    "EnvCallError",
    "EnvError",
    "EnvServerDiedError",
    "EnvToolCallError",
    "EnvUnavailableError",
    "ToolCallResult",
    "ToolEnvironment",
    "render_tool_output",
    "reward_value",
]
