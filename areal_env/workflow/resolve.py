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

import inspect
import logging
from typing import Any

from areal_env.api.config import RolloutConfig
from areal_env.api.imports import import_string
from areal_env.api.workflow import RolloutWorkflow
from areal_env.workflow.grouped import GroupedRolloutWorkflow
from areal_env.workflow.proxy_workflow import OpenAIProxyWorkflow

logger = logging.getLogger(__name__)

ACCEPTED = (
    "a RolloutWorkflow instance, a RolloutWorkflow subclass, an import string "
    "('pkg.module.Attr', 'pkg.module:Attr' or 'path/to/file.py:Attr'), or an agent object/class "
    "with 'async def run(self, data, **extra_kwargs)'"
)


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
