"""Rollout routing replay for mixture-of-experts models (pure functions). Shapes: N tokens,
E experts, k experts per token, L MoE layers.

The engine and the trainer can route one token to different experts: bf16 versus fp32
weights, another batch composition, another kernel make router logits differ by a little,
and a top-k choice flips. A flipped expert changes the token's hidden state outright, so the
trainer's log-prob of a sampled token can be far from the engine's even with identical
weights. Rollout Routing Replay (R3; Ma et al. 2025, "Stabilizing MoE Reinforcement Learning
by Aligning Training and Inference Routers", arXiv 2510.11370) records each token's top-k
expert ids in the engine and, in the trainer's forward, uses those ids while computing the gate
weights from the trainer's own router logits — the weights keep their gradient, only the
discrete choice is replayed:

    I     = engine's top-k ids of the token                      (recorded)
    g_i   = softmax_{j in I}(z_j)[i]  for i in I, 0 elsewhere     (GPT-OSS's gate: softmax over the
                                                                   k selected logits z of the trainer)

A token without a recorded choice (id -1) keeps the trainer's own top-k.
"""

from __future__ import annotations

import torch


def replay_topk(router_logits: torch.Tensor, own_idx: torch.Tensor, forced: torch.Tensor | None):
    """router_logits [N, E], own top-k [N, k], forced [N, k] (-1 = none) -> (gate weights [N, k]
    over the chosen experts, chosen ids [N, k]). Weights: softmax over the chosen logits."""
    idx = own_idx
    if forced is not None:
        has = (forced >= 0).all(-1, keepdim=True)  # [N, 1] a recorded choice for the whole token
        idx = torch.where(has, forced.to(own_idx.dtype), own_idx)  # [N, k]
    chosen = router_logits.gather(-1, idx)  # [N, k] the trainer's logits of the chosen experts
    return torch.softmax(chosen, dim=-1, dtype=chosen.dtype), idx


def topk_differs(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Top-k ids [..., L, k] of two routers -> [...] True where any layer chose a different set
    of experts (order inside the top-k does not matter)."""
    return (a.sort(-1).values != b.sort(-1).values).any(-1).any(-1)


def routing_disagreement(engine_idx: torch.Tensor, trainer_idx: torch.Tensor, mask: torch.Tensor) -> float:
    """engine / trainer top-k [N, L, k], mask [N] (tokens compared: recorded by the engine and
    trained) -> share of those tokens whose expert set differs in some layer (0 when none)."""
    m = mask & (engine_idx >= 0).all(-1).all(-1)  # [N]
    n = int(m.sum())
    return int(topk_differs(engine_idx[m], trainer_idx[m]).sum()) / n if n else 0.0
