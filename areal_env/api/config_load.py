"""The configuration loader's machinery, for any config dataclass: converting YAML and
command-line values to the annotated types, building nested dataclasses, running each section's
``validate()``, and parsing dotted overrides. Errors are ``ConfigError`` naming the bad key and
value (an unknown key lists the valid ones). ``config.load_config`` is the entry point.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml

from areal_env.api.errors import ConfigError

T = TypeVar("T")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce_number(tp: type, value: Any, key: str) -> Any:
    """``value`` as ``tp`` (int or float): numbers and numeric strings; an int field takes a
    whole float (``2.0``), never a bool."""
    if not isinstance(value, bool):
        if isinstance(value, int) or (
            isinstance(value, float) and (tp is float or value.is_integer())
        ):
            return tp(value)
        if isinstance(value, str):
            try:
                return tp(value)
            except ValueError:
                pass
    what = "an integer" if tp is int else "a number"
    raise ConfigError(f"{key}={value!r} is invalid; expected {what}")


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Convert ``value`` (from YAML or a command-line string) to annotation ``tp``."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none", "~")):
            if type(None) in args:
                return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(
            f"{key}={value!r} is invalid; expected {' or '.join(_type_name(a) for a in args)}"
        )
    if origin is Literal:
        choices = get_args(tp)
        if isinstance(value, bool):
            # YAML 1.1 reads unquoted on/off/yes/no as booleans: map them back to the choice.
            for word in ("on", "true", "yes") if value else ("off", "false", "no"):
                if word in choices:
                    return word
        if value in choices and not isinstance(value, bool):
            return value
        raise ConfigError(
            f"{key}={value!r} is invalid; valid values: {', '.join(map(str, choices))}"
        )
    if dataclasses.is_dataclass(tp):
        if isinstance(tp, type) and isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping of fields, got {value!r}")
        assert isinstance(tp, type)
        return _build(tp, value, prefix=key + ".")
    if origin in (list, tuple):
        (inner,) = get_args(tp)[:1] or (Any,)
        if isinstance(value, str):
            value = (
                yaml.safe_load(value)
                if value.strip().startswith("[")
                else [v.strip() for v in value.split(",") if v.strip()]
            )
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} must be a list")
        return [_convert(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if isinstance(value, str):
            value = yaml.safe_load(value)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r} must be a mapping")
        inner = get_args(tp)[1] if len(get_args(tp)) == 2 else Any
        if inner is Any:
            return dict(value)
        # e.g. ``policies: {name: PolicyConfig}``: each value converted (``None`` = defaults)
        return {
            k: _convert(
                {} if v is None and dataclasses.is_dataclass(inner) else v, inner, f"{key}.{k}"
            )
            for k, v in value.items()
        }
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "no", "0", "off"):
            return False
        raise ConfigError(f"{key}={value!r} is invalid; expected true or false")
    if tp is int or tp is float:
        return _coerce_number(tp, value, key)
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}={value!r} is invalid; expected a string")
    return value


def _build(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown config key {prefix}{unknown[0]!s}; valid keys under "
            f"{prefix.rstrip('.') or 'the top level'}: {', '.join(sorted(fields))}"
        )
    kwargs = {name: _convert(value, hints[name], prefix + name) for name, value in data.items()}
    try:
        obj = cls(**kwargs)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: {e}") from e
    return obj


def validate_config(cfg: Any, prefix: str = "") -> None:
    """Run every section's ``validate()`` (depth first), turning ValueError into ConfigError."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            validate_config(value, prefix + f.name + ".")
    validate = getattr(cfg, "validate", None)
    if callable(validate):
        try:
            validate()
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(f"{prefix.rstrip('.') or type(cfg).__name__}: {e}") from e


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["rollout.n_samples=8", "model.path=/m"]`` → nested dict (values parsed as YAML scalars)."""
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        key = key.strip().lstrip("-")
        if not key:
            raise ConfigError(f"override {item!r} has an empty key")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        _set_dotted(tree, key, value)
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "workflow_kwargs":
            out[k] = _merge(out[k], v)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def config_from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """Build and validate ``cls`` from a (possibly partial) nested dict."""
    cfg = _build(cls, data)
    validate_config(cfg)
    return cfg


def read_config_data(
    path: str | os.PathLike[str] | None, overrides: list[str] | None = None
) -> dict[str, Any]:
    """The raw mapping of a YAML config file (optional) with dotted overrides merged in."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from e
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level")
        data = loaded
    if overrides:
        data = _merge(data, parse_overrides(overrides))
    return data
