"""``OpenAIProxyWorkflow``: run an unmodified agent against the proxy and export its trajectory.

One episode = one proxy session: start the session, run ``agent.run(data, ...)`` pointed at the
proxy, turn its return value into rewards, end the session and export the recorded completions
as training rows. Whatever goes wrong inside the agent (exceptions, hangs, bad return values,
no model calls) rejects only that episode: it is logged once per distinct error, counted, and
the method returns ``None`` — training never crashes because of an agent.

Each episode appends one :class:`~areal_env.api.episode.Episode` (its rows, the exported
conversation tree, why it was rejected) to the *episode sink* of the current context
(``episode_sink()``), which the executor and ``GroupedRolloutWorkflow`` open around every
episode; outside a sink episodes are only counted in ``workflow.stats``. ``arun_episode``
returns the rows too (the ``RolloutWorkflow`` contract).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import math
import numbers
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx

from areal_env.api.config import RolloutConfig
from areal_env.api.engine import InferenceEngine
from areal_env.api.episode import Episode
from areal_env.api.rows import TrainingRow, rows_from_export
from areal_env.api.workflow import RolloutWorkflow
from areal_env.http.client import default_ssl_context

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# The episode sink
# --------------------------------------------------------------------------------------------


_EPISODE_SINK: contextvars.ContextVar[list[Episode] | None] = contextvars.ContextVar(
    "areal_env_episode_sink", default=None
)
#: Set by GroupedRolloutWorkflow so member sessions carry the group id to the proxy.
current_group_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "areal_env_group_id", default=None
)
#: Set by GroupedRolloutWorkflow: the member's index in its group (who is guided).
current_member_index: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "areal_env_member_index", default=None
)


@contextlib.contextmanager
def episode_sink() -> Iterator[list[Episode]]:
    """Collect the episodes run in this context (task-local)."""
    sink: list[Episode] = []
    token = _EPISODE_SINK.set(sink)
    try:
        yield sink
    finally:
        _EPISODE_SINK.reset(token)


def record_episode(episode: Episode) -> None:
    """Append ``episode`` to the current sink, if any."""
    sink = _EPISODE_SINK.get()
    if sink is not None:
        sink.append(episode)


_seen_errors: set[tuple[str, ...]] = set()
_seen_lock = threading.Lock()


def log_rejection(reason: str, message: str, tb: str | None = None) -> None:
    """Log a rejected episode: with its traceback the first time an error is seen, then quietly."""
    key = (reason, message[:300])
    with _seen_lock:
        first = key not in _seen_errors
        if first:
            _seen_errors.add(key)
    if first:
        if tb:
            logger.warning("episode rejected (%s): %s\n%s", reason, message, tb.rstrip())
        else:
            logger.warning("episode rejected (%s): %s", reason, message)
    else:
        logger.debug("episode rejected (%s, seen before): %s", reason, message)


def task_id_of(data: Any) -> str | None:
    if isinstance(data, dict):
        for key in ("task_id", "id", "query_id"):
            if data.get(key) is not None:
                return str(data[key])
    return None


# --------------------------------------------------------------------------------------------
# Reward validation
# --------------------------------------------------------------------------------------------


class BadReward(ValueError):
    """The agent's return value cannot be used as a reward."""


def _as_finite(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise BadReward(f"{what} must be a number, got {type(value).__name__}: {value!r:.80}")
    f = float(value)
    if not math.isfinite(f):
        raise BadReward(f"{what} is not finite: {f}")
    return f


def validate_reward(value: Any) -> float | dict[str, float | None]:
    """A float (reward of the last completion) or ``{completion_id: float | None}``; else
    BadReward. ``None`` for a completion: leave it out of the loss (neither rewarded nor blamed,
    e.g. an answer that could not have been right after a wrong tool result)."""
    if isinstance(value, dict):
        if not value:
            raise BadReward("the agent returned an empty reward dict")
        out: dict[str, float | None] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise BadReward(f"reward dict keys must be completion ids (str), got {k!r}")
            out[k] = None if v is None else _as_finite(v, f"reward for {k!r}")
        return out
    if value is None:
        raise BadReward("the agent returned None; return a float or {completion_id: float}")
    return _as_finite(value, "the agent's reward")


# --------------------------------------------------------------------------------------------
# The workflow
# --------------------------------------------------------------------------------------------


class _SharedAsyncClient(httpx.AsyncClient):
    """The httpx client handed to agents; closing it from agent code is a no-op.

    SDK clients close the ``http_client`` they were given (``async with AsyncOpenAI(...)``);
    that must not break the other episodes sharing it.
    """

    async def aclose(self) -> None:  # noqa: D102 - intentionally ignored
        return None

    async def really_close(self) -> None:
        await super().aclose()


def accepted_kwargs(fn: Any, candidates: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``candidates`` that ``fn`` accepts as keyword arguments."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return {}
    params = sig.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return dict(candidates)
    names = {
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return {k: v for k, v in candidates.items() if k in names}


class OpenAIProxyWorkflow(RolloutWorkflow):
    """Runs ``agent.run(data, ...)`` through the proxy, one session per episode.

    ``rollout.mode="inline"``: ``await agent.run(data, base_url=<proxy>/v1, api_key=<session key>,
    http_client=<shared httpx.AsyncClient>)`` (only the keywords ``run`` accepts are passed).
    ``rollout.mode="subproc"``: ``run(data)`` (sync or async) in a worker process whose
    environment has ``OPENAI_BASE_URL``/``OPENAI_API_KEY`` and ``ANTHROPIC_BASE_URL``/
    ``ANTHROPIC_API_KEY`` pointing at the session. Both modes reject an episode that runs longer
    than ``rollout.episode_timeout``.
    """

    sessions_per_episode = 1
    #: Set by the evaluator: episodes are greedy (the session's sampling) and the agent gets
    #: ``is_eval=True`` (it may e.g. skip exploration); nothing of them is trained on.
    eval_mode = False
    #: The proxy session's sampling parameters in eval mode.
    EVAL_SAMPLING: dict[str, Any] = {"greedy": True, "temperature": 0.0}

    def __init__(
        self,
        agent: Any,
        *,
        proxy_base_url: str,
        admin_key: str,
        rollout: RolloutConfig,
        http_client: httpx.AsyncClient | None = None,
        agent_import: str | None = None,
        agent_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if not callable(getattr(agent, "run", None)):
            raise TypeError(f"{agent!r} has no run(data, **extra_kwargs) method")
        self.agent = agent
        self.proxy_base_url = proxy_base_url.rstrip("/")
        self.admin_key = admin_key
        self.rollout = rollout
        self.agent_import = agent_import
        self.agent_kwargs = dict(agent_kwargs or {})
        self._user_client = http_client
        self._clients: dict[int, tuple[Any, _SharedAsyncClient]] = {}
        self._pool: Any = None
        self.stats: Counter[str] = Counter()
        if rollout.mode == "inline" and not inspect.iscoroutinefunction(agent.run):
            raise TypeError(
                f"{type(agent).__name__}.run is synchronous; inline mode needs 'async def run', "
                "or use rollout.mode='subproc'"
            )

    # -- plumbing ------------------------------------------------------------------------------

    def _http_client(self) -> httpx.AsyncClient:
        if self._user_client is not None:
            return self._user_client
        loop = asyncio.get_running_loop()
        owner, client = self._clients.get(id(loop), (None, None))
        if owner is not loop or client is None or client.is_closed:
            client = _SharedAsyncClient(
                timeout=httpx.Timeout(self.rollout.episode_timeout, connect=30.0),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
                verify=default_ssl_context(),
            )
            self._clients[id(loop)] = (loop, client)
        return client

    def _subproc_pool(self) -> Any:
        if self._pool is None:
            from areal_env.workflow.subproc import AgentSpec, SubprocAgentPool

            spec = AgentSpec.from_agent(self.agent, self.agent_import, self.agent_kwargs)
            self._pool = SubprocAgentPool(
                spec, max_workers=max(1, self.rollout.max_concurrent_rollouts)
            )
        return self._pool

    async def aclose(self) -> None:
        """Close the shared HTTP client(s) and stop subprocess workers."""
        clients, self._clients = [c for _, c in self._clients.values()], {}
        for c in clients:
            with contextlib.suppress(Exception):
                await c.really_close()
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await asyncio.to_thread(pool.close)

    # -- one episode ---------------------------------------------------------------------------

    def _reject(self, ep: Episode, reason: str, message: str, tb: str | None = None) -> None:
        ep.accepted = False
        ep.reason = reason
        ep.error = message
        self.stats["rejected"] += 1
        self.stats[f"rejected/{reason}"] += 1
        log_rejection(reason, message, tb)

    async def _call_agent(self, data: dict[str, Any], session: Any) -> Any:
        if self.rollout.mode == "subproc":
            env = {
                "OPENAI_BASE_URL": f"{self.proxy_base_url}/v1",
                "OPENAI_API_KEY": session.api_key,
                "ANTHROPIC_BASE_URL": self.proxy_base_url,
                "ANTHROPIC_API_KEY": session.api_key,
            }
            extra = {
                "base_url": f"{self.proxy_base_url}/v1",
                "api_key": session.api_key,
                "is_eval": self.eval_mode,
            }
            return await self._subproc_pool().run(
                data, env=env, extra=extra, timeout=self.rollout.episode_timeout
            )
        extra = accepted_kwargs(
            self.agent.run,
            {
                "base_url": f"{self.proxy_base_url}/v1",
                "api_key": session.api_key,
                "http_client": self._http_client(),
                "is_eval": self.eval_mode,
            },
        )
        return await asyncio.wait_for(
            self.agent.run(data, **extra), timeout=self.rollout.episode_timeout
        )

    async def arun_episode(
        self, engine: InferenceEngine | None, data: dict[str, Any]
    ) -> list[TrainingRow] | None:
        ep = Episode(task_id=task_id_of(data), group_id=current_group_id.get())
        if engine is not None and hasattr(engine, "get_version"):
            with contextlib.suppress(Exception):
                ep.start_version = int(engine.get_version())
        t0 = time.monotonic()
        try:
            result = await self._episode(data, ep)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the proxy itself failed (start/export): reject, never crash
            self._reject(ep, "proxy_error", f"{type(e).__name__}: {e}", traceback.format_exc())
            result = None
        ep.wall_time = time.monotonic() - t0
        if result is not None:
            ep.accepted = True
            self.stats["accepted"] += 1
        record_episode(ep)
        return result

    def _guide(self, data: Any) -> list[dict[str, Any]] | None:
        """The reference solution this episode is guided by: the data's ``rollout.guide_key``
        field for the first ``rollout.guided_samples`` members of a training group, else None
        (evaluation is never guided)."""
        key, n = self.rollout.guide_key, self.rollout.guided_samples
        index = current_member_index.get()
        if self.eval_mode or not key or not n or index is None or index >= n:
            return None
        guide = data.get(key) if isinstance(data, dict) else None
        return guide or None

    async def _episode(self, data: dict[str, Any], ep: Episode) -> list[TrainingRow] | None:
        from areal_env.proxy.client import OpenAIProxyClient

        guide = self._guide(data)
        async with OpenAIProxyClient(
            self.proxy_base_url,
            self.admin_key,
            http_client=self._http_client(),
            task_id=ep.task_id,
            group_id=ep.group_id,
            sampling=dict(self.EVAL_SAMPLING) if self.eval_mode else None,
            guide=guide,
        ) as session:
            ep.session_id = session.session_id
            try:
                ret = await self._call_agent(data, session)
            except TimeoutError:
                self._reject(
                    ep, "timeout", f"agent ran longer than {self.rollout.episode_timeout}s"
                )
                return None
            except Exception as e:
                tb = getattr(e, "remote_traceback", None) or traceback.format_exc()
                # errors that know why the episode failed say so (e.g. the tool environment's
                # server died: "env_server_died"); the rest are the agent's own errors
                reason = getattr(e, "rejection_reason", None)
                reason = reason if isinstance(reason, str) and reason else "agent_error"
                self._reject(ep, reason, f"{type(e).__name__}: {e}", tb)
                return None
            try:
                reward = validate_reward(ret)
            except BadReward as e:
                self._reject(ep, "bad_reward", str(e))
                return None
            ep.reward = reward
            try:
                if isinstance(reward, dict):
                    for cid, r in reward.items():
                        if r is None:  # left out of the loss; 0 in the earlier turns' returns
                            await session.set_reward(0.0, completion_id=cid, train=False)
                        else:
                            await session.set_reward(r, completion_id=cid)
                else:
                    await session.set_reward(reward)
            except Exception as e:
                exported = await session.export(
                    discount=self.rollout.discount, style=self.rollout.export_style
                )
                if not exported.get("trajectories"):
                    self._reject(ep, "no_completions", "the agent made no model calls")
                else:
                    self._reject(ep, "bad_reward", f"could not set reward {reward!r}: {e}")
                return None
            await session.end()
            exported = await session.export(
                discount=self.rollout.discount, style=self.rollout.export_style
            )
        return self._to_rows(exported, ep)

    def _to_rows(self, exported: dict[str, Any], ep: Episode) -> list[TrainingRow] | None:
        ep.interactions = list(exported.get("interactions") or [])
        # guided where the engine wrote a step of the guide (engines that cannot constrain do not)
        ep.guided = any(it.get("guided") for it in ep.interactions)
        ep.export_stats = dict(exported.get("stats") or {})
        ep.rows = rows_from_export(exported.get("trajectories") or {})
        if not ep.rows:
            self._reject(ep, "no_completions", "the agent made no model calls")
            return None
        return ep.rows
