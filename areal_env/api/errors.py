"""Exceptions of the ``api`` layer that several config modules raise."""

from __future__ import annotations

import math


class ConfigError(ValueError):
    """A configuration value or key is invalid; the message names it."""


def check_port(section: str, port: int) -> None:
    """``ConfigError`` unless ``port`` is a TCP port (0 = any free one)."""
    if not (0 <= port < 65536):
        raise ConfigError(f"{section}.port={port!r} must be in [0, 65535]")


def check_rate_limit(
    section: str, rps_name: str, rps: object, burst_name: str, burst: object
) -> tuple[float, int] | None:
    """Validate a request-rate pair (token bucket: per second, burst) and return it with the
    default burst filled in (one second's worth), or None when the rate is unset (no limit).
    The errors say which key to set or remove."""
    if rps is not None and (
        isinstance(rps, bool)
        or not isinstance(rps, int | float)
        or not math.isfinite(rps)
        or rps <= 0
    ):
        raise ConfigError(
            f"{section}.{rps_name}={rps!r} must be a number > 0 (requests per second per "
            "key), or null for no limit"
        )
    if burst is not None:
        if rps is None:
            raise ConfigError(
                f"{section}.{burst_name}={burst!r} is set but {section}.{rps_name} is not: "
                f"set {section}.{rps_name} (e.g. 5) to turn the limit on, or remove {burst_name}"
            )
        if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
            raise ConfigError(
                f"{section}.{burst_name}={burst!r} must be an integer >= 1 (requests "
                "allowed at once), or null for one second's worth"
            )
    if rps is None:
        return None
    return float(rps), int(burst) if burst is not None else max(1, math.ceil(float(rps)))
