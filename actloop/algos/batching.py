"""Batch selection and splitting (pure functions).

Dynamic sampling (DAPO, Yu et al. 2025): a group whose rewards are all equal has zero
group-relative advantage, so it adds no policy gradient but still dilutes the batch. Drop those
groups and let the trainer sample more prompts until the batch is full again.

Several updates per rollout batch (PPO-style): the batch is split into mini-batches, each one an
optimizer step, for several epochs; old log-probs are computed once, before the first update.
With exactly one update (epochs = 1, one mini-batch) the on-policy fast path applies: old_logp =
logp.detach(), the ratio is identically 1 and no old-log-prob pass is needed (see losses.py).
"""

from __future__ import annotations

import torch


def dynamic_sampling_filter(rewards: torch.Tensor, valid: torch.Tensor | None = None,
                            atol: float = 0.0) -> tuple[torch.Tensor, int]:
    """rewards [P, G], valid [P, G] -> (keep [P] bool, number of groups dropped).

    A group is kept when at least 2 of its samples are valid and their rewards differ by more
    than atol (max - min > atol)."""
    rewards = rewards.float()  # [P, G]
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    inf = float("inf")
    hi = torch.where(valid, rewards, -inf).amax(-1)  # [P]
    lo = torch.where(valid, rewards, inf).amin(-1)  # [P]
    keep = (valid.sum(-1) >= 2) & (hi - lo > atol)  # [P]
    return keep, int((~keep).sum())


def minibatches(num_samples: int, minibatch_size: int | None = None, epochs: int = 1, seed: int = 0,
                shuffle: bool = True, group_size: int = 1) -> list[list[int]]:
    """The update schedule of one rollout batch: a list of index lists, one per optimizer step,
    epoch after epoch. Deterministic under `seed` (epoch e shuffles with seed + e).

    group_size > 1 keeps each group's samples (consecutive indices) in one mini-batch, so the
    group is never split across steps; num_samples and minibatch_size must then be multiples of
    it. minibatch_size None = the whole batch (one step per epoch)."""
    if num_samples <= 0:
        return []
    size = num_samples if minibatch_size is None else minibatch_size
    if num_samples % group_size or size % group_size:
        raise ValueError(f"num_samples ({num_samples}) and minibatch_size ({size}) must be multiples of group_size ({group_size})")
    num_groups, per_step = num_samples // group_size, max(size // group_size, 1)
    steps: list[list[int]] = []
    for epoch in range(epochs):
        order = (torch.randperm(num_groups, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
                 if shuffle else list(range(num_groups)))  # [num_groups]
        for start in range(0, num_groups, per_step):
            groups = order[start : start + per_step]
            steps.append([g * group_size + j for g in groups for j in range(group_size)])
    return steps


def token_budget_batches(lengths: list[int], max_items: int, max_tokens: int = 0) -> list[list[int]]:
    """Micro-batches of positions 0..n-1 of `lengths`, in order: each holds at most `max_items`
    items and, when max_tokens > 0, at most `max_tokens` padded tokens (items x its longest
    length, what one forward allocates activations for). An item longer than the budget goes
    alone (never dropped). Sort `lengths` first so that similar lengths share a micro-batch."""
    out: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        grown = max(longest, n)
        if cur and (len(cur) >= max_items or (max_tokens > 0 and grown * (len(cur) + 1) > max_tokens)):
            out.append(cur)
            cur, grown = [], n
        cur.append(i)
        longest = grown
    if cur:
        out.append(cur)
    return out


def is_on_policy(num_samples: int, minibatch_size: int | None = None, epochs: int = 1) -> bool:
    """True when the schedule has exactly one optimizer step: old_logp = logp.detach() is exact."""
    return epochs == 1 and (minibatch_size is None or minibatch_size >= num_samples)
