"""``resolve_workflow``: turn whatever the user passed as ``workflow=`` into a RolloutWorkflow.

Accepted forms (checked in this order):

1. a ``RolloutWorkflow`` instance (``workflow_kwargs`` must be empty);
2. a ``RolloutWorkflow`` subclass (instantiated with ``workflow_kwargs``);
3. an import string — ``"pkg.module.Attr"``, ``"pkg.module:Attr"`` or ``"path/to/file.py:Attr"`` —
   imported and then resolved again by these rules;
4. an agent: any object or class with ``async def run(self, data, **extra_kwargs)`` (a plain
   ``def run`` is allowed with ``rollout.mode="subproc"``), wrapped in ``OpenAIProxyWorkflow``.

With ``rollout.n_samples > 1`` the result is wrapped in ``GroupedRolloutWorkflow``.

Files are imported by path under a unique, deterministic module name. ``agents/`` has no
``__init__.py`` on purpose (a package named ``agents`` would shadow the OpenAI Agents SDK), so
putting its folder on ``sys.path`` or importing it as a package is never done here.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

from areal_env.api.config import RolloutConfig
from areal_env.api.workflow import RolloutWorkflow

logger = logging.getLogger(__name__)

ACCEPTED = (
    "a RolloutWorkflow instance, a RolloutWorkflow subclass, an import string "
    "('pkg.module.Attr', 'pkg.module:Attr' or 'path/to/file.py:Attr'), or an agent object/class "
    "with 'async def run(self, data, **extra_kwargs)'"
)

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


def has_run_method(obj: Any) -> bool:
    return callable(getattr(obj, "run", None))


def _check_run(agent: Any, rollout: RolloutConfig) -> None:
    run = agent.run
    if inspect.iscoroutinefunction(run) or rollout.mode == "subproc":
        return
    raise TypeError(
        f"{agent!r}: run() is synchronous; use 'async def run(self, data, **extra_kwargs)' or set "
        "rollout.mode='subproc' (sync agents run in worker processes)"
    )


def resolve_workflow(
    workflow: Any,
    workflow_kwargs: dict[str, Any] | None = None,
    *,
    rollout: RolloutConfig,
    proxy_base_url: str | None = None,
    admin_key: str | None = None,
) -> RolloutWorkflow:
    """Resolve ``workflow`` (see the module docstring) and wrap it for ``rollout.n_samples``."""
    from areal_env.workflow.grouped import GroupedRolloutWorkflow

    wf = _resolve(
        workflow,
        dict(workflow_kwargs or {}),
        rollout=rollout,
        proxy_base_url=proxy_base_url,
        admin_key=admin_key,
        agent_import=None,
        depth=0,
    )
    if rollout.n_samples > 1 and not isinstance(wf, GroupedRolloutWorkflow):
        wf = GroupedRolloutWorkflow(wf, rollout.n_samples)
    return wf


def _resolve(
    workflow: Any,
    kwargs: dict[str, Any],
    *,
    rollout: RolloutConfig,
    proxy_base_url: str | None,
    admin_key: str | None,
    agent_import: str | None,
    depth: int,
) -> RolloutWorkflow:
    from areal_env.workflow.proxy_workflow import OpenAIProxyWorkflow

    if depth > 4:
        raise TypeError(
            f"workflow import string resolves to another string too many times: {workflow!r}"
        )
    if isinstance(workflow, RolloutWorkflow):
        if kwargs:
            raise TypeError(
                f"workflow_kwargs {sorted(kwargs)} were given with a RolloutWorkflow instance "
                f"({type(workflow).__name__}); pass the class instead, or no kwargs"
            )
        return workflow
    if isinstance(workflow, type) and issubclass(workflow, RolloutWorkflow):
        return workflow(**kwargs)
    if isinstance(workflow, str):
        obj = import_string(workflow)
        return _resolve(
            obj,
            kwargs,
            rollout=rollout,
            proxy_base_url=proxy_base_url,
            admin_key=admin_key,
            agent_import=workflow,
            depth=depth + 1,
        )
    if has_run_method(workflow):
        if isinstance(workflow, type):
            agent = workflow(**kwargs)
            agent_kwargs = kwargs
        else:
            if kwargs:
                raise TypeError(
                    f"workflow_kwargs {sorted(kwargs)} were given with an agent instance "
                    f"({type(workflow).__name__}); pass the class instead, or no kwargs"
                )
            agent = workflow
            agent_kwargs = {}
        _check_run(agent, rollout)
        if not proxy_base_url or not admin_key:
            raise ValueError(
                "an agent workflow runs through the proxy: resolve_workflow needs proxy_base_url "
                "and admin_key"
            )
        return OpenAIProxyWorkflow(
            agent,
            proxy_base_url=proxy_base_url,
            admin_key=admin_key,
            rollout=rollout,
            agent_import=agent_import,
            agent_kwargs=agent_kwargs,
        )
    raise TypeError(f"cannot use {workflow!r} as a workflow; accepted: {ACCEPTED}")
