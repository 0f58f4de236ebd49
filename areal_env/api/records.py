"""Two dataclass chores every config and record repeats: strict construction from a mapping
(unknown keys are errors that list the valid ones, so a YAML typo fails before anything runs)
and a shallow ``{field: value}`` view for JSON answers."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, TypeVar

T = TypeVar("T")


def unknown_keys(cls: type, data: Iterable[str]) -> tuple[list[str], list[str]]:
    """``(unknown keys of data, sorted field names of cls)``."""
    names = sorted(f.name for f in dataclasses.fields(cls))
    return sorted(set(data) - set(names)), names


def strict_from_dict(
    cls: type[T], data: Any, *, section: str, error: type[Exception] = ValueError
) -> T:
    """``cls(**data)``, refusing a non-mapping or unknown keys with an ``error`` that names
    ``section`` (e.g. ``aenv config``) and the valid keys."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise error(f"{section} must be a mapping, got {type(data).__name__}")
    unknown, names = unknown_keys(cls, data)
    if unknown:
        raise error(f"unknown {section} key {unknown[0]!r}; valid keys: {', '.join(names)}")
    return cls(**data)


def field_dict(obj: Any, *, exclude: Iterable[str] = ()) -> dict[str, Any]:
    """The dataclass ``obj``'s fields as a dict (values not copied), less ``exclude``."""
    skip = set(exclude)
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.name not in skip}
