"""Advantages against hand-computed values: unequal rows per trajectory, partial groups, discount."""

from __future__ import annotations

import math

import pytest
import torch

from areal_env.trainer.advantages import group_advantages, shape_rewards, token_advantages


def _t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


def test_unequal_rows_per_trajectory_normalise_over_trajectories():
    # group 0: traj 0 exported 2 rows (reward 1), traj 1 one row (0), traj 2 three rows (0).
    rewards = _t([1, 1, 0, 0, 0, 0])
    gids = _t([0, 0, 0, 0, 0, 0], torch.int64)
    tids = _t([0, 0, 1, 2, 2, 2], torch.int64)
    adv, st = group_advantages(rewards, gids, tids, eps=0.0)
    # scores [1, 0, 0]: mean 1/3, unbiased std sqrt(1/3)
    std = math.sqrt(1 / 3)
    hi, lo = (2 / 3) / std, -(1 / 3) / std
    assert adv.tolist() == pytest.approx([hi, hi, lo, lo, lo, lo], abs=1e-6)
    # Row-level normalisation would have given traj 0 a different value: make sure we did not.
    row_mean = rewards.mean()
    assert float(adv[0]) != pytest.approx(float((1 - row_mean) / rewards.std()), abs=1e-3)
    assert st.n_groups == 1 and st.n_trajectories == 3 and st.zero_variance_groups == 0


def test_partially_rejected_and_zero_variance_groups():
    rewards = _t([1.0, 0.5, 0.5, 1.0, 0.0])
    gids = _t([7, 8, 8, 9, 9], torch.int64)  # group 7 lost all members but one
    tids = _t([0, 1, 2, 3, 4], torch.int64)
    adv, st = group_advantages(rewards, gids, tids)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    # group 9: scores [1, 0]: mean .5, unbiased std sqrt(.5)
    assert adv[3:].tolist() == pytest.approx(
        [0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5)], abs=1e-5
    )
    assert st.zero_variance_groups == 2  # the singleton and the all-equal group
    assert st.n_groups == 3


def test_discounted_rows_use_trajectory_level_stats():
    # traj A: three completions with discounted rewards .81 .9 1; traj B: one completion, reward 0
    rewards = _t([0.81, 0.9, 1.0, 0.0])
    gids = _t([0, 0, 0, 0], torch.int64)
    tids = _t([0, 0, 0, 1], torch.int64)
    adv, _ = group_advantages(rewards, gids, tids, eps=0.0)
    score_a = (0.81 + 0.9 + 1.0) / 3  # a trajectory's score is the mean of its rows
    mean = (score_a + 0.0) / 2
    std = math.sqrt(((score_a - mean) ** 2 + (0.0 - mean) ** 2) / 1)
    expected = [(r - mean) / std for r in (0.81, 0.9, 1.0, 0.0)]
    assert adv.tolist() == pytest.approx(expected, abs=1e-5)


def test_mean_only_and_no_normalisation():
    rewards = _t([1.0, 0.0, 0.0, 0.0])
    gids = _t([0, 0, 0, 0], torch.int64)
    adv, _ = group_advantages(rewards, gids, None, std_norm=False)
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])
    adv, _ = group_advantages(rewards, gids, None, mean_norm=False)
    assert adv.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_reward_shaping_and_token_broadcast():
    shaped = shape_rewards(_t([1.0, -30.0, 5.0]), scaling=2.0, bias=1.0, clip=10.0)
    assert shaped.tolist() == [4.0, -10.0, 10.0]
    loss_mask = _t([[0, 1, 1, 0], [0, 0, 1, 1]], torch.int32)
    tok = token_advantages(_t([2.0, -1.0]), loss_mask)
    assert tok.tolist() == [[0, 2, 2, 0], [0, 0, -1, -1]]
    normed = token_advantages(_t([2.0, -1.0]), loss_mask, batch_norm=True, eps=0.0)
    vals = normed[loss_mask.bool()]
    assert float(vals.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(vals.std(unbiased=False)) == pytest.approx(1.0, abs=1e-5)
    assert normed[~loss_mask.bool()].abs().sum() == 0


def test_groups_without_signal_get_zero_advantage_even_when_their_rows_differ():
    """Discounted completions of one trajectory differ while the group's scores do not: their
    spread divided by a std of 0 gave advantages of 1e5 (and grad norms of 1e6)."""
    # group 0: one trajectory of three discounted completions; group 1: two trajectories with
    # the same score, each of two discounted completions; group 2 has signal.
    rewards = _t([0.81, 0.9, 1.0, 0.9, 1.0, 0.9, 1.0, 1.0, 0.0])
    gids = _t([0, 0, 0, 1, 1, 1, 1, 2, 2], torch.int64)
    tids = _t([0, 0, 0, 1, 1, 2, 2, 3, 4], torch.int64)
    adv, st = group_advantages(rewards, gids, tids)
    assert adv[:7].tolist() == [0.0] * 7
    assert adv[7:].tolist() == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2)], abs=1e-5)
    assert st.zero_variance_groups == 2
    assert float(adv.abs().max()) < 1.0


def test_per_turn_returns_centre_each_token_by_its_own_turn():
    """Per-turn credit in one row: the group statistics come from the trajectories' scores (a
    row's reward: its first turn's return), each token is centred with its own turn's return."""
    # traj 0: a right call (credit .25) then a wrong answer: call tokens .25, answer tokens 0
    # traj 1: a wrong call then a wrong answer: 0 everywhere
    # traj 2: a right call and a right answer: call tokens 1.25, answer tokens 1
    rewards = _t([0.25, 0.0, 1.25])
    token_rewards = _t([[0.25, 0.25, 0.0, 0.0], [0, 0, 0, 0], [1.25, 1.25, 1.0, 1.0]])
    gids = _t([0, 0, 0], torch.int64)
    adv, st = group_advantages(rewards, gids, None, eps=0.0, token_rewards=token_rewards)
    assert adv.shape == (3, 4)
    mean, std = 0.5, float(rewards.std(unbiased=True))
    assert adv[0].tolist() == pytest.approx([(0.25 - mean) / std] * 2 + [-mean / std] * 2)
    assert adv[2].tolist() == pytest.approx([(1.25 - mean) / std] * 2 + [0.5 / std] * 2)
    # the right call of a failed episode is pushed less than the wrong call, its answer as much
    assert adv[0, 0] > adv[1, 0] and adv[0, 2] == pytest.approx(adv[1, 2])
    assert st.zero_variance_groups == 0
    # every token carrying its row's reward gives the row-level advantages exactly
    flat = rewards.view(-1, 1).expand(3, 4)
    per_token, _ = group_advantages(rewards, gids, None, token_rewards=flat)
    per_row, _ = group_advantages(rewards, gids, None)
    assert torch.equal(per_token, per_row.view(-1, 1).expand(3, 4))
    # without group normalisation the returns themselves (the demo's batch-normalised path)
    raw, _ = group_advantages(rewards, gids, None, mean_norm=False, token_rewards=token_rewards)
    assert torch.equal(raw, token_rewards)
    mask = _t([[1, 1, 1, 1]] * 3, torch.int32)
    normed = token_advantages(raw, mask, batch_norm=True)
    assert normed[0, 0] > normed[1, 0] and normed[2, 2] > normed[0, 2]
