"""Which sampling parameters a recorded completion is generated with (``proxy.sampling``).

The trainer recomputes the logprobs of every trained token under ``softmax(logits / T)``. If the
proxy sampled at another temperature than the one the trainer recomputes with, the PPO ratio is
wrong from the first step, silently. So one policy decides the parameters of each completion
and the chosen logprob temperature is recorded with it (``logprob_temperature``; exported per
row, where the trainer reads it):

- ``trainer`` (default): the experiment's ``gconfig`` decides temperature, top_p and top_k; the
  agent's ``max_tokens`` is kept but capped at ``gconfig.max_new_tokens``. What the agent asked
  for is recorded next to what was used (``requested``), so an override is visible.
- ``agent``: the agent's own parameters are used (unset ones default to 1.0 / off).

``gconfig.choice_exploration`` (exploring the tool a ``required`` call names) and
``gconfig.call_exploration`` (exploring a further call after a tool result) are the trainer's
alone: they apply in ``trainer`` mode to sampled, not greedy, completions and are recorded with
each of them.

A session may carry its own parameters (``/rl/start_session`` ``sampling``): evaluation sessions
are greedy in both modes. Without a trainer gconfig (a stand-alone proxy) the agent decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from areal_env.api.io import GenerationConfig
from areal_env.api.records import field_dict

SAMPLING_MODES = ("trainer", "agent")
_SESSION_KEYS = {"temperature", "top_p", "top_k", "max_new_tokens", "greedy"}


@dataclass(frozen=True)
class Sampling:
    """The parameters one completion is generated with."""

    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    greedy: bool
    choice_exploration: float = 0.0
    """``GenerationConfig.choice_exploration`` (trainer mode only; 0 when greedy)."""
    call_exploration: float = 0.0
    """``GenerationConfig.call_exploration`` (trainer mode only; 0 when greedy)."""

    @property
    def logprob_temperature(self) -> float:
        """The temperature the engine's logprobs are taken at (greedy: 1.0, the raw logits)."""
        return 1.0 if self.greedy else self.temperature

    def as_dict(self) -> dict[str, Any]:
        return field_dict(self)


def validate_session_sampling(value: Any) -> dict[str, Any] | None:
    """Check a session's ``sampling`` object (``ValueError`` naming the bad field)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("'sampling' must be an object with temperature/top_p/top_k/greedy")
    unknown = set(value) - _SESSION_KEYS
    if unknown:
        raise ValueError(
            f"'sampling' has unknown field(s) {sorted(unknown)}; valid: {sorted(_SESSION_KEYS)}"
        )
    out: dict[str, Any] = {}
    for key, v in value.items():
        if key == "greedy":
            if not isinstance(v, bool):
                raise ValueError("'sampling.greedy' must be true or false")
        elif isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"'sampling.{key}' must be a number")
        elif key in ("top_k", "max_new_tokens") and (int(v) != v or v < 0):
            raise ValueError(f"'sampling.{key}' must be a non-negative integer")
        elif key == "temperature" and v < 0:
            raise ValueError("'sampling.temperature' must be >= 0")
        elif key == "top_p" and not (0 < v <= 1):
            raise ValueError("'sampling.top_p' must be in (0, 1]")
        out[key] = v
    return out


def resolve_sampling(
    mode: str,
    trainer_gconfig: GenerationConfig | None,
    session: dict[str, Any] | None,
    *,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    max_tokens: int | None,
    default_max_tokens: int,
) -> Sampling:
    """The parameters of one completion: session > (trainer gconfig | agent request) > defaults.

    ``max_new_tokens`` is not yet bounded by the context length (the caller does that).
    """
    if mode not in SAMPLING_MODES:
        raise ValueError(f"proxy.sampling={mode!r} is invalid; valid: trainer, agent")
    max_new = max_tokens or default_max_tokens
    if mode == "trainer" and trainer_gconfig is not None:
        g = trainer_gconfig
        t, p, k, greedy = g.temperature, g.top_p, g.top_k, g.is_greedy
        explore = float(g.choice_exploration)
        explore_call = float(g.call_exploration)
        max_new = min(max_new, g.max_new_tokens)
    else:
        t = 1.0 if temperature is None else temperature
        p = 1.0 if top_p is None or top_p == 0 else top_p
        k = top_k or 0
        greedy = t == 0 or top_p == 0
        explore = explore_call = 0.0
    if session:
        t = float(session.get("temperature", t))
        p = float(session.get("top_p", p))
        k = int(session.get("top_k", k))
        if "max_new_tokens" in session:
            max_new = min(max_new, int(session["max_new_tokens"]) or max_new)
        greedy = bool(session.get("greedy", greedy)) or t == 0
    return Sampling(
        temperature=float(t),
        top_p=float(p),
        top_k=int(k),
        max_new_tokens=int(max_new),
        greedy=bool(greedy),
        choice_exploration=0.0 if greedy else explore,
        call_exploration=0.0 if greedy else explore_call,
    )
