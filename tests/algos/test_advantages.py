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
