"""Pieces every environment-backed agent needs: which server to use, the reward, sampling.

Shared by ``areal_env.AenvAgent`` and the ready agents in ``agents/`` so that they behave the
same way on either family of ``ToolEnvironment``: an aenvironment server (``aenv_config``) or
any MCP server (``mcp_config``). One environment per episode; the reward is the user's
``reward_fn`` or, for aenvironment, the environment's ``@register_reward`` function.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from areal_env.api.imports import import_string
from areal_env.envs.aenv.adapter import AenvEnvironmentAdapter
from areal_env.envs.aenv.config import AenvConfig
from areal_env.envs.base import ToolEnvironment, reward_value
from areal_env.envs.mcp.adapter import McpEnvironmentAdapter, StdioServerPool
from areal_env.envs.mcp.config import McpConfig


class EnvironmentPool:
    """Hands out one of several servers of the same environment per episode (least busy first).

    Environments that keep per-episode state need one server per concurrent episode: start as
    many as ``rollout.max_concurrent_rollouts`` (the launcher does) and list them all.
    """

    def __init__(self, config: AenvConfig, urls: list[str] | None = None):
        self.config = config
        self.urls = list(urls) if urls else [config.aenv_url]
        self._busy = dict.fromkeys(self.urls, 0)
        self._lock = threading.Lock()  # agents may run on several event loops / threads

    def __getstate__(self) -> dict[str, Any]:  # picklable (subprocess rollout workers)
        state = dict(self.__dict__)
        state.pop("_lock")
        state["_busy"] = dict.fromkeys(self.urls, 0)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def acquire(self) -> str:
        with self._lock:
            url = min(self.urls, key=lambda u: self._busy[u])
            self._busy[url] += 1
            return url

    def release(self, url: str) -> None:
        with self._lock:
            self._busy[url] = max(0, self._busy[url] - 1)

    def adapter(self) -> _PooledAdapter:
        """``async with pool.adapter() as env:`` — an initialized adapter on the least busy
        server, released (and its server handed back) on exit."""
        return _PooledAdapter(self)

    def make_adapter(self, url: str) -> ToolEnvironment:
        cfg = self.config
        if url != cfg.aenv_url:
            cfg = cfg.new(aenv_url=url)
        return AenvEnvironmentAdapter(cfg.new(auto_release=True))


class McpEnvironmentPool(EnvironmentPool):
    """``EnvironmentPool`` for MCP servers: HTTP episodes spread over ``urls`` (least busy
    first); stdio episodes spawn a process each, or borrow one from a ``StdioServerPool``."""

    def __init__(self, config: McpConfig):
        self.config = config  # type: ignore[assignment]
        self.urls = config.all_urls or [config.describe()]
        self._busy = dict.fromkeys(self.urls, 0)
        self._lock = threading.Lock()
        self.stdio_pool = (
            StdioServerPool(config) if config.command and config.isolation == "pool" else None
        )

    def make_adapter(self, url: str) -> ToolEnvironment:
        cfg = self.config
        assert isinstance(cfg, McpConfig)
        return McpEnvironmentAdapter(cfg, url=None if cfg.command else url, pool=self.stdio_pool)


class _PooledAdapter:
    def __init__(self, pool: EnvironmentPool):
        self.pool = pool
        self.url: str | None = None
        self.adapter: Any = None

    async def __aenter__(self) -> Any:
        self.url = self.pool.acquire()
        try:
            self.adapter = self.pool.make_adapter(self.url)
            await self.adapter.initialize()
        except BaseException:
            self.pool.release(self.url)
            raise
        return self.adapter

    async def __aexit__(self, *exc: Any) -> None:
        try:
            if self.adapter is not None:
                await self.adapter.release()
        finally:
            if self.url is not None:
                self.pool.release(self.url)


def make_mcp_config(mcp_config: McpConfig | dict[str, Any], **overrides: Any) -> McpConfig:
    """An ``McpConfig`` from a config or a mapping (YAML), plus overrides."""
    cfg = mcp_config if isinstance(mcp_config, McpConfig) else McpConfig.from_dict(dict(mcp_config))
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return cfg.new(**overrides) if overrides else cfg


def make_config(aenv_config: AenvConfig | dict[str, Any] | None, **overrides: Any) -> AenvConfig:
    """An ``AenvConfig`` from a config, a mapping (YAML) or None (defaults), plus overrides."""
    if aenv_config is None:
        cfg = AenvConfig()
    elif isinstance(aenv_config, AenvConfig):
        cfg = aenv_config
    else:
        cfg = AenvConfig.from_dict(dict(aenv_config))
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return cfg.new(**overrides) if overrides else cfg


def resolve_reward_fn(reward_fn: Callable[..., Any] | str | None) -> Callable[..., Any] | None:
    """A callable from a callable or an import string (``pkg.mod:fn``, ``file.py:fn``)."""
    if reward_fn is None or callable(reward_fn):
        return reward_fn
    if isinstance(reward_fn, str):
        try:
            fn = import_string(reward_fn)
        except (ImportError, AttributeError) as e:
            raise ImportError(
                f"cannot import reward_fn {reward_fn!r}: {e} (a relative 'file.py:fn' given in "
                f"code is relative to the working directory, {os.getcwd()}; in a config file, "
                "to the file's folder)"
            ) from e
        if not callable(fn):
            raise TypeError(f"reward_fn {reward_fn!r} is not callable")
        return fn
    raise TypeError(f"reward_fn must be a callable or an import string, got {reward_fn!r}")


def json_safe(value: Any) -> Any:
    """``value`` as plain JSON types (the reward endpoint receives JSON)."""
    return json.loads(json.dumps(value, default=str))


@dataclass
class EpisodeOutcome:
    """What the reward sees about an episode."""

    data: Any
    final_answer: str
    messages: list[dict[str, Any]]
    tool_calls: list[dict[str, Any]]
    completion_ids: list[str] = field(default_factory=list)
    """Every model completion of the episode, in order (the proxy's ids: what a per-completion
    reward names); the last one gave the final answer."""


@dataclass(frozen=True)
class EpisodeReward:
    """What the reward function said of an episode.

    ``value``: the episode's reward (paid to the completion that gave the final answer).
    ``call_rewards``: optional credit per tool call, aligned with the episode's tool calls (a
    verifier's "this call was a right step"): each is paid to the completion that made the call,
    so that in training a right call followed by a wrong answer is told apart from a wrong call
    (per-turn credit; docs/training.md, "Credit per tool call"). Empty: none given.
    ``answer_in_reach``: False when the verifier knows that no answer could have been right
    after the tool results the agent got (a wrong call broke the solution's chain): the answering
    completion is then left out of the loss, so that the turn which faithfully reports a wrong
    result is not blamed for the call that produced it.
    """

    value: float
    call_rewards: tuple[float, ...] = ()
    answer_in_reach: bool = True

    def per_completion(self, outcome: EpisodeOutcome) -> float | dict[str, float | None]:
        """The agent's return value: ``value`` alone when there is no call credit (or nothing
        to pay it to) and the answer was in reach, else ``{completion_id: reward}`` with every
        call's credit added to the completion that made it and ``value`` to the last completion
        (``None``, out of the loss, when the answer was out of reach, was not right anyway, and
        that completion made no call that earned credit)."""
        if not outcome.completion_ids:
            return self.value
        out: dict[str, float | None] = {}
        for entry, credit in zip(outcome.tool_calls, self.call_rewards, strict=False):
            cid = entry.get("completion_id")
            if credit and isinstance(cid, str):
                out[cid] = (out.get(cid) or 0.0) + credit
        last = outcome.completion_ids[-1]
        if not self.answer_in_reach and not self.value and last not in out:
            out[last] = None
            return out
        if not out:  # no call earned anything: the episode's reward, as without credit
            return self.value
        out[last] = (out.get(last) or 0.0) + self.value
        return out


def episode_reward(result: Any, n_calls: int) -> EpisodeReward:
    """An :class:`EpisodeReward` from a reward function's result: a number, or a dict with
    ``reward`` (``score``, ``value``) and optionally ``call_rewards``: one number per tool call
    of the episode. ``ValueError`` says what is wrong with it."""
    value = reward_value(result)
    in_reach = result.get("answer_in_reach", True) if isinstance(result, dict) else True
    if not isinstance(in_reach, bool):
        raise ValueError(f"answer_in_reach must be true or false, got {in_reach!r:.60}")
    credits = result.get("call_rewards") if isinstance(result, dict) else None
    if credits is None:
        return EpisodeReward(value, answer_in_reach=in_reach)
    if not isinstance(credits, list | tuple) or len(credits) != n_calls:
        raise ValueError(
            f"call_rewards must be a list with one number per tool call of the episode "
            f"({n_calls}), got {credits!r:.120}"
        )
    out = []
    for x in credits:
        if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
            raise ValueError(f"call_rewards must hold finite numbers, got {x!r}")
        out.append(float(x))
    return EpisodeReward(value, tuple(out), answer_in_reach=in_reach)


async def compute_reward(
    outcome: EpisodeOutcome,
    env: ToolEnvironment,
    reward_fn: Callable[..., Any] | None,
) -> EpisodeReward:
    """The episode's reward, and the credit per tool call if the function gives one.

    With ``reward_fn``: called with the keywords it accepts among ``data``/``task``,
    ``final_answer``, ``messages``, ``tool_calls`` and ``env`` (may be async); returns a number
    or ``{"reward": x}`` (with ``"call_rewards": [...]`` for per-call credit). Without: the
    environment's reward function receives ``{"final_answer", "task", "tool_calls"}`` as JSON.
    """
    if reward_fn is not None:
        candidates = {
            "data": outcome.data,
            "task": outcome.data,
            "final_answer": outcome.final_answer,
            "messages": outcome.messages,
            "tool_calls": outcome.tool_calls,
            "env": env,
        }
        try:
            params = list(inspect.signature(reward_fn).parameters.values())
        except (TypeError, ValueError):
            params = []
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            kwargs = candidates
        else:
            kwargs = {p.name: candidates[p.name] for p in params if p.name in candidates}
        result = reward_fn(**kwargs)
        if inspect.isawaitable(result):
            result = await result
        return episode_reward(result, len(outcome.tool_calls))
    if not env.has_reward:
        raise ValueError(f"{env.where} has no reward endpoint: give the agent a reward_fn")
    result = await env.call_reward(
        {
            "final_answer": outcome.final_answer,
            "task": json_safe(outcome.data),
            "tool_calls": json_safe(outcome.tool_calls),
        }
    )
    return episode_reward(result, len(outcome.tool_calls))


def sampling_kwargs(
    gconfig: Any = None,
    *,
    temperature: float | None = None,
    top_p: float | None = None,
    max_tokens: int | None = None,
) -> dict[str, Any]:
    """OpenAI request parameters from a ``GenerationConfig`` (or mapping) plus overrides."""
    out: dict[str, Any] = {}
    if gconfig is not None:
        g = gconfig if isinstance(gconfig, dict) else vars(gconfig)
        if g.get("max_new_tokens") is not None:
            out["max_tokens"] = int(g["max_new_tokens"])
        if g.get("greedy"):
            out["temperature"] = 0.0
        elif g.get("temperature") is not None:
            out["temperature"] = float(g["temperature"])
        if g.get("top_p") is not None and g.get("top_p") != 1.0:
            out["top_p"] = float(g["top_p"])
    if temperature is not None:
        out["temperature"] = float(temperature)
    if top_p is not None:
        out["top_p"] = float(top_p)
    if max_tokens is not None:
        out["max_tokens"] = int(max_tokens)
    return out


def initial_messages(data: Any, system_prompt: str | None) -> list[dict[str, Any]]:
    """Chat messages that start an episode from a dataset item.

    ``data["messages"]`` (a chat) is used as is; otherwise the first of ``prompt``, ``question``,
    ``query``, ``problem`` becomes the user message. ``system_prompt`` is prepended unless the
    chat already starts with a system message.
    """
    if isinstance(data, str):
        messages = [{"role": "user", "content": data}]
    elif isinstance(data, dict) and isinstance(data.get("messages"), list):
        messages = [dict(m) for m in data["messages"]]
    elif isinstance(data, dict):
        for key in ("prompt", "question", "query", "problem"):
            if isinstance(data.get(key), str):
                messages = [{"role": "user", "content": data[key]}]
                break
        else:
            raise ValueError(
                "dataset item has no 'messages', 'prompt', 'question', 'query' or 'problem'"
            )
    else:
        raise ValueError(f"dataset item must be a dict or a string, got {type(data).__name__}")
    if system_prompt and not (messages and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


async def logged_tool_call(
    env: ToolEnvironment,
    name_map: dict[str, str],
    name: str,
    raw_args: str | None,
    tool_log: list[dict[str, Any]],
    *,
    unknown_text: str,
) -> dict[str, Any]:
    """Run the model's call of tool ``name`` in ``env`` and record it in ``tool_log``.

    Returns the log entry (``name``, ``arguments``, ``is_error``, ``result``: the text the model
    sees). An unknown name (``unknown_text``) or bad JSON arguments never reach the environment;
    transport failures (``EnvToolCallError``) propagate so that the episode is rejected. The
    caller applies ``tool_error_policy`` (each agent raises its own error type).
    """
    from areal_env.envs.schema import ToolArgumentsError, parse_tool_arguments

    entry: dict[str, Any] = {"name": name, "arguments": None, "is_error": True}
    tool_log.append(entry)
    if name not in name_map:
        text = unknown_text
    else:
        try:
            args = parse_tool_arguments(raw_args)
        except ToolArgumentsError as e:
            text = f"Error: {e}"
        else:
            entry["arguments"] = args
            result = await env.call_tool(name_map[name], args)
            entry["is_error"] = result.is_error
            if result.truncated:
                entry["truncated"] = True
            text = f"Error: {result.text}" if result.is_error else result.text
    entry["result"] = text
    return entry


class EnvAgentBase:
    """What every environment-backed agent sets up the same way (``AenvAgent``, ``agents/``).

    Subclasses keep their own documented ``__init__`` signature and defaults and pass the
    options through; this validates ``max_turns`` and builds ``config``, ``pool``, ``reward_fn``
    and ``sampling`` (OpenAI Chat Completions parameter names, but ``max_tokens`` is named
    ``max_tokens_param``). The environment is an aenvironment server (``aenv_config``, the
    default) or any MCP server (``mcp_config``; then ``reward_fn`` is required).
    """

    max_tokens_param = "max_tokens"

    def __init__(
        self,
        aenv_config: AenvConfig | dict[str, Any] | None = None,
        *,
        aenv_urls: list[str] | None = None,
        max_turns: int = 3,
        system_prompt: str | None = None,
        reward_fn: Callable[..., Any] | str | None = None,
        gconfig: Any = None,
        temperature: float | None = None,
        top_p: float | None = None,
        max_tokens: int | None = None,
        tool_error_policy: str | None = None,
        model: str | None = None,
        mcp_config: McpConfig | dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(max_turns, int) or isinstance(max_turns, bool) or max_turns < 1:
            raise ValueError(f"max_turns={max_turns!r} must be an integer >= 1")
        self.reward_fn = resolve_reward_fn(reward_fn)
        self.config: Any
        if mcp_config is not None:
            if aenv_config is not None or aenv_urls:
                raise ValueError("give either aenv_config/aenv_urls or mcp_config, not both")
            if self.reward_fn is None:
                raise ValueError(
                    "an MCP server has no reward endpoint: give reward_fn (a callable or an "
                    "import string 'module:function') that scores data, final_answer, tool_calls"
                )
            self.config = make_mcp_config(mcp_config, tool_error_policy=tool_error_policy)
            self.pool: EnvironmentPool = McpEnvironmentPool(self.config)
        else:
            self.config = make_config(aenv_config, tool_error_policy=tool_error_policy)
            self.pool = EnvironmentPool(self.config, aenv_urls)
        self.max_turns = max_turns
        self.system_prompt = system_prompt
        s = sampling_kwargs(gconfig, temperature=temperature, top_p=top_p, max_tokens=max_tokens)
        self.sampling = {
            (self.max_tokens_param if k == "max_tokens" else k): v for k, v in s.items()
        }
        self.model = model

    def model_name(self, extra_kwargs: dict[str, Any]) -> str:
        """The model to request: the workflow's ``model``, else ours, else ``OPENAI_MODEL``."""
        return extra_kwargs.get("model") or self.model or os.environ.get("OPENAI_MODEL", "default")

    @contextlib.asynccontextmanager
    async def openai_client(self, extra_kwargs: dict[str, Any]) -> AsyncIterator[Any]:
        """An ``AsyncOpenAI`` on the injected ``base_url``/``api_key``/``http_client`` (else
        ``OPENAI_BASE_URL``/``OPENAI_API_KEY``); closed on exit unless the HTTP client was
        injected (its owner closes it)."""
        from openai import AsyncOpenAI

        http_client = extra_kwargs.get("http_client")
        client = AsyncOpenAI(
            base_url=extra_kwargs.get("base_url") or os.environ.get("OPENAI_BASE_URL"),
            api_key=extra_kwargs.get("api_key") or os.environ.get("OPENAI_API_KEY", "none"),
            http_client=http_client,
            max_retries=0,  # a retried completion would be recorded twice by the proxy
        )
        try:
            yield client
        finally:
            if http_client is None:
                await client.close()
