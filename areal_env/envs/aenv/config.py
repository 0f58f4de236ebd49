"""``AenvConfig``: how to reach one AEnvironment and how hard to try.

Every value is checked at construction so that a typo in a YAML file fails before any episode
runs, with a message that names the field. ``from_dict`` refuses unknown keys for the same reason.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from areal_env.api.records import field_dict, strict_from_dict
from areal_env.envs.base import check_common_options

MODES = ("direct", "scheduler")

# name@version, where version is optional; tools are listed as name@version/tool.
_ENV_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*(@[A-Za-z0-9][A-Za-z0-9_.\-+]*)?$")
_SECRET_QUERY_KEYS = re.compile(r"(token|key|secret|password|passwd|auth|signature|sig)", re.I)


class AenvConfigError(ValueError):
    """An ``AenvConfig`` value is invalid; the message names the field."""


def redact_url(url: str | None) -> str:
    """``url`` with user-info and secret-looking query values replaced by ``***`` (for logs)."""
    if not url:
        return str(url)
    try:
        parts = urlsplit(url if "://" in url else f"http://{url}")
    except ValueError:
        return "<unparseable url>"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    query = parts.query
    if query:
        pieces = []
        for item in query.split("&"):
            k, sep, _ = item.partition("=")
            pieces.append(f"{k}=***" if sep and _SECRET_QUERY_KEYS.search(k) else item)
        query = "&".join(pieces)
    out = urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    return out if "://" in url else out.split("://", 1)[1]


@dataclass
class AenvConfig:
    """Where the environment lives and the retry/timeout policy for talking to it."""

    env_name: str = "calculator@1.0.0"
    """``name@version``; the environment's tools are listed as ``name@version/tool``."""
    aenv_url: str = "http://127.0.0.1"
    """Host of the environment (direct mode: the server itself, data plane on port 8081) or of
    the AEnvironment service (scheduler mode: control plane :8080, data plane :8081)."""
    mode: Literal["direct", "scheduler"] = "direct"
    """direct = talk to an already running environment server; scheduler = ask the
    AEnvironment service (control plane :8080) to create an instance per episode."""
    api_key: str | None = None
    """Bearer key for the AEnvironment service (scheduler mode). Never logged."""
    timeout: float = 30.0
    """Per-request timeout for the control and data planes (seconds)."""
    startup_timeout: float = 120.0
    """How long ``initialize`` waits for the environment to become ready (seconds)."""
    tool_call_timeout: float = 30.0
    """Upper bound for one tool call (seconds); a timed-out call is not retried."""
    max_retries: int = 3
    """Retries after the first attempt, only where a retry is safe (the request never ran)."""
    retry_delay: float = 0.5
    """Initial backoff (seconds); doubles per retry, with jitter, capped at 16x."""
    ttl: str = "30m"
    """Instance time-to-live (scheduler mode)."""
    environment_variables: dict[str, str] = field(default_factory=dict)
    """Passed to a new instance (scheduler mode; ignored in direct mode)."""
    tool_error_policy: Literal["append_error", "raise"] = "append_error"
    """What an agent does with a tool that reports an error: show it to the model as the tool
    message (append_error) or abort the episode (raise)."""
    skip_health_check: bool = False
    """Skip our readiness probe (``GET /functions/list``) in ``initialize``."""
    auto_release: bool = True
    """Release the instance when the adapter's ``async with`` block exits."""
    datasource: str = ""
    """Data source the service mounts into a new instance (scheduler mode)."""
    arguments: list[str] = field(default_factory=list)
    """Command-line arguments for the instance's entry point (scheduler mode)."""
    owner: str | None = None
    """Owner recorded on a new instance (scheduler mode)."""
    labels: dict[str, str] | None = None
    """Resource labels of a new instance (scheduler mode)."""
    mount_points: list[dict[str, Any]] | None = None
    """Mount points forwarded to the sandbox engine, e.g. ``[{"id": "OSS_x", "remote_dir":
    "/data", "local_dir": "/workspace"}]`` (scheduler mode; engines that support them)."""
    max_tool_output_tokens: int | None = 2048
    """Tool results longer than about this many tokens (4 characters each) are cut, with a
    marker saying how much was dropped; null = no limit."""
    tool_images: bool = False
    """Show image content to the model as data URLs (models that take images); else a short
    placeholder text."""
    server_python: str | None = None
    """Interpreter that runs ``python -m aenv.main`` when areal-env starts the environment
    servers itself (``examples/aenv``, tests). Default: ``$AREAL_ENV_AENV_PYTHON``, else
    ``.venv-aenv/bin/python`` (created with aenvironment 0.1.7 on first use). In a config file
    a relative path is relative to the file, and checked when the config loads."""

    def __post_init__(self) -> None:
        self.validate()

    # ----------------------------------------------------------------------------------------
    def validate(self) -> None:
        def bad(name: str, why: str) -> AenvConfigError:
            value = getattr(self, name)
            shown = "***" if name == "api_key" else repr(value)
            if name == "aenv_url":
                shown = repr(redact_url(value) if isinstance(value, str) else value)
            return AenvConfigError(f"aenv.{name}={shown} is invalid: {why}")

        if not isinstance(self.env_name, str) or not _ENV_NAME.match(self.env_name):
            raise bad("env_name", "expected 'name@version' (letters, digits, '_', '.', '-')")
        if not isinstance(self.aenv_url, str) or not self.aenv_url.strip():
            raise bad("aenv_url", "expected a URL such as 'http://127.0.0.1'")
        try:
            parts = urlsplit(self.aenv_url if "://" in self.aenv_url else f"http://{self.aenv_url}")
            host = parts.hostname
        except ValueError as e:
            raise bad("aenv_url", str(e)) from None
        if parts.scheme not in ("http", "https") or not host:
            raise bad(
                "aenv_url", "expected http://HOST (ports 8080/8081 are aenvironment's fixed ports)"
            )
        if self.mode not in MODES:
            raise bad("mode", f"valid values: {', '.join(MODES)}")
        if self.api_key is not None and not isinstance(self.api_key, str):
            raise bad("api_key", "expected a string or null")
        if not isinstance(self.ttl, str) or not re.match(r"^\d+[smhd]?$", self.ttl):
            raise bad("ttl", "expected a duration such as '30m', '2h' or '600s'")
        if not isinstance(self.environment_variables, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.environment_variables.items()
        ):
            raise bad("environment_variables", "expected a mapping of string to string")
        for name in ("skip_health_check", "auto_release"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "expected true or false")
        if not isinstance(self.datasource, str):
            raise bad("datasource", "expected a string")
        if not isinstance(self.arguments, list) or not all(
            isinstance(a, str) for a in self.arguments
        ):
            raise bad("arguments", "expected a list of strings")
        if self.owner is not None and not isinstance(self.owner, str):
            raise bad("owner", "expected a string or null")
        if self.labels is not None and (
            not isinstance(self.labels, dict)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in self.labels.items())
        ):
            raise bad("labels", "expected a mapping of string to string, or null")
        if self.mount_points is not None and (
            not isinstance(self.mount_points, list)
            or not all(isinstance(m, dict) for m in self.mount_points)
        ):
            raise bad("mount_points", "expected a list of mappings, or null")
        if self.server_python is not None and not isinstance(self.server_python, str):
            raise bad("server_python", "expected a path to a Python interpreter, or null")
        check_common_options(self, bad)

    # ----------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AenvConfig:
        """Build from a mapping (YAML ``workflow_kwargs.aenv_config``); unknown keys are errors."""
        return strict_from_dict(cls, data, section="aenv config", error=AenvConfigError)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def new(self, **changes: Any) -> AenvConfig:
        """A copy with ``changes`` applied (validated)."""
        return dataclasses.replace(self, **changes)

    @property
    def host(self) -> str:
        """The host name to contact (credentials and port stripped)."""
        url = self.aenv_url if "://" in self.aenv_url else f"http://{self.aenv_url}"
        return urlsplit(url).hostname or "127.0.0.1"

    @property
    def data_plane_url(self) -> str:
        """``http://HOST:8081``: where tools, reward and functions are served (aenvironment convention)."""
        return f"http://{self.host}:8081"

    def __repr__(self) -> str:  # keep secrets out of logs and tracebacks
        shown = field_dict(self)
        shown["aenv_url"] = redact_url(self.aenv_url)
        if self.api_key is not None:
            shown["api_key"] = "***"
        if self.environment_variables:
            shown["environment_variables"] = {k: "***" for k in self.environment_variables}
        return "AenvConfig(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"
