"""Exceptions of the ``api`` layer that several config modules raise."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names it."""
