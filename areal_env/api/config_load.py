"""The configuration loader's machinery, for any config dataclass: converting YAML and
command-line values to the annotated types, building nested dataclasses, running each section's
``validate()``, and parsing dotted overrides. Errors are ``ConfigError`` naming the bad key and
value (an unknown key lists the valid ones). ``config.load_config`` is the entry point.

Paths: a field declares that it holds a path with ``path_field(kind)`` (or, for a free-form
mapping such as ``workflow_kwargs``, the dotted keys inside it that do). A relative path written
in a config file is relative to that file's folder, wherever the command runs; one given on the
command line (a dotted override) or left at its default is relative to the working directory.
``check_config_paths`` then reports a missing file, script or executable at config time, before
anything heavy (a model) is loaded.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml

from areal_env.api.errors import ConfigError

T = TypeVar("T")

CONFIG_PATH = "config_path"
"""Field metadata key: how the field's value is a path (a ``PathKind``), or, for a mapping
field, ``{dotted key inside it: PathKind}`` (the key ``"*"``: every value of the mapping, as in
``extra_valid_datasets``)."""

PathKind = Literal["file", "dir", "workdir", "import", "command", "model", "store"]
"""``file``: must exist. ``dir``: a folder (made when needed). ``workdir``: the working folder
of a process the section starts; must exist, and defaults to the config file's folder when the
section has a ``command``. ``import``: ``file.py:Attr`` (the file must exist) or a module path
(left alone). ``command``: an executable; a name without ``/`` is looked up on ``PATH`` (then
beside the running interpreter), a path is relative like any other. ``model``: a model name or
a local folder (relative only if that folder exists). ``store``: a SQLite path or
``sqlite:///path`` (a URL of another scheme is left alone)."""


def path_field(kind: PathKind | dict[str, PathKind], **kwargs: Any) -> Any:
    """``dataclasses.field(**kwargs)`` that holds a path of ``kind`` (see ``PathKind``)."""
    return dataclasses.field(metadata={CONFIG_PATH: kind}, **kwargs)


def find_command(command: str) -> str | None:
    """The executable ``command`` runs: a path as it is (if it is an executable file), a bare
    name on ``PATH`` or else beside the running interpreter (console scripts of the same venv
    when it is not activated); None if there is none. ``python`` is the running interpreter."""
    if command in ("python", "python3"):
        return sys.executable
    if os.sep in command or (os.altsep and os.altsep in command):
        path = Path(command).expanduser().absolute()
        return str(path) if path.is_file() and os.access(path, os.X_OK) else None
    found = shutil.which(command)
    if found:
        return found
    beside = Path(sys.executable).parent / command
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


def _import_file(spec: str) -> tuple[str, str] | None:
    """``(file, attr)`` of an import string that names a file (``path.py:Attr``), else None."""
    if ":" not in spec:
        return None
    left, attr = spec.rsplit(":", 1)
    if left.endswith(".py") or os.sep in left or "/" in left:
        return left, attr
    return None


def _relocate(kind: str, value: Any, base: Path) -> Any:
    """``value`` (written in a config file in ``base``) with a relative path made absolute."""
    if not isinstance(value, str) or not value:
        return value

    def rel(path: str) -> str:
        p = Path(path).expanduser()
        return str(p) if p.is_absolute() else str(base / p)

    if kind in ("file", "dir", "workdir"):
        return rel(value)
    if kind == "import":
        ref = _import_file(value)
        return value if ref is None else f"{rel(ref[0])}:{ref[1]}"
    if kind == "command":
        return rel(value) if "/" in value or os.sep in value else value
    if kind == "model":
        return rel(value) if (base / value).exists() else value
    if kind == "store":
        if value.startswith("sqlite:///"):
            return "sqlite:///" + rel(value.removeprefix("sqlite:///"))
        return value if "://" in value or value == ":memory:" else rel(value)
    raise ValueError(f"unknown path kind {kind!r}")


def _nested(data: Any, dotted: str) -> tuple[dict[str, Any], str] | None:
    """The mapping holding the last part of ``dotted`` inside ``data``, and that part's name."""
    *parents, name = dotted.split(".")
    for part in parents:
        if not isinstance(data, dict) or not isinstance(data.get(part), dict):
            return None
        data = data[part]
    return (data, name) if isinstance(data, dict) else None


def relocate_paths(cls: type, data: dict[str, Any], base: Path) -> dict[str, Any]:
    """A copy of ``data`` (the mapping of config file in folder ``base``, for dataclass
    ``cls``) with every relative path its fields declare made absolute against ``base``."""
    out = dict(data)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in out:
            continue
        kind = f.metadata.get(CONFIG_PATH)
        tp = hints[f.name]
        if isinstance(kind, str):
            out[f.name] = _relocate(kind, out[f.name], base)
        elif isinstance(kind, Mapping) and isinstance(out[f.name], dict):
            out[f.name] = _relocate_inside(out[f.name], kind, base)
        elif dataclasses.is_dataclass(tp) and isinstance(out[f.name], dict):
            assert isinstance(tp, type)
            out[f.name] = relocate_paths(tp, out[f.name], base)
        elif (inner := _dataclass_values(tp)) is not None and isinstance(out[f.name], dict):
            # e.g. policies: {name: PolicyConfig}
            out[f.name] = {
                k: relocate_paths(inner, v, base) if isinstance(v, dict) else v
                for k, v in out[f.name].items()
            }
    return out


def _dataclass_values(tp: Any) -> type | None:
    """The value type of a ``dict[str, SomeDataclass]`` annotation, else None."""
    if get_origin(tp) is dict:
        args = get_args(tp)
        if len(args) == 2 and dataclasses.is_dataclass(args[1]) and isinstance(args[1], type):
            return args[1]
    return None


def _relocate_inside(
    mapping: dict[str, Any], kinds: Mapping[str, str], base: Path
) -> dict[str, Any]:
    import copy

    out = copy.deepcopy(mapping)
    for dotted, kind in _expand(kinds, out).items():
        found = _nested(out, dotted)
        if found is None:
            continue
        holder, name = found
        if name in holder:
            holder[name] = _relocate(kind, holder[name], base)
        elif kind == "workdir" and holder.get("command"):
            holder[name] = str(base)  # the process starts in the config file's folder
    return out


def _expand(kinds: Mapping[str, str], mapping: dict[str, Any]) -> dict[str, str]:
    """``kinds`` with a ``"*"`` entry replaced by one entry per key of ``mapping``."""
    out = {k: v for k, v in kinds.items() if k != "*"}
    if "*" in kinds:
        out.update({key: kinds["*"] for key in mapping if "." not in key})
    return out


def _path_problem(kind: str, value: Any) -> str | None:
    """Why ``value`` (a path of ``kind``) cannot be used, or None."""
    if not isinstance(value, str) or not value:
        return None
    if kind == "file" and not Path(value).expanduser().is_file():
        return f"file {str(Path(value).expanduser().absolute())!r} does not exist"
    if kind == "workdir" and not Path(value).expanduser().is_dir():
        return f"folder {str(Path(value).expanduser().absolute())!r} does not exist"
    if kind == "import":
        ref = _import_file(value)
        if ref is not None and not Path(ref[0]).expanduser().is_file():
            return f"file {str(Path(ref[0]).expanduser().absolute())!r} does not exist"
    if kind == "command" and find_command(value) is None:
        if "/" in value or os.sep in value:
            return (
                f"{str(Path(value).expanduser().absolute())!r} is not an executable file "
                "(for a server in its own venv, give the path of its script or python)"
            )
        return (
            f"no executable {value!r} on PATH or beside {sys.executable!r} (install it, or give "
            "its path, e.g. a venv's bin/SCRIPT, or a launcher such as uvx)"
        )
    return None


def check_config_paths(cfg: Any, prefix: str = "") -> None:
    """``ConfigError`` for the first path of ``cfg`` (depth first) that names a missing file,
    folder or executable, with the key, the resolved path and how paths are resolved."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        kind = f.metadata.get(CONFIG_PATH)
        checks: list[tuple[str, str, Any]] = []
        if isinstance(kind, str):
            checks.append((prefix + f.name, kind, value))
        elif isinstance(kind, Mapping) and isinstance(value, dict):
            for dotted, inner in _expand(kind, value).items():
                found = _nested(value, dotted)
                if found is not None and found[1] in found[0]:
                    checks.append((f"{prefix}{f.name}.{dotted}", inner, found[0][found[1]]))
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_config_paths(value, prefix + f.name + ".")
        elif isinstance(value, dict):
            for k, v in value.items():
                if dataclasses.is_dataclass(v) and not isinstance(v, type):
                    check_config_paths(v, f"{prefix}{f.name}.{k}.")
        for key, k, v in checks:
            problem = _path_problem(k, v)
            if problem is not None:
                raise ConfigError(
                    f"{key}={v!r}: {problem}. A relative path in a config file is relative to "
                    "the file's folder; on the command line, to the working directory"
                )


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
    path: str | os.PathLike[str] | None,
    overrides: list[str] | None = None,
    cls: type | None = None,
) -> dict[str, Any]:
    """The raw mapping of a YAML config file (optional) with dotted overrides merged in. With
    ``cls`` (the dataclass it is for), the file's relative paths are made absolute against the
    file's folder (``relocate_paths``); the overrides' stay relative to the working directory."""
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
        if cls is not None:
            data = relocate_paths(cls, data, p.resolve().parent)
    if overrides:
        data = _merge(data, parse_overrides(overrides))
    return data
