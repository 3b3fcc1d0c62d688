"""Advantage estimators (pure functions).

GRPO (Shao et al. 2024): each trajectory's advantage is its reward relative to the other
samples of the same prompt,

    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)      (scale=True, GRPO)
    A_i =  r_i - mean(r_group)                              (scale=False, Dr. GRPO)

std is the unbiased sample std, as TRL computes it. A group whose rewards are all equal carries
no signal: its advantages are exactly 0. A group of one sample has advantage 0.
"""

from __future__ import annotations

import torch


def grpo_advantages(rewards: torch.Tensor, valid: torch.Tensor | None = None, scale: bool = True,
                    eps: float = 1e-4) -> torch.Tensor:
    """rewards [P, G] (P prompts, G samples each) -> advantages [P, G].

    valid [P, G] (bool) marks trajectories that count; masked ones (failed rollouts) get 0 and
    do not enter their group's mean or std.
    """
    rewards = rewards.float()
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    v = valid.float()
    n = v.sum(-1, keepdim=True)  # [P, 1]
    mean = (rewards * v).sum(-1, keepdim=True) / n.clamp(min=1)
    centered = (rewards - mean) * v
    if scale:
        var = (centered**2).sum(-1, keepdim=True) / (n - 1).clamp(min=1)
        adv = centered / (var.sqrt() + eps)
    else:
        adv = centered
    return torch.where(n > 1, adv, torch.zeros_like(adv)) * v
