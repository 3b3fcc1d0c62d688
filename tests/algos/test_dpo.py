import math

import pytest
import torch

from actloop.algos.dpo import DPO_LOSSES, build_preference_pairs, dpo_loss


def _pair():
    # chosen log-ratio 0.5, rejected log-ratio -0.5 -> h = 1
    return torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([-1.5]), torch.tensor([-1.5])


def test_sigmoid_dpo_hand_computed():
    loss, m = dpo_loss(*_pair(), beta=0.1)
    assert math.isclose(loss.item(), math.log1p(math.exp(-0.1)), rel_tol=1e-6)  # -log sigma(0.1) = 0.6444
    assert math.isclose(m["rewards_chosen"], 0.05, rel_tol=1e-6)
    assert math.isclose(m["rewards_rejected"], -0.05, rel_tol=1e-6)
    assert math.isclose(m["reward_margin"], 0.1, rel_tol=1e-6)
    assert m["reward_accuracy"] == 1.0 and m["pairs"] == 1.0


def test_label_smoothing_hand_computed():
    loss, _ = dpo_loss(*_pair(), beta=0.1, label_smoothing=0.1)
    expect = 0.9 * math.log1p(math.exp(-0.1)) + 0.1 * math.log1p(math.exp(0.1))
    assert math.isclose(loss.item(), expect, rel_tol=1e-6)


def test_ipo_hand_computed():
    loss, _ = dpo_loss(*_pair(), beta=0.1, loss_type="ipo")
    assert math.isclose(loss.item(), (1 - 1 / 0.2) ** 2, rel_tol=1e-6)  # (1 - 5)^2 = 16


def test_sigmoid_gradient_hand_computed():
    # dL/dh = -beta * sigma(-beta h); h depends on the chosen policy log-prob with +1, rejected -1
    pc, pr = torch.tensor([-1.0], requires_grad=True), torch.tensor([-2.0], requires_grad=True)
    loss, _ = dpo_loss(pc, pr, torch.tensor([-1.5]), torch.tensor([-1.5]), beta=0.1)
    loss.backward()
    g = -0.1 / (1 + math.exp(0.1))
    assert math.isclose(float(pc.grad), g, rel_tol=1e-6) and math.isclose(float(pr.grad), -g, rel_tol=1e-6)


@pytest.mark.parametrize("loss_type", sorted(DPO_LOSSES))
def test_extreme_and_empty_inputs_stay_finite(loss_type):
    pc = torch.tensor([1e4, -1e4], requires_grad=True)
    loss, m = dpo_loss(pc, torch.tensor([-1e4, 1e4]), torch.zeros(2), torch.zeros(2), beta=0.1, loss_type=loss_type)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(pc.grad).all()
    assert m["reward_accuracy"] == 0.5
    empty, m = dpo_loss(*(torch.zeros(0) for _ in range(4)), loss_type=loss_type)
    assert float(empty) == 0.0 and m["pairs"] == 0.0 and m["reward_accuracy"] == 0.0


def test_build_pairs_best_vs_worst_skipping_ties():
    rewards = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.5, 0.5, 0.5, 0.5], [2.0, 0.0, 1.0, 3.0]])
    chosen, rejected, group = build_preference_pairs(rewards)
    assert chosen.tolist() == [1, 11]  # group 0: first of the tied best; group 2: index 3
    assert rejected.tolist() == [0, 9]
    assert group.tolist() == [0, 2]  # the all-equal group 1 is skipped


def test_build_pairs_respects_valid_and_single_sample():
    rewards = torch.tensor([[9.0, 1.0, 0.0], [5.0, -9.0, 0.0]])
    valid = torch.tensor([[False, True, True], [True, False, False]])
    chosen, rejected, group = build_preference_pairs(rewards, valid)
    assert chosen.tolist() == [1] and rejected.tolist() == [2] and group.tolist() == [0]
    c, r, g = build_preference_pairs(torch.tensor([[1.0]]))
    assert c.numel() == r.numel() == g.numel() == 0
