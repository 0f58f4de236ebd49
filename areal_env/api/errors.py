"""Exceptions of the ``api`` layer that several config modules raise."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names it."""


def check_port(section: str, port: int) -> None:
    """``ConfigError`` unless ``port`` is a TCP port (0 = any free one)."""
    if not (0 <= port < 65536):
        raise ConfigError(f"{section}.port={port!r} must be in [0, 65535]")
