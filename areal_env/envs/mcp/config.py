"""``McpConfig``: which MCP server an episode uses, how it is isolated, how hard to try.

Every value is checked at construction, so a typo in a YAML file fails before any episode runs
with a message that names the field; ``from_dict`` refuses unknown keys for the same reason.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from areal_env.api.records import field_dict, strict_from_dict
from areal_env.envs.aenv.config import redact_url
from areal_env.envs.base import check_common_options

TRANSPORTS = ("stdio", "http")
ISOLATION = ("episode", "pool")


class McpConfigError(ValueError):
    """An ``McpConfig`` value is invalid; the message names the field."""


@dataclass
class McpConfig:
    """An MCP server as a training environment (stdio command or streamable-HTTP URL)."""

    command: str | None = None
    """stdio: the executable that serves MCP on stdin/stdout, run as given: a name on ``PATH``
    (else beside areal-env's interpreter), a path such as the server's own venv
    (``.venv-sqlite/bin/mcp-server-sqlite``; in a config file, relative to the file), or a
    launcher (``uvx`` with ``args: [mcp-server-sqlite, ...]``). A server whose SDK pins clash
    with areal-env's runs from its own venv this way. ``python`` is areal-env's interpreter."""
    args: list[str] = field(default_factory=list)
    """stdio: its arguments (e.g. ``["--db-path", "shop.db"]``)."""
    env: dict[str, str] = field(default_factory=dict)
    """stdio: extra environment variables for the server process. Never logged."""
    cwd: str | None = None
    """stdio: working directory of the server process (from a config file: the file's folder
    unless set, so relative paths in ``args`` are relative to the config too)."""
    url: str | None = None
    """http: the streamable-HTTP endpoint, e.g. ``http://127.0.0.1:8000/mcp``."""
    urls: list[str] = field(default_factory=list)
    """http: several servers of the same kind; each episode uses the least busy one."""
    headers: dict[str, str] = field(default_factory=dict)
    """http: request headers, e.g. ``{"Authorization": "Bearer ..."}``. Never logged."""
    isolation: Literal["episode", "pool"] = "episode"
    """stdio: ``episode`` = a fresh server process per episode (stateful servers, the default);
    ``pool`` = up to ``pool_size`` long-lived processes, one episode at a time each (stateless
    servers with a slow start). A process that dies is replaced either way. http: every episode
    opens its own MCP session."""
    pool_size: int = 4
    """Most server processes kept for ``isolation: pool`` (per event loop)."""
    tools: list[str] | None = None
    """Only these of the server's tools are offered to the model (null = all)."""
    timeout: float = 30.0
    """Per-request timeout for the handshake and tool listing (seconds)."""
    startup_timeout: float = 60.0
    """How long opening the session (spawning the server, handshake) may take (seconds)."""
    tool_call_timeout: float = 30.0
    """Upper bound for one tool call (seconds); a timed-out call is not retried."""
    max_retries: int = 2
    """Retries after the first attempt, only where the call provably did not run (http)."""
    retry_delay: float = 0.5
    """Initial backoff (seconds); doubles per retry, with jitter."""
    tool_error_policy: Literal["append_error", "raise"] = "append_error"
    """What an agent does with a tool that reports an error: show it to the model as the tool
    message (append_error) or abort the episode (raise)."""
    max_tool_output_tokens: int | None = 2048
    """Tool results longer than about this many tokens (4 characters each) are cut, with a
    marker saying how much was dropped; null = no limit."""
    tool_images: bool = False
    """Show image content to the model as data URLs; else a short placeholder text."""
    name: str = "mcp"
    """A label for logs and errors."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def transport(self) -> str:
        return "stdio" if self.command else "http"

    @property
    def all_urls(self) -> list[str]:
        return list(self.urls) or ([self.url] if self.url else [])

    def validate(self) -> None:
        def bad(name: str, why: str) -> McpConfigError:
            value = getattr(self, name)
            shown = "***" if name in ("env", "headers") else repr(value)
            if name in ("url", "urls"):
                shown = repr(
                    [redact_url(u) for u in value] if isinstance(value, list) else redact_url(value)
                )
            return McpConfigError(f"mcp.{name}={shown} is invalid: {why}")

        if self.command is not None and (not isinstance(self.command, str) or not self.command):
            raise bad("command", "expected the server's executable, e.g. 'mcp-server-time'")
        if not isinstance(self.urls, list) or not all(
            isinstance(u, str) and u.startswith(("http://", "https://")) for u in self.urls
        ):
            raise bad("urls", "expected a list of http(s) URLs")
        if self.url is not None and (
            not isinstance(self.url, str) or not self.url.startswith(("http://", "https://"))
        ):
            raise bad("url", "expected an http(s) URL such as 'http://127.0.0.1:8000/mcp'")
        if self.command and (self.url or self.urls):
            raise bad("url", "set either command (stdio) or url/urls (http), not both")
        if not self.command and not (self.url or self.urls):
            raise bad(
                "command",
                "set command (a stdio server to spawn) or url (a streamable-HTTP server)",
            )
        if not isinstance(self.args, list) or not all(isinstance(a, str) for a in self.args):
            raise bad("args", "expected a list of strings")
        for name in ("env", "headers"):
            value = getattr(self, name)
            if not isinstance(value, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items()
            ):
                raise bad(name, "expected a mapping of string to string")
        if self.cwd is not None and not isinstance(self.cwd, str):
            raise bad("cwd", "expected a directory path or null")
        if self.isolation not in ISOLATION:
            raise bad("isolation", f"valid values: {', '.join(ISOLATION)}")
        if isinstance(self.pool_size, bool) or not isinstance(self.pool_size, int):
            raise bad("pool_size", "expected an integer >= 1")
        if self.pool_size < 1:
            raise bad("pool_size", "expected an integer >= 1")
        if self.tools is not None and (
            not isinstance(self.tools, list) or not all(isinstance(t, str) for t in self.tools)
        ):
            raise bad("tools", "expected a list of tool names, or null for all")
        if not isinstance(self.name, str) or not self.name:
            raise bad("name", "expected a non-empty label")
        check_common_options(self, bad)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> McpConfig:
        """Build from a mapping (YAML ``workflow_kwargs.mcp_config``); unknown keys are errors."""
        return strict_from_dict(cls, data, section="mcp config", error=McpConfigError)

    def new(self, **changes: Any) -> McpConfig:
        """A copy with ``changes`` applied (validated)."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """Where the server is, for logs (no secrets)."""
        if self.command:
            return f"MCP server {self.name!r} (stdio: {self.command})"
        return f"MCP server {self.name!r} at {', '.join(redact_url(u) for u in self.all_urls)}"

    def __repr__(self) -> str:  # keep secrets out of logs and tracebacks
        shown = field_dict(self)
        shown["url"] = redact_url(self.url) if self.url else None
        shown["urls"] = [redact_url(u) for u in self.urls]
        shown["env"] = {k: "***" for k in self.env}
        shown["headers"] = {k: "***" for k in self.headers}
        return "McpConfig(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"
