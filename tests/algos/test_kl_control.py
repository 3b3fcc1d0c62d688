import math

import pytest
import torch

from actloop.algos.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    kl_reward_penalty,
    next_beta,
)


def test_kl_reward_penalty_hand_computed():
    # token 0: log pi = 0, log ref = log 0.5 -> k1 = log 2; token 1 equal -> 0; token 2 masked
    logp = torch.tensor([[0.0, math.log(0.5), 0.0]], requires_grad=True)
    ref = torch.tensor([[math.log(0.5), math.log(0.5), -9.0]])
    pen = kl_reward_penalty(logp, ref, torch.tensor([[1, 1, 0]]), beta=0.1)
    assert torch.allclose(pen, torch.tensor([[-0.1 * math.log(2), 0.0, 0.0]]), atol=1e-7)
    assert not pen.requires_grad  # a reward, not a loss
    k3 = kl_reward_penalty(logp, ref, torch.tensor([[1, 1, 0]]), beta=0.1, estimator="k3")
    assert math.isclose(float(k3[0, 0]), -0.1 * (0.5 - 1 + math.log(2)), rel_tol=1e-6)


@pytest.mark.parametrize("name", sorted(KL_ESTIMATORS))
def test_estimators_are_zero_on_identical_policies_and_finite_on_extremes(name):
    fn = KL_ESTIMATORS[name]
    assert torch.equal(fn(torch.tensor([-1.0]), torch.tensor([-1.0])), torch.zeros(1))
    logp = torch.tensor([80.0, -80.0], requires_grad=True)
    kl = fn(logp, torch.tensor([-80.0, 80.0]))
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(logp.grad).all()


def test_adaptive_beta_ziegler_hand_computed():
    # KL twice the target: error clipped to +0.2 -> beta * (1 + 0.2 * 100 / 10000)
    assert math.isclose(next_beta(0.1, 2.0, 1.0, 10_000, 100), 0.1 * 1.002, rel_tol=1e-12)
    # KL 10% above: error 0.1 -> beta * (1 + 0.1 * 0.5)
    assert math.isclose(next_beta(0.1, 1.1, 1.0, 10, 5), 0.1 * 1.05, rel_tol=1e-9)
    # KL zero: error clipped to -0.2 -> beta shrinks
    assert math.isclose(next_beta(0.1, 0.0, 1.0, 10, 5), 0.1 * 0.9, rel_tol=1e-12)
    # on target: unchanged
    assert next_beta(0.1, 1.0, 1.0, 10, 5) == 0.1


def test_controller_table_and_dataclass():
    assert KL_CONTROLLERS["fixed"](0.05, 9.0, 1.0, 10, 5) == 0.05
    assert KL_CONTROLLERS["adaptive"](0.1, 2.0, 1.0, 10_000, 100) == next_beta(0.1, 2.0, 1.0, 10_000, 100)
    ctl = AdaptiveKLController(target_kl=1.0, horizon=10)
    assert math.isclose(ctl.next(0.1, 1.1, 5), 0.105, rel_tol=1e-9)
