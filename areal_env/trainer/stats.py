"""Observability: per-step metrics (JSONL + TensorBoard), a progress bar, the reward-curve PNG and
trajectory dumps.

Files under ``run_dir`` (= ``fileroot/experiment/trial``):
- ``metrics.jsonl``: one JSON object per training step (keys documented in docs/training.md);
- ``tensorboard/``: the same scalars, when ``trainer.tensorboard`` is on;
- ``reward_curve.png``: reward mean (± std band) per step, refreshed every step, and beside it
  the held-out eval curve when there is a ``valid_dataset`` (``eval.jsonl``, see
  ``areal_env.trainer.eval``);
- ``rollout/{version}/{task_id}.jsonl``: one line per completion of the episodes of that item
  that ran on weights ``version`` (``rollout.dump_to_file``);
- ``tokens/``: the per-step token record of every trained row (``rollout.dump_to_file``; see
  ``areal_env.trainer.token_record``);
- ``config.yaml``: the run's configuration, keys and secrets masked (:func:`write_run_config`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Any

from areal_env.api.episode import Episode

logger = logging.getLogger(__name__)


def _jsonable(v: Any) -> Any:
    if hasattr(v, "item") and callable(v.item):
        try:
            v = v.item()
        except (ValueError, RuntimeError):
            return str(v)
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsLogger:
    """Appends a JSON line per step and mirrors numeric values to TensorBoard."""

    def __init__(self, run_dir: str | os.PathLike[str], *, tensorboard: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
            except Exception as e:  # tensorboard missing or broken: metrics.jsonl still works
                logger.warning("TensorBoard disabled: %s", e)

    def truncate_after(self, step: int) -> None:
        """On resume, drop lines of steps after the checkpoint (they will be redone)."""
        if not self.path.is_file():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    keep.append(line)
            except json.JSONDecodeError:
                continue
        self.path.write_text("".join(x + "\n" for x in keep))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def read(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        return [json.loads(x) for x in self.path.read_text().splitlines() if x.strip()]

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


class Progress:
    """A tqdm bar over training steps showing reward and step time (no-op when disabled)."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True) -> None:
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=initial, desc="train", unit="step")

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        if self._bar is None:
            return
        post = {}
        if metrics.get("reward/mean") is not None:
            post["reward"] = f"{metrics['reward/mean']:.3f}"
        if metrics.get("time/step_s") is not None:
            post["step_s"] = f"{metrics['time/step_s']:.1f}"
        self._bar.set_postfix(post, refresh=False)
        self._bar.update(step - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def plot_reward_curve(
    records: list[dict[str, Any]],
    path: str | os.PathLike[str],
    *,
    evals: list[dict[str, Any]] | None = None,
) -> Path | None:
    """Reward mean (± std) per step to a PNG (matplotlib, Agg backend); with ``evals`` (the
    rows of ``eval.jsonl``) a second panel beside it shows the held-out greedy success rate with
    its 95% interval per evaluation. A multi-agent run adds one line per policy to each panel
    (``policy/<name>/reward/mean``, ``policy/<name>/success_rate``). None if there is nothing
    to draw."""
    pts = [
        (r["step"], r["reward/mean"], r.get("reward/std") or 0.0)
        for r in records
        if r.get("reward/mean") is not None
    ]
    evs = [e for e in evals or [] if e.get("success_rate") is not None]
    if not pts and not evs:
        return None
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if evs:
        fig, (ax, ax_eval) = plt.subplots(1, 2, figsize=(12, 4))
    else:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax_eval = None
    if pts:
        steps = [p[0] for p in pts]
        mean = [p[1] for p in pts]
        std = [p[2] for p in pts]
        ax.plot(steps, mean, marker="o", label="reward mean")
        ax.fill_between(
            steps,
            [m - s for m, s in zip(mean, std, strict=True)],
            [m + s for m, s in zip(mean, std, strict=True)],
            alpha=0.2,
        )
        for name in _policy_names(records, "reward/mean"):
            key = f"policy/{name}/reward/mean"
            line = [(r["step"], r[key]) for r in records if r.get(key) is not None]
            ax.plot(*zip(*line, strict=True), marker=".", linestyle="--", label=f"{name} reward")
        ax.legend(loc="best")
    ax.set_xlabel("training step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("reward")
    ax.set_title("training reward per step (mean ± std over the batch)")
    ax.grid(alpha=0.3)
    if ax_eval is not None:
        xs = [e["step"] for e in evs]
        ys = [100 * e["success_rate"] for e in evs]
        lo = [100 * e.get("success_ci_low", e["success_rate"]) for e in evs]
        hi = [100 * e.get("success_ci_high", e["success_rate"]) for e in evs]
        ax_eval.plot(xs, ys, marker="s", color="tab:green", label="held-out success (greedy)")
        ax_eval.fill_between(xs, lo, hi, alpha=0.2, color="tab:green", label="95% CI")
        for name in _policy_names(evs, "success_rate"):
            key = f"policy/{name}/success_rate"
            line = [(e["step"], 100 * e[key]) for e in evs if e.get(key) is not None]
            ax_eval.plot(*zip(*line, strict=True), marker=".", linestyle="--", label=name)
        team = [(e["step"], 100 * e["team/success_rate"]) for e in evs if "team/success_rate" in e]
        if team:
            ax_eval.plot(*zip(*team, strict=True), marker="^", label="team (every policy)")
        n = int(evs[-1].get("n", 0))
        ax_eval.set_title(f"held-out evaluation ({n} problems)")
        ax_eval.set_xlabel("training step")
        ax_eval.set_ylabel("success rate (%)")
        ax_eval.set_ylim(0, 100)
        ax_eval.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax_eval.grid(alpha=0.3)
        ax_eval.legend(loc="best")
    fig.tight_layout()
    out = Path(path)
    tmp = out.with_name(out.stem + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out)
    return out


def _policy_names(records: list[dict[str, Any]], metric: str) -> list[str]:
    """The policies with ``policy/<name>/<metric>`` in some record, in order of appearance."""
    names: dict[str, None] = {}
    tail = "/" + metric
    for r in records:
        for key in r:
            if key.startswith("policy/") and key.endswith(tail):
                names.setdefault(key[len("policy/") : -len(tail)], None)
    return list(names)


def dump_records(root: str | os.PathLike[str], records: list[dict[str, Any]]) -> list[Path]:
    """Append ``records`` to ``root/{version}/{task_id}.jsonl``; each record carries its own
    ``version`` and ``task_id`` keys. Returns the files written."""
    by_file: dict[Path, list[str]] = {}
    base = Path(root)
    for rec in records:
        task = _safe_name(str(rec.get("task_id", "unknown")))
        path = base / str(rec.get("version", 0)) / f"{task}.jsonl"
        by_file.setdefault(path, []).append(json.dumps(rec, default=str))
    for path, lines in by_file.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write("".join(x + "\n" for x in lines))
    return list(by_file)


def _safe_name(name: str) -> str:
    bad = '/\\:*?"<>| \t\n'
    # control characters too: a NUL in a task id made the whole dump raise
    out = "".join("_" if c in bad or ord(c) < 32 else c for c in name).strip(".")
    return out[:128] or "unknown"


def dump_lines(episodes: list[Episode], version: int, step: int) -> list[dict[str, Any]]:
    """Episodes → dump lines: one per completion (or per rejected episode) of a workflow
    episode; one per finished session from an external source (episodes with an ``origin``),
    its completions nested. Token rows are left out (training data, not something to read)."""
    lines: list[dict[str, Any]] = []
    for ep in episodes:
        if ep.origin:
            line: dict[str, Any] = {
                "session_id": ep.session_id,
                "group_id": ep.origin.get("group_id"),
                "group_key": ep.group_id,
                "task_id": ep.task_id or ep.group_id or "external",
                **{k: ep.origin.get(k) for k in ("user", "status", "final_reward", "metadata")},
                "interactions": ep.interactions,
                "stats": ep.export_stats,
                "accepted": ep.accepted,
                "reason": ep.reason,
            }
            lines.append({**line, "version": version, "step": step})
            continue
        base = {
            # the data loader gives every item an id; a workflow may not keep it
            "task_id": "unknown" if ep.task_id is None else ep.task_id,
            "version": version,
            "step": step,
            "group_id": ep.group_id,
            "traj_index": ep.traj_index,
            "guided": ep.guided,
            "session_id": ep.session_id,
            "accepted": ep.accepted,
            "reason": ep.reason,
            "episode_reward": ep.reward,
        }
        if not ep.interactions:
            lines.append({**base, "error": ep.error})
        for it in ep.interactions:
            lines.append(
                {
                    **base,
                    "interaction_id": it.get("id"),
                    "parent_id": it.get("parent_id"),
                    "policy": it.get("policy"),
                    "spliced": it.get("spliced"),
                    "prompt": it.get("prompt_text"),
                    "completion": it.get("completion_text"),
                    "reward": it.get("reward"),
                    # False: left out of the loss (set_reward train=false)
                    "trained": it.get("trained", True),
                    "stop_reason": it.get("stop_reason"),
                    "prompt_len": it.get("num_prompt_tokens"),
                    "completion_len": it.get("num_output_tokens"),
                    "versions": it.get("versions"),
                    **conversation_fields(it),
                }
            )
    return lines


def conversation_fields(interaction: dict[str, Any]) -> dict[str, Any]:
    """What a dump line keeps of an interaction's structure, beyond its text: whether it was
    spliced onto its parent's tokens, the messages it added to the parent's conversation (tool
    results, user turns), the assistant message it produced (parsed tool calls included) and
    its tool calls' validity. ``areal-env view`` draws the conversation tree from these."""
    return {
        "spliced": interaction.get("spliced"),
        "messages": interaction.get("messages"),
        "output": interaction.get("output_message"),
        "tool_calls": interaction.get("tool_calls"),
        "valid_tool_calls": interaction.get("valid_tool_calls"),
        "tool_parse_error": interaction.get("tool_parse_error"),
    }


_SECRET_NAME = re.compile(r"(^|_)(key|keys|secret|secrets|password|token|credentials)$")
_URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.-]*://[^:/@\s]+:)[^@\s]+@", re.IGNORECASE)
MASK = "***"


def mask_secrets(value: Any, name: str = "") -> Any:
    """``value`` with secrets masked: fields named like keys, tokens or passwords (``admin_key``,
    ``api_keys``, ...) and passwords inside URLs (``postgresql://user:***@host``)."""
    if isinstance(value, dict):
        return {k: mask_secrets(v, str(k)) for k, v in value.items()}
    if _SECRET_NAME.search(name.lower()) and value not in (None, "", [], {}):
        return [MASK] * len(value) if isinstance(value, list) else MASK
    if isinstance(value, list | tuple):
        return [mask_secrets(v) for v in value]
    if isinstance(value, str):
        return _URL_PASSWORD.sub(lambda m: m.group("head") + MASK + "@", value)
    return value


def write_run_config(run_dir: str | os.PathLike[str], config: Any) -> Path:
    """``run_dir/config.yaml``: the configuration the run started with (a dataclass), secrets
    masked. The run folder then says how it was made (``areal-env view`` shows it)."""
    import dataclasses

    import yaml

    is_instance = dataclasses.is_dataclass(config) and not isinstance(config, type)
    data = dataclasses.asdict(config) if is_instance else dict(config)
    path = Path(run_dir) / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(".config.yaml.tmp")
    tmp.write_text(yaml.safe_dump(mask_secrets(_plain(data)), sort_keys=False))
    os.replace(tmp, path)
    return path


def _plain(value: Any) -> Any:
    """YAML-safe values: paths and other objects as strings."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)
