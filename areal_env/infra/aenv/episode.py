"""Moved to ``areal_env.infra.episode`` (shared by both environment families); kept as an alias."""

from areal_env.infra.episode import (  # noqa: F401
    EnvAgentBase,
    EnvironmentPool,
    EpisodeOutcome,
    McpEnvironmentPool,
    compute_reward,
    initial_messages,
    json_safe,
    logged_tool_call,
    make_config,
    make_mcp_config,
    resolve_reward_fn,
    sampling_kwargs,
)
