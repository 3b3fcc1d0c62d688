import pytest
import torch

from actloop.algos.batching import dynamic_sampling_filter, is_on_policy, minibatches
from actloop.algos.shaping import mask_truncated, overlong_penalty


def test_overlong_penalty_dapo_hand_computed():
    # L_max 10, buffer 4: free up to 6, then linear to -1 at 10, -1 beyond
    pen = overlong_penalty(torch.tensor([3, 6, 8, 10, 12]), max_len=10, buffer_len=4)
    assert torch.allclose(pen, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))
    assert torch.allclose(overlong_penalty(torch.tensor([8]), 10, 4, penalty_factor=0.5), torch.tensor([-0.25]))


def test_mask_truncated_zeroes_rows():
    out = mask_truncated(torch.ones(2, 3), torch.tensor([False, True]))
    assert out.tolist() == [[1, 1, 1], [0, 0, 0]]


def test_dynamic_sampling_drops_all_equal_groups():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.9], [0.2, 0.0, 0.0]])
    valid = torch.tensor([[True] * 3, [True] * 3, [True] * 3, [True, True, False], [True, False, False]])
    keep, dropped = dynamic_sampling_filter(rewards, valid)
    assert keep.tolist() == [False, True, False, False, False] and dropped == 4  # invalid 0.9 and single sample don't count
    keep, dropped = dynamic_sampling_filter(torch.tensor([[0.0, 0.05]]), atol=0.1)
    assert keep.tolist() == [False] and dropped == 1


def test_minibatches_deterministic_and_cover_every_sample_each_epoch():
    a = minibatches(8, minibatch_size=4, epochs=2, seed=3)
    assert a == minibatches(8, minibatch_size=4, epochs=2, seed=3)
    assert len(a) == 4 and all(len(s) == 4 for s in a)
    assert sorted(a[0] + a[1]) == list(range(8)) and sorted(a[2] + a[3]) == list(range(8))
    assert minibatches(5, minibatch_size=2, shuffle=False) == [[0, 1], [2, 3], [4]]
    assert minibatches(0) == []


def test_minibatches_keep_groups_together():
    steps = minibatches(6, minibatch_size=4, group_size=2, seed=1)
    for s in steps:
        assert all(s[i] // 2 == s[i + 1] // 2 for i in range(0, len(s), 2))
    assert sorted(i for s in steps for i in s) == list(range(6))
    with pytest.raises(ValueError):
        minibatches(6, minibatch_size=3, group_size=2)


def test_on_policy_fast_path_condition():
    assert is_on_policy(8) and is_on_policy(8, minibatch_size=8)
    assert not is_on_policy(8, minibatch_size=4) and not is_on_policy(8, epochs=2)


def test_token_budget_batches_by_hand():
    from actloop.algos.batching import token_budget_batches

    # no budget: only the item cap
    assert token_budget_batches([3, 3, 4, 9], 2) == [[0, 1], [2, 3]]
    # budget 10 padded tokens: [3, 3, 4] would be 3 x 4 = 12 -> split; 9 alone; an item over the budget alone
    assert token_budget_batches([3, 3, 4, 9], 8, 10) == [[0, 1], [2], [3]]
    assert token_budget_batches([12, 2], 8, 10) == [[0], [1]]
    assert token_budget_batches([], 4, 10) == []
    # the padded count uses the longest item: [2, 2, 5] = 15 > 12, [2, 2] = 4
    assert token_budget_batches([2, 2, 5, 5], 8, 12) == [[0, 1], [2, 3]]
