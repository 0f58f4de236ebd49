"""Held-out evaluation: greedy episodes on ``valid_dataset``, metrics with confidence intervals.

An evaluation runs every held-out item once through the same agent and proxy as training, with
two differences: the proxy session is greedy (``sampling: {"greedy": true}``, whatever the agent
or ``proxy.sampling`` says) and the agent gets ``is_eval=True``. Nothing of it is trained on.

The trainer evaluates before the first step (``trainer.eval_before_training``), every
``trainer.eval_freq_steps`` and after the last step; ``areal-env eval CONFIG --checkpoint DIR``
evaluates a checkpoint (or the base model) on its own. Each evaluation writes

- ``run_dir/eval-rollout/{version}/{task_id}.jsonl``: the episode's completions (prompt and
  completion text, tool calls), its reward and whether it counted as a success;
- ``run_dir/eval-rollout/{version}/summary.json``: the metrics and the per-task outcomes (so two
  evaluations on the same items can be compared pairwise: ``paired_p_value``);
- one line in ``run_dir/eval.jsonl`` (the eval curve).

Metrics (``eval/...``): ``success_rate`` (reward >= ``trainer.eval_success_reward``) with its 95%
Wilson interval ``success_ci_low``/``success_ci_high``, ``reward_mean``, ``valid_tool_call_rate``
(share of attempted tool calls that parsed and named an offered tool), ``tool_call_episodes``
(share of episodes with at least one valid call), ``turns_mean`` (model calls per episode),
``output_tokens_mean``, ``prompt_tokens_mean``, ``n`` and ``rejected``.

A multi-agent run (``policies:``) adds, per policy, ``policy/<name>/reward_mean`` (the mean
reward of its completions in an episode, as training gives them), ``policy/<name>/success_rate``
(episodes where that reaches the success reward) and ``policy/<name>/turns_mean``; and
``team/success_rate``: episodes where every policy succeeded.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_env.api.records import field_dict
from areal_env.trainer.stats import conversation_fields, dump_records

logger = logging.getLogger(__name__)

EVAL_DIR = "eval-rollout"
EVAL_LOG = "eval.jsonl"


# --------------------------------------------------------------------------------------------
# Statistics
# --------------------------------------------------------------------------------------------


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95% for z=1.96); (0, 1) when n=0.

    Unlike the normal approximation it stays inside [0, 1] and is sensible at 0 or n successes,
    which small held-out sets hit often.
    """
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def _binom_two_sided(k: int, n: int) -> float:
    """Exact two-sided p-value of ``k`` successes in ``n`` fair coin flips."""
    if n == 0:
        return 1.0
    k = min(k, n - k)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_p_value(before: dict[str, bool], after: dict[str, bool]) -> float:
    """Exact McNemar test of two evaluations on the same items (keys = task ids).

    The same held-out problems are solved before and after training, so the outcomes are paired:
    only the discordant items (solved by one model, not the other) carry evidence. Returns the
    two-sided p-value of "both models are equally good"; 1.0 when no items are shared.
    """
    shared = before.keys() & after.keys()
    gained = sum(1 for t in shared if after[t] and not before[t])
    lost = sum(1 for t in shared if before[t] and not after[t])
    return _binom_two_sided(gained, gained + lost)


def two_proportion_p_value(k1: int, n1: int, k2: int, n2: int) -> float:
    """Two-sided z-test of two independent proportions (for unpaired samples)."""
    if n1 == 0 or n2 == 0:
        return 1.0
    p = (k1 + k2) / (n1 + n2)
    se = math.sqrt(p * (1 - p) * (1 / n1 + 1 / n2))
    if se == 0:
        return 1.0
    z = abs(k1 / n1 - k2 / n2) / se
    return math.erfc(z / math.sqrt(2))


# --------------------------------------------------------------------------------------------
# Episode records -> metrics
# --------------------------------------------------------------------------------------------


def _reward_value(reward: Any) -> float | None:
    if isinstance(reward, dict):  # {completion_id: reward}: the episode's best
        values = [float(v) for v in reward.values() if isinstance(v, int | float)]
        return max(values) if values else None
    if isinstance(reward, int | float) and not isinstance(reward, bool):
        return float(reward)
    return None


@dataclass
class EvalResult:
    """One evaluation: its metrics and each task's outcome, on the held-out set and, in
    ``extra``, on each named extra held-out set (``extra_valid_datasets``)."""

    version: int
    step: int
    metrics: dict[str, float]
    outcomes: dict[str, bool] = field(default_factory=dict)
    """task id -> success."""
    rewards: dict[str, float] = field(default_factory=dict)
    extra: dict[str, EvalResult] = field(default_factory=dict)
    """Set name -> that set's evaluation (same version and step)."""

    def to_dict(self) -> dict[str, Any]:
        out = field_dict(self, exclude=("extra",))
        out["extra"] = {name: r.to_dict() for name, r in self.extra.items()}
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EvalResult:
        return cls(
            int(d["version"]),
            int(d["step"]),
            d["metrics"],
            d["outcomes"],
            d.get("rewards", {}),
            {name: cls.from_dict(x) for name, x in (d.get("extra") or {}).items()},
        )

    def flat_metrics(self) -> dict[str, float]:
        """The held-out set's metrics, and each extra set's as ``<set>/<metric>``."""
        out = dict(self.metrics)
        for name, r in self.extra.items():
            out.update({f"{name}/{k}": v for k, v in r.metrics.items()})
        return out


def episode_metrics(
    episodes: list[dict[str, Any]], success_reward: float = 1.0
) -> tuple[dict[str, float], dict[str, bool], dict[str, float]]:
    """Metrics of a list of episode records (``Episode.to_dict()``) and per-task outcomes.

    A rejected episode (agent error, timeout, no model call) counts as a failure with reward 0:
    leaving it out would flatter the model.
    """
    n = len(episodes)
    outcomes: dict[str, bool] = {}
    rewards: dict[str, float] = {}
    calls_ok = calls_bad = tool_eps = turns = out_tok = prompt_tok = rejected = 0
    for i, ep in enumerate(episodes):
        task = str(ep.get("task_id") or f"item-{i}")
        r = _reward_value(ep.get("reward")) if ep.get("accepted") else None
        rejected += not ep.get("accepted")
        value = 0.0 if r is None else r
        rewards[task] = value
        outcomes[task] = value >= success_reward
        its = ep.get("interactions") or []
        turns += len(its)
        ep_ok = 0
        for it in its:
            out_tok += int(it.get("num_output_tokens") or 0)
            prompt_tok += int(it.get("num_prompt_tokens") or 0)
            names = it.get("tool_calls") or []
            valid = it.get("valid_tool_calls")
            ok = len(names) if valid is None else int(valid)
            ep_ok += ok
            calls_ok += ok
            calls_bad += len(names) - ok + bool(it.get("tool_parse_error"))
        tool_eps += ep_ok > 0
    k = sum(outcomes.values())
    lo, hi = wilson_interval(k, n)
    attempts = calls_ok + calls_bad
    metrics = {
        "n": float(n),
        "successes": float(k),
        "success_rate": k / n if n else 0.0,
        "success_ci_low": lo,
        "success_ci_high": hi,
        "reward_mean": sum(rewards.values()) / n if n else 0.0,
        "valid_tool_call_rate": calls_ok / attempts if attempts else 0.0,
        "tool_calls_per_episode": calls_ok / n if n else 0.0,
        "tool_call_episodes": tool_eps / n if n else 0.0,
        "turns_mean": turns / n if n else 0.0,
        "output_tokens_mean": out_tok / n if n else 0.0,
        "prompt_tokens_mean": prompt_tok / max(turns, 1),
        "rejected": float(rejected),
    }
    return metrics, outcomes, rewards


def policy_metrics(episodes: list[Any], success_reward: float = 1.0) -> dict[str, float]:
    """Per-policy figures of evaluation episodes (``Episode`` objects with their rows): each
    policy's reward in an episode is the mean reward of its rows there; an episode it took no
    part in (rejected, or the agent did not call it) counts as 0."""
    names: dict[str, None] = {}
    for e in episodes:
        for r in e.rows:
            if r.policy is not None:
                names.setdefault(r.policy, None)
    n = len(episodes)
    out: dict[str, float] = {}
    team = [bool(names)] * n
    for name in names:
        rewards, turns = [], 0
        for i, e in enumerate(episodes):
            own = [r.reward for r in e.rows if r.policy == name] if e.accepted else []
            rewards.append(sum(own) / len(own) if own else 0.0)
            team[i] = team[i] and rewards[-1] >= success_reward
            turns += sum(1 for it in e.interactions if it.get("policy") == name)
        p = f"policy/{name}/"
        out[p + "reward_mean"] = sum(rewards) / n if n else 0.0
        out[p + "success_rate"] = sum(r >= success_reward for r in rewards) / n if n else 0.0
        out[p + "turns_mean"] = turns / n if n else 0.0
    if names:
        out["team/success_rate"] = sum(team) / n if n else 0.0
    return out


# --------------------------------------------------------------------------------------------
# The evaluator
# --------------------------------------------------------------------------------------------


def eval_items(items: list[dict[str, Any]], prefix: str = "valid") -> list[dict[str, Any]]:
    """Held-out items with a task id each (``{prefix}-{i}`` when an item has none)."""
    out = []
    for i, it in enumerate(items):
        if not any(it.get(k) is not None for k in ("task_id", "id", "query_id")):
            it = {**it, "task_id": f"{prefix}-{i}"}
        out.append(it)
    return out


def _task_id(item: dict[str, Any]) -> str:
    return str(next(item[k] for k in ("task_id", "id", "query_id") if item.get(k) is not None))


def _unwrap_proxy_workflow(workflow: Any) -> Any:
    inner = workflow
    while hasattr(inner, "inner"):
        inner = inner.inner
    return inner


class Evaluator:
    """Runs greedy evaluation episodes of ``workflow`` on ``items`` through the proxy.

    ``workflow``: an ungrouped workflow (``resolve_workflow(..., rollout=<n_samples=1>)``); when
    it is an ``OpenAIProxyWorkflow`` it is switched to eval mode (greedy sessions, ``is_eval``).
    A workflow that does not run through the proxy is evaluated as it samples. ``extra_sets``:
    named held-out sets evaluated beside ``items`` (in the same rollout) and reported apart, e.g.
    new phrasings of the same tasks: a gain that only fits the training templates shows there.
    """

    def __init__(
        self,
        engine: Any,
        workflow: Any,
        items: list[dict[str, Any]],
        rollout: Any,
        run_dir: str | Path,
        *,
        proxy_base_url: str | None,
        admin_key: str | None,
        success_reward: float = 1.0,
        show_progress: bool = True,
        extra_sets: dict[str, list[dict[str, Any]]] | None = None,
    ) -> None:
        from areal_env.workflow.executor import RolloutExecutor

        inner = _unwrap_proxy_workflow(workflow)
        if hasattr(inner, "eval_mode"):
            inner.eval_mode = True
        else:
            logger.warning(
                "%s does not run through the proxy: evaluation samples as the workflow does "
                "(not greedy)",
                type(inner).__name__,
            )
        self.items = eval_items(list(items))
        if not self.items:
            raise ValueError("evaluation needs at least one held-out item (valid_dataset)")
        self.extra_sets = {
            name: eval_items(list(xs), prefix=name) for name, xs in (extra_sets or {}).items()
        }
        seen: dict[str, str] = {_task_id(it): "valid_dataset" for it in self.items}
        for name, xs in self.extra_sets.items():
            if not xs:
                raise ValueError(f"the held-out set {name!r} has no items")
            for it in xs:
                other = seen.setdefault(_task_id(it), name)
                if other != name:
                    raise ValueError(
                        f"task id {_task_id(it)!r} is in the held-out sets {other!r} and "
                        f"{name!r}: held-out sets must not share task ids"
                    )
        self.run_dir = Path(run_dir)
        self.success_reward = success_reward
        self.executor = RolloutExecutor(
            engine,
            workflow,
            rollout,
            proxy_base_url=proxy_base_url,
            admin_key=admin_key,
            show_progress=show_progress,
        )
        self.history: list[EvalResult] = []

    async def aclose(self) -> None:
        await self.executor.aclose()

    async def evaluate(self, *, version: int, step: int) -> EvalResult:
        """Evaluate the engine's current weights (``version``) on every item."""
        t0 = time.perf_counter()
        every = self.items + [it for xs in self.extra_sets.values() for it in xs]
        logger.info("evaluating version %d on %d held-out items (greedy)", version, len(every))
        self.executor.set_version(version)
        batch = await self.executor.rollout_batch(every, trainer_version=version)
        episodes = [e.to_dict() for e in batch.episodes]
        elapsed = time.perf_counter() - t0
        result = self._result(version, step, self.items, episodes, elapsed)
        main_ids = {_task_id(it) for it in self.items}
        mine = [e for e in batch.episodes if str(e.task_id) in main_ids]
        result.metrics.update(policy_metrics(mine, self.success_reward))
        for name, xs in self.extra_sets.items():
            result.extra[name] = self._result(version, step, xs, episodes, elapsed)
        if self.history:
            first = self.history[0]
            result.metrics["p_value_vs_first"] = paired_p_value(first.outcomes, result.outcomes)
            for name, r in result.extra.items():
                if name in first.extra:
                    r.metrics["p_value_vs_first"] = paired_p_value(
                        first.extra[name].outcomes, r.outcomes
                    )
        self.history.append(result)
        self._write(result, episodes)
        for key in sorted(k for k in result.metrics if k.endswith("/success_rate")):
            logger.info("eval v%d: %s %.1f%%", version, key, 100 * result.metrics[key])
        for name, r in [("held-out", result), *result.extra.items()]:
            m = r.metrics
            logger.info(
                "eval v%d %s: success %.1f%% (95%% CI %.1f-%.1f%%) of %d, reward %.3f, valid "
                "tool calls %.1f%%, turns %.2f (%.0f s)",
                version,
                name,
                100 * m["success_rate"],
                100 * m["success_ci_low"],
                100 * m["success_ci_high"],
                int(m["n"]),
                m["reward_mean"],
                100 * m["valid_tool_call_rate"],
                m["turns_mean"],
                m["time_s"],
            )
        return result

    def _result(
        self,
        version: int,
        step: int,
        items: list[dict[str, Any]],
        episodes: list[dict[str, Any]],
        elapsed: float,
    ) -> EvalResult:
        """The evaluation of one held-out set: its items' episodes only."""
        ids = {_task_id(it) for it in items}
        mine = [ep for ep in episodes if str(ep.get("task_id")) in ids]
        metrics, outcomes, rewards = episode_metrics(mine, self.success_reward)
        metrics["time_s"] = elapsed
        return EvalResult(version, step, metrics, outcomes, rewards)

    def _write(self, result: EvalResult, episodes: list[dict[str, Any]]) -> None:
        root = self.run_dir / EVAL_DIR
        version_dir = root / str(result.version)
        try:
            if version_dir.is_dir():  # a redone evaluation (resume) replaces the old one
                for old in version_dir.glob("*.jsonl"):
                    old.unlink()
            lines = []
            rewards, outcomes, set_of = dict(result.rewards), dict(result.outcomes), {}
            for name, r in result.extra.items():
                rewards.update(r.rewards)
                outcomes.update(r.outcomes)
                set_of.update(dict.fromkeys(r.outcomes, name))
            for ep in episodes:
                task = str(ep.get("task_id") or "unknown")
                base = {
                    "task_id": task,
                    "version": result.version,
                    "step": result.step,
                    "eval_set": set_of.get(task),
                    "accepted": ep.get("accepted"),
                    "reason": ep.get("reason"),
                    "error": ep.get("error"),
                    "episode_reward": rewards.get(task),
                    "success": outcomes.get(task),
                }
                its = ep.get("interactions") or []
                if not its:
                    lines.append(base)
                for it in its:
                    lines.append(
                        {
                            **base,
                            "interaction_id": it.get("id"),
                            "parent_id": it.get("parent_id"),
                            "policy": it.get("policy"),
                            "prompt": it.get("prompt_text"),
                            "completion": it.get("completion_text"),
                            "stop_reason": it.get("stop_reason"),
                            "prompt_len": it.get("num_prompt_tokens"),
                            "completion_len": it.get("num_output_tokens"),
                            "reward": it.get("reward"),
                            **conversation_fields(it),
                        }
                    )
            dump_records(root, lines)
            version_dir.mkdir(parents=True, exist_ok=True)
            (version_dir / "summary.json").write_text(json.dumps(result.to_dict(), indent=1))
            with (self.run_dir / EVAL_LOG).open("a") as f:
                line = {"step": result.step, "version": result.version, **result.flat_metrics()}
                f.write(json.dumps(line) + "\n")
        except OSError as e:  # a full disk must not stop training
            logger.warning("writing the evaluation of version %d failed: %s", result.version, e)


def read_eval_log(run_dir: str | Path) -> list[dict[str, Any]]:
    """The evaluations of a run (``eval.jsonl``), oldest first."""
    path = Path(run_dir) / EVAL_LOG
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def read_eval_summary(run_dir: str | Path, version: int) -> EvalResult | None:
    """A stored evaluation (``eval-rollout/{version}/summary.json``), or None."""
    path = Path(run_dir) / EVAL_DIR / str(version) / "summary.json"
    if not path.is_file():
        return None
    return EvalResult.from_dict(json.loads(path.read_text()))


def truncate_eval_log(run_dir: str | Path, step: int) -> None:
    """On resume, drop evaluations after ``step`` (they will be redone); ``-1``: a fresh start
    drops them all, with their dumps."""
    run_dir = Path(run_dir)
    kept = [e for e in read_eval_log(run_dir) if int(e.get("step", 0)) <= step]
    path = run_dir / EVAL_LOG
    if path.is_file():
        path.write_text("".join(json.dumps(e) + "\n" for e in kept))
    root = run_dir / EVAL_DIR
    if root.is_dir():
        keep = {str(e.get("version")) for e in kept}
        for d in root.iterdir():
            if d.is_dir() and d.name not in keep:
                shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Stand-alone evaluation (``areal-env eval``)
# --------------------------------------------------------------------------------------------


def resolve_checkpoint(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """The HF model folder of ``path`` and its trainer state ({} when there is none).

    ``path`` may be an HF folder, a checkpoint (``checkpoints/step_N``, its ``model/`` is used),
    a checkpoints folder or a run folder (their latest checkpoint).
    """
    from areal_env.trainer import checkpoint as ckpt

    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"checkpoint {str(p)!r} does not exist")
    for cand in (p, p / "checkpoints"):
        if (cand / ckpt.LATEST).is_file():
            found = ckpt.latest_checkpoint(cand)
            if found is not None:
                p = Path(found)
                break
    state: dict[str, Any] = {}
    if (p / ckpt.STATE_FILE).is_file():
        state = json.loads((p / ckpt.STATE_FILE).read_text())
    if (p / ckpt.MODEL_DIR / "config.json").is_file():
        return p / ckpt.MODEL_DIR, state
    if (p / "config.json").is_file():
        return p, state
    raise FileNotFoundError(
        f"{str(p)!r} is neither a Hugging Face model folder (config.json) nor a checkpoint "
        "(model/config.json) nor a run folder with checkpoints/latest"
    )


async def arun_evaluation(
    cfg: Any,
    items: list[dict[str, Any]],
    *,
    checkpoint: str | Path | None = None,
    workflow: Any = None,
    workflow_kwargs: dict[str, Any] | None = None,
    out_dir: str | Path | None = None,
) -> EvalResult:
    """Evaluate ``checkpoint`` (default: ``cfg.model.path``, the base model) on ``items``.

    Starts the engine and the proxy of ``cfg``, runs one greedy episode of the workflow per
    item, writes the dumps and summary under ``out_dir`` (default: ``run_dir/eval-<label>``)
    and stops everything again. With ``policies:`` every policy is served under its name: a
    checkpoint's as trained, else (the base model) each answered by the base model itself.
    """
    if cfg.policies:
        return await _evaluate_policies(cfg, items, checkpoint, workflow, workflow_kwargs, out_dir)
    import asyncio
    import dataclasses

    from areal_env.engine.factory import create_engine
    from areal_env.engine.models import resolve_model_path
    from areal_env.proxy.server import ProxyServer
    from areal_env.workflow.resolve import resolve_workflow

    version, label = 0, "base"
    if checkpoint is not None:
        model_dir, state = resolve_checkpoint(checkpoint)
        version = int(state.get("version", 0))
        label = Path(model_dir).parent.name if model_dir.name == "model" else model_dir.name
    else:
        model_dir = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(model_dir)))
    spec = workflow if workflow is not None else cfg.workflow
    if spec is None:
        raise ValueError("no workflow to evaluate: set `workflow` in the config")
    kwargs = workflow_kwargs if workflow_kwargs is not None else dict(cfg.workflow_kwargs)
    out = Path(out_dir) if out_dir is not None else cfg.run_dir / f"eval-{label}"
    engine = create_engine(cfg)
    await asyncio.to_thread(engine.initialize)
    proxy = None
    evaluator = None
    try:
        if hasattr(engine, "set_version"):
            engine.set_version(version)
        pcfg = dataclasses.replace(cfg.proxy, initial_capacity=0)
        proxy = ProxyServer(engine, engine.tokenizer, pcfg, train_gconfig=cfg.gconfig).start()
        rollout = dataclasses.replace(cfg.rollout, n_samples=1)
        wf = resolve_workflow(
            spec,
            kwargs,
            rollout=rollout,
            proxy_base_url=proxy.base_url,
            admin_key=proxy.admin_key,
        )
        evaluator = Evaluator(
            engine,
            wf,
            items,
            rollout,
            out,
            proxy_base_url=proxy.base_url,
            admin_key=proxy.admin_key,
            success_reward=cfg.trainer.eval_success_reward,
            show_progress=cfg.trainer.progress,
        )
        truncate_eval_log(out, -1)
        return await evaluator.evaluate(version=version, step=0)
    finally:
        if evaluator is not None:
            await evaluator.aclose()
        if proxy is not None:
            proxy.stop()
        engine.destroy()


def _policy_step(path: str | Path) -> Path:
    """The ``step_N`` folder of a multi-agent checkpoint at ``path`` (itself, or the latest
    under a checkpoints or run folder)."""
    from areal_env.engine.policies import saved_policies
    from areal_env.trainer import checkpoint as ckpt

    p = Path(path).expanduser()
    for cand in (p, p / "checkpoints"):
        if saved_policies(cand):
            return cand
        if (cand / ckpt.LATEST).is_file():
            found = ckpt.latest_checkpoint(cand)
            if found is not None and saved_policies(found):
                return found
    raise FileNotFoundError(
        f"{str(p)!r} is not a checkpoint of a run with policies (step_N/policies/<name>/), "
        "nor a run or checkpoints folder with one"
    )


async def _evaluate_policies(
    cfg: Any,
    items: list[dict[str, Any]],
    checkpoint: str | Path | None,
    workflow: Any,
    workflow_kwargs: dict[str, Any] | None,
    out_dir: str | Path | None,
) -> EvalResult:
    """``arun_evaluation`` of a multi-agent run: every policy's engine, one proxy routing by
    ``model``."""
    import asyncio
    import dataclasses

    from areal_env.engine.policies import PolicyEngines
    from areal_env.proxy.policies import PolicyEndpoint
    from areal_env.proxy.server import ProxyServer
    from areal_env.trainer import checkpoint as ckpt
    from areal_env.workflow.resolve import resolve_workflow

    version, label = 0, "base"
    if checkpoint is not None:
        step = _policy_step(checkpoint)
        version = int(ckpt.load_trainer_state(step).get("version", 0))
        label = step.name
        engines = PolicyEngines.from_checkpoint(cfg, step)
    else:
        engines = PolicyEngines.from_config(cfg, base_weights=True)
    spec = workflow if workflow is not None else cfg.workflow
    if spec is None:
        raise ValueError("no workflow to evaluate: set `workflow` in the config")
    kwargs = workflow_kwargs if workflow_kwargs is not None else dict(cfg.workflow_kwargs)
    out = Path(out_dir) if out_dir is not None else cfg.run_dir / f"eval-{label}"
    proxy = evaluator = None
    try:
        await asyncio.to_thread(engines.initialize)
        engines.set_version(version)
        endpoints = {
            name: PolicyEndpoint(engine, engines.tokenizer(name))
            for name, engine in engines.routes.items()
        }
        pcfg = dataclasses.replace(cfg.proxy, initial_capacity=0)
        base = engines.base
        proxy = ProxyServer(
            base, base.tokenizer, pcfg, train_gconfig=cfg.gconfig, policies=endpoints
        ).start()
        rollout = dataclasses.replace(cfg.rollout, n_samples=1)
        addr = {"proxy_base_url": proxy.base_url, "admin_key": proxy.admin_key}
        wf = resolve_workflow(spec, kwargs, rollout=rollout, **addr)
        evaluator = Evaluator(
            base,
            wf,
            items,
            rollout,
            out,
            success_reward=cfg.trainer.eval_success_reward,
            show_progress=cfg.trainer.progress,
            proxy_base_url=proxy.base_url,
            admin_key=proxy.admin_key,
        )
        truncate_eval_log(out, -1)
        return await evaluator.evaluate(version=version, step=0)
    finally:
        if evaluator is not None:
            await evaluator.aclose()
        if proxy is not None:
            proxy.stop()
        engines.destroy()


def format_result(result: EvalResult, out_dir: str | Path | None = None) -> str:
    """A short human-readable report of one evaluation."""
    m = result.metrics
    lines = [
        f"held-out evaluation of version {result.version}: {int(m['n'])} problems, greedy",
        f"  success rate       {100 * m['success_rate']:5.1f}%  (95% CI "
        f"{100 * m['success_ci_low']:.1f}-{100 * m['success_ci_high']:.1f}%)",
        f"  mean reward        {m['reward_mean']:.3f}",
        f"  valid tool calls   {100 * m['valid_tool_call_rate']:5.1f}% of attempted calls; "
        f"{100 * m['tool_call_episodes']:.1f}% of episodes made one",
        f"  mean turns         {m['turns_mean']:.2f}",
        f"  tokens/episode     {m['output_tokens_mean']:.1f} generated "
        f"(prompt {m['prompt_tokens_mean']:.0f} per turn)",
    ]
    if m.get("rejected"):
        lines.append(f"  rejected episodes  {int(m['rejected'])} (counted as failures)")
    for key in sorted(k for k in m if k.startswith("policy/") and k.endswith("/success_rate")):
        name = key[len("policy/") : -len("/success_rate")]
        lines.append(
            f"  policy {name:<11}success {100 * m[key]:5.1f}%, reward "
            f"{m[f'policy/{name}/reward_mean']:.3f}, turns {m[f'policy/{name}/turns_mean']:.2f}"
        )
    if out_dir is not None:
        lines.append(f"  dumps and summary  {Path(out_dir) / EVAL_DIR / str(result.version)}")
    return "\n".join(lines)


def compare_evaluations(before: EvalResult, after: EvalResult) -> dict[str, float]:
    """Before/after figures of two evaluations on the same items, with the paired p-value."""
    shared = before.outcomes.keys() & after.outcomes.keys()
    return {
        "n": float(len(shared)),
        "success_before": before.metrics["success_rate"],
        "success_after": after.metrics["success_rate"],
        "gained": float(sum(1 for t in shared if after.outcomes[t] and not before.outcomes[t])),
        "lost": float(sum(1 for t in shared if before.outcomes[t] and not after.outcomes[t])),
        "p_value": paired_p_value(before.outcomes, after.outcomes),
    }


def format_before_after(before: EvalResult, after: EvalResult) -> str:
    """The before/after table ``make demo`` prints (held-out, greedy)."""
    cmp = compare_evaluations(before, after)
    b, a = before.metrics, after.metrics

    def pct(m: dict[str, float], key: str) -> str:
        return f"{100 * m[key]:.1f}%"

    def ci(m: dict[str, float]) -> str:
        return f"{100 * m['success_ci_low']:.0f}-{100 * m['success_ci_high']:.0f}%"

    rows = [
        ("success rate", pct(b, "success_rate"), pct(a, "success_rate")),
        ("  95% CI", ci(b), ci(a)),
        ("mean reward", f"{b['reward_mean']:.3f}", f"{a['reward_mean']:.3f}"),
        ("valid tool calls", pct(b, "valid_tool_call_rate"), pct(a, "valid_tool_call_rate")),
        (
            "tool calls / episode",
            f"{b['tool_calls_per_episode']:.2f}",
            f"{a['tool_calls_per_episode']:.2f}",
        ),
        ("mean turns", f"{b['turns_mean']:.2f}", f"{a['turns_mean']:.2f}"),
        ("tokens / episode", f"{b['output_tokens_mean']:.1f}", f"{a['output_tokens_mean']:.1f}"),
    ]
    width = max(len(r[0]) for r in rows) + 2
    lines = [
        f"held-out problems: {int(cmp['n'])}, greedy "
        f"(before = version {before.version}, after = version {after.version})",
        f"{'':<{width}}{'before':>10}{'after':>10}",
    ]
    lines += [f"{name:<{width}}{x:>10}{y:>10}" for name, x, y in rows]
    delta = 100 * (cmp["success_after"] - cmp["success_before"])
    lines.append(
        f"success {delta:+.1f} points: {int(cmp['gained'])} problems gained, "
        f"{int(cmp['lost'])} lost; p = {cmp['p_value']:.2g} (exact McNemar test, paired)"
    )
    for name, b_set in before.extra.items():
        a_set = after.extra.get(name)
        if a_set is None:
            continue
        c = compare_evaluations(b_set, a_set)
        lines.append(
            f"{name} ({int(c['n'])} problems): {100 * c['success_before']:.1f}% -> "
            f"{100 * c['success_after']:.1f}% ({100 * (c['success_after'] - c['success_before']):+.1f}"
            f" points): {int(c['gained'])} gained, {int(c['lost'])} lost; p = {c['p_value']:.2g}"
        )
    return "\n".join(lines)
