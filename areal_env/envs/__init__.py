"""Tool environments behind one ``ToolEnvironment`` protocol (``envs.base``): aenvironment
servers (``envs.aenv``) and any MCP server (``envs.mcp``); ``envs.agent.AenvAgent`` runs a
multi-turn tool loop on either through the proxy."""
