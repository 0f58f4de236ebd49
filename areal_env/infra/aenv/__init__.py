"""AEnvironment integration: config, the wire-protocol adapter, tool schemas, server launcher."""

from areal_env.infra.aenv.adapter import (
    AenvCallError,
    AenvEnvironmentAdapter,
    AenvError,
    AenvToolCallError,
    AenvUnavailableError,
    ToolCallResult,
    reward_value,
)
from areal_env.infra.aenv.config import AenvConfig, AenvConfigError, redact_url
from areal_env.infra.schema import (
    ToolArgumentsError,
    normalize_openai_tools,
    parse_tool_arguments,
    sanitize_tool_name,
)

__all__ = [
    "AenvCallError",
    "AenvConfig",
    "AenvConfigError",
    "AenvEnvironmentAdapter",
    "AenvError",
    "AenvToolCallError",
    "AenvUnavailableError",
    "ToolArgumentsError",
    "ToolCallResult",
    "normalize_openai_tools",
    "parse_tool_arguments",
    "redact_url",
    "reward_value",
    "sanitize_tool_name",
]
