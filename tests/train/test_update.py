"""Advantages as the update computes them from scored trajectories (no model needed)."""

import torch

from actloop.config import load_config
from actloop.train.update import UpdateContext, compute_advantages
from actloop.types import Message, Scored, Trajectory, Turn


def episode(turn_rewards, outcome, lengths):
    turns = tuple(Turn(Message("assistant", f"t{k}"), tuple(range(n)), (0.0,) * n, "stop", reward=r)
                  for k, (r, n) in enumerate(zip(turn_rewards, lengths)))
    return Scored(Trajectory((Message("user", "q"),), (1,), turns), reward=outcome, components={})


def advantages(overrides, scored, group_size):
    cfg = load_config(None, overrides)
    ctx = UpdateContext(cfg, models=None, optimizer=None, critic=None, beta=0.0, correction="none")
    adv, _, _ = compute_advantages(ctx, scored, list(range(len(scored))), group_size, {}, {}, {})
    return adv


def test_turn_credit_hand_worked_two_turn_example():
    # A: turn rewards [0.5, 0] + outcome 1 -> returns G1 = 1.5, G2 = 1.0; B: all 0 -> G1 = G2 = 0.
    # Group baselines: turn 1 0.75, turn 2 0.5 -> A gets +0.75 on turn 1's tokens, +0.5 on turn 2's.
    scored = [episode([0.5, 0.0], 1.0, [2, 1]), episode([0.0, 0.0], 0.0, [1, 3])]
    adv = advantages(["train.turn_credit=true", "train.adv_scale=none"], scored, 2)
    assert torch.allclose(adv[0], torch.tensor([0.75, 0.75, 0.5]))
    assert torch.allclose(adv[1], torch.tensor([-0.75, -0.5, -0.5, -0.5]))


def test_turn_credit_discounts_later_turns():
    scored = [episode([0.0, 0.0], 1.0, [1, 1]), episode([0.0, 0.0], 0.0, [1, 1])]
    adv = advantages(["train.turn_credit=true", "train.adv_scale=none", "train.turn_gamma=0.5"], scored, 2)
    # A: G1 = 0.5 * 1, G2 = 1 -> baselines 0.25, 0.5 -> A: [0.25, 0.5]
    assert torch.allclose(adv[0], torch.tensor([0.25, 0.5]))


def test_sequence_level_grpo_gives_every_token_the_same_advantage():
    scored = [episode([None], 1.0, [2]), episode([None], 0.0, [3])]
    adv = advantages(["train.adv_scale=none"], scored, 2)
    assert torch.allclose(adv[0], torch.tensor([0.5, 0.5])) and torch.allclose(adv[1], torch.full((3,), -0.5))


def test_grpo_scales_by_group_std_by_default():
    scored = [episode([None], 1.0, [1]), episode([None], 0.0, [1])]
    adv = advantages([], scored, 2)  # mean 0.5, unbiased std 0.7071 -> +-0.7071
    assert torch.allclose(adv[0], torch.tensor([0.7070])), adv[0]
