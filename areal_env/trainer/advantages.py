"""Rewards → per-token advantages (GRPO-style group normalisation over trajectories).

Why trajectories and not rows: one episode (trajectory) may export several rows (one per
completion with ``export_style="individual"``), and members of one group may export different
numbers of rows, or be rejected altogether. Normalising over rows would weight a trajectory by how
many completions it made. So group statistics are taken over *trajectories* and then applied to
every row of each trajectory.

The rule for rows of one trajectory with different rewards (``rollout.discount < 1`` makes earlier
completions carry discounted rewards): a trajectory's *score* is the mean of its rows' (shaped)
rewards; the group's mean and std are computed over the scores of its trajectories; each row's
advantage is ``(row_reward - group_mean) / (group_std + eps)``. With ``discount = 1`` all rows of
a trajectory share one reward and this is plain GRPO.

Per-turn credit inside one row (``token_rewards``: a ``concat`` row whose turns earned different
returns, e.g. a verifier's credit for a right intermediate tool call): the group statistics are
still taken over trajectory scores (a row's reward is its first turn's return, all the credit it
earned), and each *token* is centred and scaled by them with its own turn's return, so a right
call followed by a wrong answer pushes the call up against a wrong call and the answer down.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

EPS = 1e-6


@dataclass
class AdvantageStats:
    """What the advantage step saw (logged per training step)."""

    n_groups: int
    n_trajectories: int
    zero_variance_groups: int
    """Groups whose trajectories all have the same score (singletons included): no signal."""
    reward_mean: float
    reward_std: float


def shape_rewards(
    rewards: torch.Tensor, *, scaling: float = 1.0, bias: float = 0.0, clip: float | None = None
) -> torch.Tensor:
    """``clip((r + bias) * scaling, -clip, clip)`` — bias first so scaling applies to the sum."""
    out = (rewards.float() + bias) * scaling
    if clip is not None and clip > 0:
        out = out.clamp(-clip, clip)
    return out


def _ids_or_default(ids: torch.Tensor | None, n: int, default: str) -> torch.Tensor:
    if ids is not None:
        return ids.long().view(-1)
    if default == "row":
        return torch.arange(n, dtype=torch.long)
    return torch.zeros(n, dtype=torch.long)


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    traj_ids: torch.Tensor | None = None,
    *,
    mean_norm: bool = True,
    std_norm: bool = True,
    eps: float = EPS,
    token_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, AdvantageStats]:
    """Per-row advantages ``[B]`` from per-row rewards ``[B]``; per-token ``[B, L]`` when
    ``token_rewards`` (each token's return) is given.

    ``group_ids`` missing = the whole batch is one group; ``traj_ids`` missing = every row is its
    own trajectory. The std is the unbiased sample std over the group's trajectory scores. With
    ``mean_norm``, a group without signal — one trajectory (e.g. the rest were rejected), or
    trajectories that all score the same — gets advantage 0 on every row.
    """
    rewards = rewards.float().view(-1)
    n = rewards.numel()
    gids = _ids_or_default(group_ids, n, "batch")
    tids = _ids_or_default(traj_ids, n, "row")
    # what is centred: each row's reward, or each token's return
    values = rewards if token_rewards is None else token_rewards.float()
    if token_rewards is not None and values.shape[0] != n:
        raise ValueError(f"token_rewards has {values.shape[0]} rows, rewards has {n}")
    adv = torch.zeros_like(values)
    zero_var = 0
    groups = torch.unique(gids)
    n_traj_total = 0
    for g in groups.tolist():
        rows = (gids == g).nonzero(as_tuple=True)[0]
        g_tids = tids[rows]
        scores = torch.stack(
            [rewards[rows[g_tids == t]].mean() for t in torch.unique(g_tids).tolist()]
        )
        n_traj_total += scores.numel()
        no_signal = scores.numel() < 2 or float(scores.max() - scores.min()) < eps
        zero_var += no_signal
        if not mean_norm:
            adv[rows] = values[rows]
            continue
        if no_signal:
            # Nothing to compare: advantage 0 for every row. (Rows of one trajectory may still
            # differ, e.g. discounted earlier completions; dividing their spread by a std of 0
            # made advantages of 1e5.)
            continue
        mean = scores.mean()
        centred = values[rows] - mean
        if std_norm:
            std = scores.std(unbiased=True) if scores.numel() > 1 else torch.tensor(0.0)
            centred = centred / (std + eps)
        adv[rows] = centred
    if n == 0:
        reward_mean, reward_std = 0.0, 0.0
    else:
        reward_mean = float(rewards.mean())
        reward_std = float(rewards.std(unbiased=False)) if n > 1 else 0.0
    stats = AdvantageStats(
        n_groups=len(groups),
        n_trajectories=n_traj_total,
        zero_variance_groups=zero_var,
        reward_mean=reward_mean,
        reward_std=reward_std,
    )
    return adv, stats


def token_advantages(
    row_adv: torch.Tensor, loss_mask: torch.Tensor, *, batch_norm: bool = False, eps: float = EPS
) -> torch.Tensor:
    """Broadcast row advantages ``[B]`` onto the row's loss-mask tokens ``[B, L]`` (0
    elsewhere); per-token advantages ``[B, L]`` are masked the same way.

    ``batch_norm`` then normalises over all loss-mask tokens of the batch (mean 0, std 1).
    """
    mask = loss_mask.bool()
    per_token = row_adv.float() if row_adv.dim() == 2 else row_adv.float().view(-1, 1)
    adv = per_token.expand_as(mask) * mask
    if batch_norm and mask.any():
        vals = adv[mask]
        mean = vals.mean()
        std = vals.std(unbiased=False) if vals.numel() > 1 else torch.tensor(0.0)
        adv = torch.where(mask, (adv - mean) / (std + eps), torch.zeros_like(adv))
    return adv


def weight_negatives_by_prob(adv: torch.Tensor, behav_logp: torch.Tensor) -> torch.Tensor:
    """Scale each *negative* token advantage by the probability the token was sampled with.

    Why: the gradient of ``-log p`` for a token lowers its logit and hands its probability to
    the other tokens in proportion to theirs. For a likely token that failed this spreads mass
    out (good); for an unlikely one, such as a rare tool the model tried once, nearly all of it
    goes to the model's favourite, so the failures of rare choices teach "do the usual thing"
    and runs collapse onto one choice. Weighting by ``p`` leaves confident failures pushed down
    fully and makes the push on a rare pick small; positive advantages (and the zeros off the
    loss mask) are untouched.
    """
    prob = behav_logp.float().clamp(max=0.0).exp()
    return torch.where(adv < 0, adv * prob, adv)
