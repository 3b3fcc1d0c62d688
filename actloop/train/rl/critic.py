"""The PPO critic: a value head on the policy's backbone (`ppo.critic=head`) or on a separate
copy of the model (`ppo.critic=separate`, twice the memory, no interference with the policy).

Values are read at the same positions as the policy's log-probs: the state just before each
sampled token.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from actloop.rollout.engine import autocast_context
from actloop.train.numerics.logprobs import backbone_and_head, hidden_at_targets


class Critic(nn.Module):
    def __init__(self, policy: nn.Module, mode: str = "head"):
        super().__init__()
        backbone, _ = backbone_and_head(policy)
        hidden = policy.config.hidden_size if hasattr(policy, "config") else backbone.config.hidden_size
        self.mode = mode
        self.head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.head.weight)  # start from V = 0: no bias towards either sign
        nn.init.zeros_(self.head.bias)
        self.backbone = copy.deepcopy(backbone) if mode == "separate" else None

    def values_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] (from the policy's forward) -> values [N]."""
        return self.head(hidden.float()).squeeze(-1)

    def values(self, seqs: list[list[int]], masks: list[list[int]], precision: str = "auto") -> torch.Tensor:
        """Values [N] at the masked positions, from the critic's own backbone (separate mode)."""
        assert self.backbone is not None
        h, *_ = hidden_at_targets(self.backbone, seqs, masks, precision)
        with autocast_context(precision):
            return self.values_from_hidden(h)
