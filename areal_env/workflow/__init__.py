"""Agent workflows: resolving ``workflow=...``, running episodes through the proxy, grouping,
and the rollout executor.

Imports are lazy so that subprocess workers (``areal_env.workflow.subproc``) start without
loading torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "resolve_workflow": "areal_env.workflow.resolve",
    "import_string": "areal_env.api.imports",
    "OpenAIProxyWorkflow": "areal_env.workflow.proxy_workflow",
    "EpisodeRecord": "areal_env.workflow.proxy_workflow",
    "episode_sink": "areal_env.workflow.proxy_workflow",
    "validate_reward": "areal_env.workflow.proxy_workflow",
    "GroupedRolloutWorkflow": "areal_env.workflow.grouped",
    "RolloutExecutor": "areal_env.workflow.executor",
    "collate": "areal_env.workflow.batch",
    "number_groups": "areal_env.workflow.batch",
    "TrainingRow": "areal_env.api.rows",
    "SubprocAgentPool": "areal_env.workflow.subproc",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'areal_env.workflow' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
