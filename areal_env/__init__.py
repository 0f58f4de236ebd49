"""areal-env: train any LLM agent with RL through an OpenAI/Anthropic-compatible proxy.

The public names are imported lazily so that ``import areal_env`` stays light (no torch) for
agent-side code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    # agents and training
    "AenvAgent": "areal_env.envs.agent",
    "PPOTrainer": "areal_env.trainer.ppo",
    "RolloutWorkflow": "areal_env.api.workflow",
    "resolve_workflow": "areal_env.workflow.resolve",
    "OpenAIProxyWorkflow": "areal_env.workflow.proxy_workflow",
    "GroupedRolloutWorkflow": "areal_env.workflow.grouped",
    # configuration and data types
    "ExperimentConfig": "areal_env.api.config",
    "load_config": "areal_env.api.config",
    "ConfigError": "areal_env.api.config",
    "GenerationConfig": "areal_env.api.io",
    "ModelRequest": "areal_env.api.io",
    "ModelResponse": "areal_env.api.io",
    "InferenceEngine": "areal_env.api.engine",
    "TrainingRow": "areal_env.api.rows",
    "BatchSource": "areal_env.api.source",
    # engines and proxy
    "LocalEngine": "areal_env.engine.local",
    "SGLangEngine": "areal_env.engine.sglang",
    "create_engine": "areal_env.engine.factory",
    "ScriptedEngine": "areal_env.engine.testing",
    "ProxyServer": "areal_env.proxy.server",
    "OpenAIProxyClient": "areal_env.proxy.client",
    # tool environments: aenvironment servers and any MCP server
    "AenvConfig": "areal_env.envs.aenv",
    "AenvEnvironmentAdapter": "areal_env.envs.aenv",
    "McpConfig": "areal_env.envs.mcp",
    "McpEnvironmentAdapter": "areal_env.envs.mcp",
    "ToolEnvironment": "areal_env.envs.base",
    # any-agent service (client side)
    "AgentSession": "areal_env_client",
    "AgentRunner": "areal_env_client",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'areal_env' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from areal_env.api.config import ConfigError, ExperimentConfig, load_config  # noqa: F401
    from areal_env.api.engine import InferenceEngine  # noqa: F401
    from areal_env.api.io import GenerationConfig, ModelRequest, ModelResponse  # noqa: F401
    from areal_env.api.rows import TrainingRow  # noqa: F401
    from areal_env.api.source import BatchSource  # noqa: F401
    from areal_env.api.workflow import RolloutWorkflow  # noqa: F401
    from areal_env.engine.local import LocalEngine  # noqa: F401
    from areal_env.envs.agent import AenvAgent  # noqa: F401
    from areal_env.trainer.ppo import PPOTrainer  # noqa: F401
