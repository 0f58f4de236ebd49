"""Any MCP server as a tool environment: its config and adapter (stdio or streamable HTTP)."""
