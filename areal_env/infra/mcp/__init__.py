"""Any MCP server (stdio command or streamable-HTTP URL) as a training environment."""

from areal_env.infra.mcp.adapter import McpEnvironmentAdapter, StdioServerPool
from areal_env.infra.mcp.config import McpConfig, McpConfigError

__all__ = ["McpConfig", "McpConfigError", "McpEnvironmentAdapter", "StdioServerPool"]
