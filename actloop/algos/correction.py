"""Rollout-vs-trainer mismatch correction (pure functions). Shapes: B sequences, T tokens.

The engine that samples (vLLM, HF generate in bf16, a different kernel) and the trainer that
scores do not compute the same distribution: the tokens come from pi_engine, the gradient is
taken under pi_trainer. The importance ratio between them, per token,

    rho_t = pi_trainer(y_t) / pi_engine(y_t) = exp(logp_trainer_t - logp_engine_t)

(trainer log-probs of the old policy, detached) corrects the policy gradient back on-policy
(Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training";
Liu et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the
Training-Inference Mismatch"). Raw ratios have unbounded variance, so they are bounded:

    none       w_t = 1
    tis_token  w_t = min(rho_t, C)                           truncated IS, per token (Yao et al.)
    tis_seq    w_t = min(rho, C),   rho = prod_t rho_t       truncated IS, per sequence
    mis_token  w_t = rho_t * 1[lower <= rho_t <= upper]      masked IS: the token is dropped
    mis_seq    w_t = rho * 1[lower <= rho <= upper]          masked IS: the sequence is dropped (Liu et al.)

The weights multiply the per-token policy loss (`clipped_pg_loss(is_weights=...)`); they carry
no gradient. Metrics: the mismatch KL(pi_engine || pi_trainer) on the sampled tokens (k1 and k3),
the token ratio's min/mean/max, and the fractions of tokens masked (weight 0) and capped.
"""

from __future__ import annotations

import torch

from actloop.algos.kl import kl_k1, kl_k3

LOG_RATIO_CLAMP = 20.0


def _seq_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token log-ratios [B, T] -> the sequence's log-ratio sum_t, broadcast [B, T], clamped."""
    return (log_ratio * mask).sum(-1, keepdim=True).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).expand_as(log_ratio)


def _none(log_ratio, mask, cap, lower, upper):
    return mask, torch.exp(log_ratio)  # weights [B, T], ratio [B, T]


def _tis_token(log_ratio, mask, cap, lower, upper):
    ratio = torch.exp(log_ratio)  # [B, T]
    return ratio.clamp(max=cap) * mask, ratio


def _tis_seq(log_ratio, mask, cap, lower, upper):
    ratio = torch.exp(_seq_log_ratio(log_ratio, mask))  # [B, T] the sequence's rho on each token
    return ratio.clamp(max=cap) * mask, ratio


def _mis_token(log_ratio, mask, cap, lower, upper):
    ratio = torch.exp(log_ratio)  # [B, T]
    keep = (ratio >= lower) & (ratio <= upper)  # [B, T]
    return ratio * keep * mask, ratio


def _mis_seq(log_ratio, mask, cap, lower, upper):
    ratio = torch.exp(_seq_log_ratio(log_ratio, mask))  # [B, T]
    keep = (ratio >= lower) & (ratio <= upper)  # [B, T] whole sequences
    return ratio * keep * mask, ratio


IS_CORRECTIONS = {
    "none": _none,
    "tis_token": _tis_token,
    "tis_seq": _tis_seq,
    "mis_token": _mis_token,
    "mis_seq": _mis_seq,
}


@torch.no_grad()
def rollout_correction(
    trainer_logp: torch.Tensor,  # [B, T] old-policy log-probs recomputed by the trainer
    engine_logp: torch.Tensor,  # [B, T] log-probs the engine reported when sampling
    mask: torch.Tensor,  # [B, T] sampled tokens
    mode: str = "tis_token",  # key of IS_CORRECTIONS
    cap: float = 2.0,  # C for tis_*
    upper: float = 2.0,  # mis_* keeps ratios in [lower, upper]
    lower: float | None = None,  # defaults to 1 / upper
) -> tuple[torch.Tensor, dict[str, float]]:
    """-> (weights [B, T] to multiply into the per-token policy loss, 0 off the mask; metrics)."""
    m = mask.float()  # [B, T]
    lower = 1.0 / upper if lower is None else lower
    log_ratio = torch.where(m > 0, trainer_logp - engine_logp, torch.zeros_like(m))  # [B, T]
    log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # finite exp
    weights, ratio = IS_CORRECTIONS[mode](log_ratio, m, cap, lower, upper)  # [B, T], [B, T]
    n = m.sum().clamp(min=1)
    active = m > 0  # [B, T]
    tok_ratio = torch.exp(log_ratio)  # [B, T]
    any_active = bool(active.any())
    metrics = {
        "mismatch_kl_k1": float((kl_k1(engine_logp, trainer_logp) * m).sum() / n),
        "mismatch_kl_k3": float((kl_k3(engine_logp, trainer_logp) * m).sum() / n),
        "is_ratio_min": float(tok_ratio[active].min()) if any_active else 1.0,
        "is_ratio_mean": float((tok_ratio * m).sum() / n),
        "is_ratio_max": float(tok_ratio[active].max()) if any_active else 1.0,
        "is_masked_frac": float(((weights == 0) & active).float().sum() / n),
        "is_capped_frac": float(((weights > 0) & (weights < ratio) & active).float().sum() / n),
        "is_weight_mean": float((weights * m).sum() / n),
    }
    return weights, metrics
