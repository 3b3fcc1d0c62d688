"""Policy-gradient losses (pure functions). Shapes: B sequences, T token positions.

Clipped surrogate (PPO / GRPO), per token:

    ratio   = exp(logp - old_logp)
    loss_t  = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)  (+ beta * KL_t)

With one update per rollout batch, old_logp is the current log-prob detached: the ratio is
exactly 1 and the gradient is the plain policy gradient -A * grad(logp).

Aggregation over tokens:
    seq_mean:   mean over sequences of each sequence's token mean (original GRPO)
    token_mean: sum over all tokens / number of tokens in the batch (DAPO)
Both are written as sum(loss_t * w_t) with per-token weights w, so a batch split into
micro-batches accumulates exactly the same gradient.
"""

from __future__ import annotations

import torch

from actloop.algos.kl import KL_ESTIMATORS


def token_weights(mask: torch.Tensor, agg: str, num_seqs: int, num_tokens: int) -> torch.Tensor:
    """mask [B, T] -> weights [B, T] whose weighted sum aggregates a per-token loss.

    num_seqs / num_tokens are the totals over the whole batch (all micro-batches)."""
    mask = mask.float()
    if agg == "seq_mean":
        return mask / mask.sum(-1, keepdim=True).clamp(min=1) / max(num_seqs, 1)
    if agg == "token_mean":
        return mask / max(num_tokens, 1)
    raise ValueError(f"unknown loss aggregation {agg!r}")


def clipped_pg_loss(
    logp: torch.Tensor,  # [B, T] current policy log-probs of the sampled tokens
    old_logp: torch.Tensor,  # [B, T] log-probs at sampling time (detached)
    advantages: torch.Tensor,  # [B] one advantage per sequence
    weights: torch.Tensor,  # [B, T] from token_weights (0 on masked tokens)
    clip_eps: float = 0.2,
    ref_logp: torch.Tensor | None = None,  # [B, T] reference log-probs, when beta > 0
    beta: float = 0.0,
    kl_estimator: str = "k3",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Returns (scalar loss, metrics). Metrics are weighted by `weights` like the loss."""
    ratio = torch.exp((logp - old_logp).clamp(-20, 20))  # [B, T]
    adv = advantages[:, None]  # [B, 1]
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)  # [B, T]
    active = (weights > 0).float()
    metrics = {
        "clip_frac": float(((clipped < unclipped).float() * active).sum() / active.sum().clamp(min=1)),
        "ratio_mean": float((ratio.detach() * active).sum() / active.sum().clamp(min=1)),
    }
    if ref_logp is not None and beta > 0:
        kl = KL_ESTIMATORS[kl_estimator](logp, ref_logp)  # [B, T]
        per_token = per_token + beta * kl
        metrics["kl"] = float((kl.detach() * active).sum() / active.sum().clamp(min=1))
    loss = (per_token * weights).sum()
    return loss, metrics
