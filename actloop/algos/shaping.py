"""Reward shaping for long completions (pure functions), DAPO (Yu et al. 2025, "DAPO: An
Open-Source LLM Reinforcement Learning System at Scale", section 3.4).

Overlong reward shaping: a soft length penalty in a buffer of L_cache tokens before the limit
L_max, added to the task reward,

    R_length(y) =  0                                  |y| <= L_max - L_cache
                   ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
                  -1                                  |y| > L_max

(times `penalty_factor`). Overlong filtering: truncated completions are masked out of the loss
(a truncated answer is not necessarily wrong, so its reward is noise) — recompute the loss
normalisers (num_seqs, num_tokens) after masking.
"""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, penalty_factor: float = 1.0) -> torch.Tensor:
    """lengths [B] (completion tokens) -> penalty [B] in [-penalty_factor, 0], DAPO's R_length."""
    expected = max_len - buffer_len  # no penalty up to here
    over = lengths.float() - expected  # [B] tokens into the buffer
    ramp = -over / max(buffer_len, 1)  # [B] 0 at the buffer's start, -1 at max_len
    return ramp.clamp(-1.0, 0.0) * penalty_factor  # [B]


def mask_truncated(mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """DAPO overlong filtering: mask [B, T], truncated [B] (bool) -> mask [B, T] with the rows of
    truncated completions zeroed."""
    return mask * (~truncated.bool())[:, None].to(mask.dtype)  # [B, T]
