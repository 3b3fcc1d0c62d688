"""Policy-gradient and value losses (pure functions). Shapes: B sequences, T token positions.

Clipped surrogate (PPO, Schulman et al. 2017; GRPO, Shao et al. 2024), per token:

    ratio_t = exp(logp_t - old_logp_t)
    loss_t  = -min(ratio_t * A_t, clip(ratio_t, 1 - clip_low, 1 + clip_high) * A_t)
    dual clip (Ye et al. 2020), for A_t < 0 only:  loss_t = min(loss_t, -c * A_t)   (c > 1)
    (+ beta * KL_t)  (- entropy_coef * H_t)

clip_low = clip_high is PPO; clip_high > clip_low is DAPO's clip-higher (Yu et al. 2025): it lets
low-probability tokens with positive advantage grow further, which keeps entropy from collapsing.

Policy losses (POLICY_LOSSES) differ only in the ratio:
    ppo_clip  token ratio  exp(logp_t - old_logp_t)
    gspo      sequence ratio (Zheng et al. 2025, GSPO), the geometric mean of the token ratios
                  s_i = exp(1/|y_i| * sum_t (logp_t - old_logp_t))
              clipped at sequence level: every token of sequence i carries s_i. Written in the
              GSPO-token form s_i,t = sg[s_i] * exp(logp_t - sg[logp_t]) (value s_i, gradient
              s_i * grad logp_t), which with `seq_mean` aggregation has exactly GSPO's loss and
              gradient and also accepts per-token advantages. GSPO's clip ranges are tiny
              (the paper uses 3e-4 / 4e-4).

Aggregation over tokens (LOSS_AGGREGATIONS), written as per-token weights w so that
loss = sum(loss_t * w_t) and a batch split into micro-batches accumulates the same gradient:
    seq_mean    1 / (|y_i| * num_seqs)        mean of per-sequence token means (original GRPO)
    token_mean  1 / num_tokens                 every token of the batch counts once (DAPO)
    constant    1 / (max_tokens * num_seqs)    Dr. GRPO: no length normalisation per sequence

On-policy fast path: with ONE update per rollout batch, the old policy is the current one, so
old_logp = logp.detach(): the ratio is identically 1 (value), no token is clipped, and the
gradient is the plain policy gradient -A_t * grad logp_t * w_t. No extra forward pass is needed
for old log-probs. With several updates (epochs / mini-batches, see `minibatches`), old_logp must
be computed once, before the first update, and kept fixed.
"""

from __future__ import annotations

from typing import Callable

import torch

from actloop.algos.kl import KL_ESTIMATORS

LOG_RATIO_CLAMP = 20.0  # |log ratio| beyond this is clamped before exp: e^20 ~ 5e8, finite in fp32

# ---------------------------------------------------------------------------------------------
# aggregation: mask [B, T] -> weights [B, T]
# ---------------------------------------------------------------------------------------------


def _seq_mean(mask: torch.Tensor, num_seqs: int, num_tokens: int, max_tokens: int | None) -> torch.Tensor:
    return mask / mask.sum(-1, keepdim=True).clamp(min=1) / max(num_seqs, 1)  # [B, T]


def _token_mean(mask: torch.Tensor, num_seqs: int, num_tokens: int, max_tokens: int | None) -> torch.Tensor:
    return mask / max(num_tokens, 1)  # [B, T]


def _constant(mask: torch.Tensor, num_seqs: int, num_tokens: int, max_tokens: int | None) -> torch.Tensor:
    if max_tokens is None:
        raise ValueError("loss aggregation 'constant' needs max_tokens (the generation budget per sequence)")
    return mask / (max(max_tokens, 1) * max(num_seqs, 1))  # [B, T]


LOSS_AGGREGATIONS: dict[str, Callable[[torch.Tensor, int, int, int | None], torch.Tensor]] = {
    "seq_mean": _seq_mean,  # GRPO
    "token_mean": _token_mean,  # DAPO
    "constant": _constant,  # Dr. GRPO
}


def token_weights(mask: torch.Tensor, agg: str, num_seqs: int, num_tokens: int,
                  max_tokens: int | None = None) -> torch.Tensor:
    """mask [B, T] -> weights [B, T] whose weighted sum aggregates a per-token loss.

    num_seqs / num_tokens are the totals over the whole batch (all micro-batches) that make one
    optimizer step; max_tokens is the generation budget per sequence (for `constant` only)."""
    if agg not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {agg!r}; choose from {sorted(LOSS_AGGREGATIONS)}")
    return LOSS_AGGREGATIONS[agg](mask.float(), num_seqs, num_tokens, max_tokens)


# ---------------------------------------------------------------------------------------------
# policy losses: ratio + clipped surrogate, per token
# ---------------------------------------------------------------------------------------------


def token_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """PPO's per-token ratio exp(logp - old_logp) [B, T], log clamped to +-20 (finite)."""
    log_ratio = torch.where(mask.bool(), logp - old_logp, torch.zeros_like(logp))  # [B, T]
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [B, T]


def sequence_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence ratio in GSPO-token form, [B, T]: value s_i = exp(mean_t log ratio) on
    every token of sequence i, gradient s_i * grad logp_t."""
    m = mask.bool()  # [B, T]
    log_ratio = torch.where(m, logp - old_logp, torch.zeros_like(logp))  # [B, T]
    n = m.sum(-1, keepdim=True).clamp(min=1)  # [B, 1] tokens per sequence
    log_s = (log_ratio.sum(-1, keepdim=True) / n).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [B, 1]
    grad_path = torch.where(m, logp - logp.detach(), torch.zeros_like(logp))  # [B, T] value 0, gradient 1
    return torch.exp(log_s.detach() + grad_path)  # [B, T] value s_i, gradient s_i * dlogp_t


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float,
                      dual_clip: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped-surrogate loss. ratio [B, T], advantages [B, T] -> (loss [B, T], flags),
    flags: "clipped" [B, T] (the clipped branch won the min), "dual_clipped" [B, T]."""
    unclipped = ratio * advantages  # [B, T]
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * advantages  # [B, T]
    surrogate = torch.minimum(unclipped, clipped)  # [B, T] pessimistic bound
    dual = torch.zeros_like(surrogate, dtype=torch.bool)  # [B, T]
    if dual_clip is not None:  # Ye et al. 2020: a negative advantage times a huge ratio is bounded by c * A
        floor = dual_clip * advantages  # [B, T]
        dual = (advantages < 0) & (surrogate < floor)  # [B, T]
        surrogate = torch.where(dual, floor, surrogate)  # [B, T] (constant there: no gradient)
    return -surrogate, {"clipped": clipped < unclipped, "dual_clipped": dual}


def ppo_clip_loss(logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.2, dual_clip=None):
    """PPO / GRPO / DAPO: token ratio, clipped per token. All tensors [B, T] ->
    (loss [B, T], ratio [B, T], flags)."""
    ratio = token_ratio(logp, old_logp, mask)  # [B, T]
    loss, flags = clipped_surrogate(ratio, advantages, clip_low, clip_high, dual_clip)
    return loss, ratio, flags


def gspo_loss(logp, old_logp, advantages, mask, clip_low=3e-4, clip_high=4e-4, dual_clip=None):
    """GSPO (Zheng et al. 2025): sequence ratio, clipped per sequence. All tensors [B, T] ->
    (loss [B, T], ratio [B, T], flags). Use with `seq_mean` aggregation."""
    ratio = sequence_ratio(logp, old_logp, mask)  # [B, T]
    loss, flags = clipped_surrogate(ratio, advantages, clip_low, clip_high, dual_clip)
    return loss, ratio, flags


POLICY_LOSSES = {
    "ppo_clip": ppo_clip_loss,
    "gspo": gspo_loss,
}


def entropy_bonus(entropy: torch.Tensor, weights: torch.Tensor, coef: float) -> torch.Tensor:
    """Scalar term to ADD to the loss: -coef * sum(H_t * w_t). entropy [B, T] must carry
    gradient for the bonus to act (a detached entropy only reports)."""
    return -coef * (entropy * weights).sum()


def _masked_mean(x: torch.Tensor, active: torch.Tensor) -> float:
    return float((x * active).sum() / active.sum().clamp(min=1))


def clipped_pg_loss(
    logp: torch.Tensor,  # [B, T] current policy log-probs of the sampled tokens
    old_logp: torch.Tensor,  # [B, T] log-probs at sampling time (detached)
    advantages: torch.Tensor,  # [B] one advantage per sequence, or [B, T] one per token
    weights: torch.Tensor,  # [B, T] from token_weights (0 on masked tokens)
    clip_eps: float = 0.2,
    ref_logp: torch.Tensor | None = None,  # [B, T] reference log-probs, when beta > 0
    beta: float = 0.0,
    kl_estimator: str = "k3",
    *,
    policy_loss: str = "ppo_clip",  # key of POLICY_LOSSES
    clip_low: float | None = None,  # defaults to clip_eps
    clip_high: float | None = None,  # defaults to clip_low (DAPO clip-higher: e.g. 0.28)
    dual_clip: float | None = None,  # c > 1 for negative advantages (None = off)
    mask: torch.Tensor | None = None,  # [B, T] sampled tokens; defaults to weights > 0
    is_weights: torch.Tensor | None = None,  # [B, T] rollout-mismatch correction (correction.py)
    entropy: torch.Tensor | None = None,  # [B, T] per-token entropy, for the bonus / metric
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy loss, aggregated: sum_t w_t * (is_t * pg_t + beta * KL_t) - entropy_coef * sum_t w_t H_t.

    Returns (scalar loss, metrics); metrics are means over the active tokens."""
    if mask is None:
        mask = weights > 0
    active = mask.float()  # [B, T]
    adv = advantages[:, None] if advantages.dim() == 1 else advantages  # [B, 1] or [B, T]
    adv = adv.to(logp.dtype).expand_as(logp)  # [B, T]
    low = clip_eps if clip_low is None else clip_low
    high = low if clip_high is None else clip_high
    pg, ratio, flags = POLICY_LOSSES[policy_loss](logp, old_logp, adv, mask, low, high, dual_clip)  # [B, T] each
    if is_weights is not None:
        pg = pg * is_weights.detach()  # [B, T]
    per_token = pg  # [B, T]
    r = ratio.detach()
    clipped = flags["clipped"].float()  # [B, T]
    metrics = {
        "pg_loss": float((pg.detach() * weights).sum()),
        "clip_frac": _masked_mean(clipped, active),
        "clip_frac_low": _masked_mean(clipped * (r < 1).float(), active),
        "clip_frac_high": _masked_mean(clipped * (r > 1).float(), active),
        "dual_clip_frac": _masked_mean(flags["dual_clipped"].float(), active),
        "ratio_mean": _masked_mean(r, active),
        "ratio_max": float(torch.where(active > 0, r, torch.zeros_like(r)).max()) if r.numel() else 0.0,
    }
    if ref_logp is not None and beta > 0:
        kl = KL_ESTIMATORS[kl_estimator](logp, ref_logp)  # [B, T]
        kl = torch.where(mask.bool(), kl, torch.zeros_like(kl))  # [B, T] nothing from padding
        per_token = per_token + beta * kl
        metrics["kl"] = _masked_mean(kl.detach(), active)
    loss = (per_token * weights).sum()
    if entropy is not None:
        metrics["entropy"] = _masked_mean(entropy.detach(), active)
        if entropy_coef:
            loss = loss + entropy_bonus(entropy, weights, entropy_coef)
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# critic
# ---------------------------------------------------------------------------------------------


def value_loss(
    values: torch.Tensor,  # [B, T] current critic predictions
    old_values: torch.Tensor,  # [B, T] critic predictions at rollout time (detached)
    returns: torch.Tensor,  # [B, T] regression targets (from gae_advantages)
    weights: torch.Tensor,  # [B, T] from token_weights
    value_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO value loss (Schulman et al. 2017; clipping as in OpenAI baselines):

        L_t = 1/2 * max((V_t - R_t)^2, (V_old_t + clip(V_t - V_old_t, -c, c) - R_t)^2)

    (just 1/2 (V_t - R_t)^2 when value_clip is None), aggregated as sum(L_t * w_t)."""
    active = (weights > 0).float()  # [B, T]
    err = (values - returns) ** 2  # [B, T]
    clip_frac = 0.0
    if value_clip is not None:
        v_clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)  # [B, T]
        err_clipped = (v_clipped - returns) ** 2  # [B, T]
        clip_frac = _masked_mean((err_clipped > err).float(), active)
        err = torch.maximum(err, err_clipped)  # [B, T]
    loss = 0.5 * (err * weights).sum()
    return loss, {"value_loss": float(loss.detach()), "value_clip_frac": clip_frac,
                  "value_mean": _masked_mean(values.detach(), active)}
