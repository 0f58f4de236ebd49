"""Importing user code by string or by file path (workflows, agents, reward functions).

``import_string("pkg.mod.Attr" | "pkg.mod:Attr" | "path/to/file.py:Attr")`` and
``load_file_module(path)``. Files are imported by path under a unique, deterministic module
name, so subprocess workers can load the same files under the same names and unpickle objects
defined there. In ``api`` (the bottom layer) because every layer that takes user code uses it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import threading
from pathlib import Path
from typing import Any

#: Modules loaded from files: unique module name -> absolute file path. Subprocess workers load
#: the same files under the same names so that objects from them can be unpickled there.
FILE_MODULES: dict[str, str] = {}
_file_lock = threading.Lock()


def _file_module_name(path: Path) -> str:
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    stem = "".join(c if c.isalnum() else "_" for c in path.stem)
    return f"_areal_file_{stem}_{digest}"


def load_file_module(path: str | os.PathLike[str], *, spec_string: str | None = None) -> Any:
    """Import a Python file by path (once per path) under a unique module name."""
    p = Path(path).expanduser().resolve()
    label = spec_string or str(path)
    if not p.is_file():
        raise ImportError(f"cannot import workflow {label!r}: file {str(p)!r} does not exist")
    name = _file_module_name(p)
    with _file_lock:
        mod = sys.modules.get(name)
        if mod is not None:
            return mod
        spec = importlib.util.spec_from_file_location(name, p)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import workflow {label!r}: {str(p)!r} is not a Python file")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        FILE_MODULES[name] = str(p)
        return mod


def _getattr_path(obj: Any, attr: str, spec_string: str, where: str) -> Any:
    for part in attr.split("."):
        if not part or not hasattr(obj, part):
            raise AttributeError(
                f"cannot resolve workflow {spec_string!r}: {where} has no attribute {attr!r}"
            )
        obj = getattr(obj, part)
    return obj


def _is_file_ref(left: str) -> bool:
    return left.endswith(".py") or "/" in left or os.sep in left


def import_string(spec: str) -> Any:
    """Import ``"pkg.mod.Attr"``, ``"pkg.mod:Attr"`` or ``"file.py:Attr"`` and return the object."""
    s = spec.strip()
    if not s:
        raise ImportError("cannot import workflow '': empty import string")
    if ":" in s:
        left, attr = s.rsplit(":", 1)
        if not left or not attr:
            raise ImportError(
                f"cannot import workflow {spec!r}: expected 'module:Attr' or 'file.py:Attr'"
            )
        if _is_file_ref(left):
            mod = load_file_module(left, spec_string=spec)
            return _getattr_path(mod, attr, spec, f"file {left!r}")
        try:
            mod = importlib.import_module(left)
        except ModuleNotFoundError as e:
            if e.name and (left == e.name or left.startswith(e.name + ".")):
                raise ImportError(
                    f"cannot import workflow {spec!r}: no module named {e.name!r}"
                ) from e
            raise
        return _getattr_path(mod, attr, spec, f"module {left!r}")
    if s.endswith(".py"):
        raise ImportError(
            f"cannot import workflow {spec!r}: name the attribute, e.g. '{s}:MyAgent'"
        )
    parts = s.split(".")
    if len(parts) < 2:
        raise ImportError(
            f"cannot import workflow {spec!r}: expected 'pkg.module.Attr', 'pkg.module:Attr' or "
            "'path/to/file.py:Attr'"
        )
    last_error: ModuleNotFoundError | None = None
    for i in range(len(parts) - 1, 0, -1):
        mod_name = ".".join(parts[:i])
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            if e.name and (mod_name == e.name or mod_name.startswith(e.name + ".")):
                last_error = e
                continue
            raise
        return _getattr_path(mod, ".".join(parts[i:]), spec, f"module {mod_name!r}")
    raise ImportError(
        f"cannot import workflow {spec!r}: no module named {parts[0]!r}"
    ) from last_error
