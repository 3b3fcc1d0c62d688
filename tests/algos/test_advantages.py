import torch

from actloop.algos.advantages import grpo_advantages


def test_group_relative_hand_computed():
    # group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4*0.25/3) = 0.57735
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), eps=0.0)
    assert torch.allclose(adv, torch.tensor([[0.8660254, -0.8660254, -0.8660254, 0.8660254]]), atol=1e-6)


def test_unscaled_is_dr_grpo():
    adv = grpo_advantages(torch.tensor([[3.0, 1.0, 2.0]]), scale=False)
    assert torch.allclose(adv, torch.tensor([[1.0, -1.0, 0.0]]))


def test_all_equal_group_has_zero_advantage():
    adv = grpo_advantages(torch.tensor([[0.7, 0.7, 0.7], [1.0, 0.0, 0.0]]))
    assert torch.equal(adv[0], torch.zeros(3))
    assert adv[1, 0] > 0 > adv[1, 1]


def test_single_sample_group_is_zero_not_nan():
    adv = grpo_advantages(torch.tensor([[5.0], [2.0]]))
    assert torch.equal(adv, torch.zeros(2, 1))


def test_masked_members_are_left_out_of_the_baseline():
    # the masked 100.0 would dominate the mean; valid members [1, 0] -> +-0.7071 (std 0.7071)
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 100.0]]), valid=torch.tensor([[True, True, False]]), eps=0.0)
    assert torch.allclose(adv, torch.tensor([[0.7071068, -0.7071068, 0.0]]), atol=1e-6)


# --- more edge cases and the other estimators -------------------------------------------------

import inspect  # noqa: E402
import math  # noqa: E402

import pytest  # noqa: E402

from actloop.algos.advantages import (  # noqa: E402
    ADVANTAGE_ESTIMATORS,
    broadcast_turn_values,
    discounted_returns,
    gae_advantages,
    masked_whiten,
    place_rewards_at_turn_ends,
    reinforce_pp_advantages,
    reinforce_pp_token_advantages,
    rloo_advantages,
    turn_end_positions,
    turn_ids_from_mask,
    turn_level_advantages,
    turn_returns,
)


def test_all_equal_group_is_zero_even_with_eps_zero():
    adv = grpo_advantages(torch.tensor([[0.7, 0.7, 0.7]]), eps=0.0)  # std 0: 0/0 must not be NaN
    assert torch.equal(adv, torch.zeros(1, 3))


def test_batch_std_scaling_hand_computed():
    # group means 0.5, 3, 1 -> centred [.5,-.5], [0,0], [1,-1]; batch var = 2.5 / 5 = 0.5
    adv = grpo_advantages(torch.tensor([[1.0, 0.0], [3.0, 3.0], [2.0, 0.0]]), scale="batch", eps=0.0)
    s = math.sqrt(0.5)
    assert torch.allclose(adv, torch.tensor([[0.5 / s, -0.5 / s], [0.0, 0.0], [1 / s, -1 / s]]), atol=1e-6)


def test_scale_strings_match_bools():
    r = torch.tensor([[3.0, 1.0, 2.0], [0.0, 1.0, 1.0]])
    assert torch.equal(grpo_advantages(r, scale="group"), grpo_advantages(r, scale=True))
    assert torch.equal(grpo_advantages(r, scale="none"), grpo_advantages(r, scale=False))


def test_rloo_leave_one_out_hand_computed():
    # [1, 0, 0, 1]: a 1 sees the others' mean 1/3 -> 2/3; a 0 sees 2/3 -> -2/3 (= 4/3 * (r - 0.5))
    adv = rloo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    assert torch.allclose(adv, torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3]]), atol=1e-6)


def test_rloo_masked_member_and_single_sample():
    adv = rloo_advantages(torch.tensor([[1.0, 0.0, 5.0], [4.0, 0.0, 0.0]]),
                          valid=torch.tensor([[True, True, False], [True, False, False]]))
    assert torch.equal(adv, torch.tensor([[1.0, -1.0, 0.0], [0.0, 0.0, 0.0]]))


def test_reinforce_pp_batch_normalised_hand_computed():
    # batch [1, 0, 3, 3]: mean 1.75, unbiased var 6.75 / 3 = 2.25, std 1.5; no per-prompt baseline
    adv = reinforce_pp_advantages(torch.tensor([[1.0, 0.0], [3.0, 3.0]]), eps=0.0)
    assert torch.allclose(adv, torch.tensor([[-0.5, -1.75 / 1.5], [1.25 / 1.5, 1.25 / 1.5]]), atol=1e-6)


def test_reinforce_pp_single_sample_is_zero():
    assert torch.equal(reinforce_pp_advantages(torch.tensor([[2.0]])), torch.zeros(1, 1))


def test_masked_whiten_empty_mask_is_zero():
    out = masked_whiten(torch.randn(2, 3), torch.zeros(2, 3))
    assert torch.equal(out, torch.zeros(2, 3))


def test_gae_hand_computed():
    # r = [0, 0, 1], V = 0.5 everywhere, gamma 0.9, lam 0.8:
    #   t=2: delta = 1 - 0.5 = 0.5                          A2 = 0.5
    #   t=1: delta = 0.9*0.5 - 0.5 = -0.05                  A1 = -0.05 + 0.72*0.5  = 0.31
    #   t=0: delta = -0.05                                  A0 = -0.05 + 0.72*0.31 = 0.1732
    r, V, m = torch.tensor([[0.0, 0.0, 1.0]]), torch.full((1, 3), 0.5), torch.ones(1, 3)
    adv, ret = gae_advantages(r, V, m, gamma=0.9, lam=0.8)
    assert torch.allclose(adv, torch.tensor([[0.1732, 0.31, 0.5]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[0.6732, 0.81, 1.0]]), atol=1e-6)


def test_gae_gamma_lam_one_is_return_minus_value():
    adv, ret = gae_advantages(torch.tensor([[0.0, 0.0, 1.0]]), torch.full((1, 3), 0.5), torch.ones(1, 3))
    assert torch.allclose(adv, torch.full((1, 3), 0.5)) and torch.allclose(ret, torch.ones(1, 3))


def test_gae_skips_masked_positions_and_padding():
    # row 0: an env token at t=1 is skipped: t=0 bootstraps from V at t=2 -> same A0 as A1 above
    # row 1: padded after t=1, reward at t=1 -> A1 = 0.5, A0 = 0.31, padding 0
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    V = torch.full((2, 3), 0.5)
    m = torch.tensor([[1, 0, 1], [1, 1, 0]])
    adv, ret = gae_advantages(r, V, m, gamma=0.9, lam=0.8)
    assert torch.allclose(adv, torch.tensor([[0.31, 0.0, 0.5], [0.31, 0.5, 0.0]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[0.81, 0.0, 1.0], [0.81, 1.0, 0.0]]), atol=1e-6)


def test_gae_empty_mask_is_zero():
    adv, ret = gae_advantages(torch.ones(1, 3), torch.ones(1, 3), torch.zeros(1, 3))
    assert torch.equal(adv, torch.zeros(1, 3)) and torch.equal(ret, torch.zeros(1, 3))


def test_discounted_returns_and_reinforce_pp_token():
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert torch.allclose(discounted_returns(r, m, gamma=0.5), torch.tensor([[0.25, 0.5, 1.0], [0, 0, 0]]))
    # gamma 1: returns [1,1,1] and [0,0]; over 5 tokens mean 0.6, unbiased std sqrt(1.2/4)
    adv = reinforce_pp_token_advantages(r, m, eps=0.0)
    s = math.sqrt(0.3)
    assert torch.allclose(adv, torch.tensor([[0.4 / s] * 3, [-0.6 / s, -0.6 / s, 0.0]]), atol=1e-6)


def test_turn_ids_end_positions_and_reward_placement():
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 0], [1, 0, 1, 1, 0, 0, 0]])
    ids = turn_ids_from_mask(mask)
    assert ids.tolist() == [[-1, 0, 0, -1, -1, 1, -1], [0, -1, 1, 1, -1, -1, -1]]
    ends = turn_end_positions(ids, num_turns=3)
    assert ends.tolist() == [[2, 5, -1], [0, 3, -1]]
    tok = place_rewards_at_turn_ends(torch.tensor([[1.0, 2.0, 9.0], [0.5, 0.25, 9.0]]), ends, 7)
    assert tok.tolist() == [[0, 0, 1.0, 0, 0, 2.0, 0], [0.5, 0, 0, 0.25, 0, 0, 0]]  # the absent turn's 9 is dropped


def test_turn_returns_discounted():
    G = turn_returns(torch.tensor([[1.0, 0.0, 2.0]]), torch.tensor([[True, True, True]]), gamma=0.5)
    assert torch.allclose(G, torch.tensor([[1.5, 1.0, 2.0]]))


def test_turn_level_two_turn_hand_worked():
    # the example in docs/algorithms.md: one prompt, two samples, two turns each, gamma 0.9
    #   sample 0: turn rewards (0, 1)   -> G = (0 + 0.9*1, 1) = (0.9, 1)
    #   sample 1: turn rewards (0.5, 0) -> G = (0.5, 0)
    #   baselines per turn index: b0 = 0.7, b1 = 0.5  ->  A = (0.2, 0.5) and (-0.2, -0.5)
    turn_r = torch.tensor([[[0.0, 1.0], [0.5, 0.0]]])  # [P=1, G=2, K=2]
    turn_v = torch.ones(1, 2, 2, dtype=torch.bool)
    ids = torch.tensor([[-1, 0, 0, -1, 1], [-1, 0, -1, 1, 1]])  # [B=2, T=5]
    adv = turn_level_advantages(turn_r, turn_v, ids, gamma=0.9)
    assert torch.allclose(adv, torch.tensor([[0, 0.2, 0.2, 0, 0.5], [0, -0.2, 0, -0.5, -0.5]]), atol=1e-6)
    loo = turn_level_advantages(turn_r, turn_v, ids, gamma=0.9, leave_one_out=True)  # b = the other sample
    assert torch.allclose(loo, torch.tensor([[0, 0.4, 0.4, 0, 1.0], [0, -0.4, 0, -1.0, -1.0]]), atol=1e-6)


def test_turn_level_uneven_episode_lengths():
    # sample 1 stopped after one turn: turn 1's baseline averages samples 0 and 2 only
    turn_r = torch.tensor([[[0.0, 1.0], [1.0, 7.0], [0.0, 0.0]]])  # the 7 is past sample 1's end: ignored
    turn_v = torch.tensor([[[True, True], [True, False], [True, True]]])
    ids = torch.tensor([[0, 1], [0, -1], [0, 1]])
    adv = turn_level_advantages(turn_r, turn_v, ids, gamma=1.0)
    # G = (1, 1), (1, -), (0, 0); b0 = 2/3, b1 = 1/2
    assert torch.allclose(adv, torch.tensor([[1 / 3, 0.5], [1 / 3, 0.0], [-2 / 3, -0.5]]), atol=1e-6)
    # with gamma 1, turn 0's advantage is Dr. GRPO on the episode totals
    totals = (turn_r * turn_v).sum(-1)
    assert torch.allclose(adv[:, 0], grpo_advantages(totals, scale=False).flatten(), atol=1e-6)


def test_turn_level_single_sample_and_all_equal_are_zero():
    ids = torch.tensor([[0, 1]])
    assert torch.equal(turn_level_advantages(torch.tensor([[[1.0, 2.0]]]), torch.ones(1, 1, 2, dtype=torch.bool), ids),
                       torch.zeros(1, 2))
    same = turn_level_advantages(torch.ones(1, 2, 2), torch.ones(1, 2, 2, dtype=torch.bool),
                                 torch.tensor([[0, 1], [0, 1]]), scale=True)
    assert torch.equal(same, torch.zeros(2, 2))


def test_broadcast_turn_values_ignores_out_of_range_ids():
    out = broadcast_turn_values(torch.tensor([[1.0, 2.0]]), torch.tensor([[-1, 0, 1, 2]]))
    assert out.tolist() == [[0.0, 1.0, 2.0, 0.0]]


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_registry_entries_name_real_keyword_arguments(name):
    est = ADVANTAGE_ESTIMATORS[name]
    params = inspect.signature(est.fn).parameters
    for arg in est.inputs + est.params:
        assert arg in params, f"{name}: {arg} is not an argument of {est.fn.__name__}"
    for arg in est.params:
        assert params[arg].default is not inspect.Parameter.empty
    assert est.level in ("sequence", "token")
    assert est.needs_critic == ("values" in est.inputs)


def test_registry_dispatch_outcome_estimators():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    v = torch.ones_like(r, dtype=torch.bool)
    out = {n: e.fn(rewards=r, valid=v) for n, e in ADVANTAGE_ESTIMATORS.items() if e.level == "sequence"}
    assert torch.allclose(out["dr_grpo"], torch.tensor([[0.5, -0.5, -0.5, 0.5]]))
    assert torch.allclose(out["rloo"], out["dr_grpo"] * 4 / 3)
    assert all(torch.isfinite(a).all() for a in out.values())


@pytest.mark.parametrize("name", ["grpo", "grpo_batch_std", "dr_grpo", "rloo", "reinforce_pp"])
def test_nan_reward_of_a_masked_rollout_stays_out(name):
    r = torch.tensor([[1.0, 0.0, float("nan")]])
    v = torch.tensor([[True, True, False]])
    adv = ADVANTAGE_ESTIMATORS[name].fn(rewards=r, valid=v)
    assert torch.isfinite(adv).all() and adv[0, 2] == 0.0 and adv[0, 0] > 0 > adv[0, 1]
