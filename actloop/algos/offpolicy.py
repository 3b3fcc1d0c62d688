"""Losses for stale data (pure functions): asynchronous RL, where the tokens of a batch were sampled
by older weights than the ones being trained (`rollout.max_staleness`). Shapes: B sequences, T tokens.

Decoupled PPO (Hilton et al. 2022, "Batch size-invariance for policy optimization"; used for LLMs by
AReaL, Fu et al. 2025, eq. 5) separates the policy that sampled the tokens from the one the update
stays close to:

    behaviour  mu        the engine's log-probs at sampling time (any older version, and the engine's
                         own numerics): the `logprobs` of every Turn
    proximal   pi_prox   the trainer's weights before this update
    current    pi_theta  the weights being optimised

    loss_t = -w_t * min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t),
    r_t    = pi_theta(y_t) / pi_prox(y_t)       the PPO ratio, clipped around the PROXIMAL policy
    w_t    = cap(pi_prox(y_t) / mu(y_t))         the behaviour weight, no gradient

Clipping around pi_prox rather than mu keeps the trust region the size PPO meant however old the
sample is; the weight w_t corrects the sampling distribution. w_t is the rollout-vs-trainer weight
of `actloop.algos.correction` with the trainer's log-probs being the proximal ones, so the
existing caps (tis_token / tis_seq truncation, mis_* masking) bound it. On fresh data (mu = the
same version as pi_prox) w_t is only the engine-vs-trainer mismatch and the loss is the
synchronous one.

The proximal log-probs cost a no-grad forward pass when the update takes several optimizer steps
(with one, pi_prox = pi_theta at the only step, so they are the current log-probs, detached). AReaL's
log-linear approximation replaces that pass (docs/algorithms/prox_approx.md in inclusionAI/AReaL):
with v_b the token's version, v_prox = the version before this update and v_theta = v_prox + 1,

    alpha = (v_prox - v_b) / (v_theta - v_b),   log pi_prox ~= log mu + alpha * (log pi_theta - log mu)

(alpha = 0 for a fresh token: the behaviour log-prob; alpha -> 1 as the token ages).
"""

from __future__ import annotations

import torch

from actloop.algos.correction import rollout_correction
from actloop.algos.losses import clipped_pg_loss


def approx_proximal_logp(
    behav_logp: torch.Tensor,  # [B, T] the engine's log-probs at sampling time
    logp: torch.Tensor,  # [B, T] current policy's log-probs (detached here)
    versions: torch.Tensor,  # [B, T] policy version of each sampled token
    version: int,  # the proximal policy's version (weight syncs before this update)
    mask: torch.Tensor,  # [B, T] sampled tokens
) -> torch.Tensor:
    """AReaL's log-linear proximal approximation -> [B, T] (behaviour log-prob off the mask)."""
    v_b = versions.float()  # [B, T]
    alpha = (version - v_b) / (version + 1 - v_b).clamp(min=1.0)  # [B, T] in [0, 1) for v_b <= version
    alpha = torch.where(mask.bool(), alpha.clamp(0.0, 1.0), torch.zeros_like(alpha))  # [B, T]
    return behav_logp + alpha * (logp.detach() - behav_logp)  # [B, T]


def decoupled_pg_loss(
    logp: torch.Tensor,  # [B, T] current policy, with gradient
    prox_logp: torch.Tensor,  # [B, T] proximal policy (weights before this update), detached
    behav_logp: torch.Tensor,  # [B, T] behaviour policy: the engine's log-probs at sampling time
    advantages: torch.Tensor,  # [B] or [B, T]
    weights: torch.Tensor,  # [B, T] aggregation weights (losses.token_weights)
    *,
    correction: str = "tis_token",  # key of correction.IS_CORRECTIONS; "none" = no behaviour weight
    cap: float = 2.0,
    upper: float = 2.0,
    lower: float | None = None,
    mask: torch.Tensor | None = None,  # [B, T] sampled tokens
    **pg_kwargs,  # clip_eps, clip_low/high, dual_clip, policy_loss, ref_logp, beta, kl_estimator, entropy...
) -> tuple[torch.Tensor, dict[str, float]]:
    """The decoupled objective: the clipped surrogate around `prox_logp`, each token weighted by the
    capped behaviour ratio pi_prox / mu (no gradient). Returns (scalar loss, metrics): those of
    `clipped_pg_loss` (ratio = current / proximal) and of `rollout_correction` (is_* = proximal /
    behaviour, mismatch_kl_* between them)."""
    if mask is None:
        mask = weights > 0
    metrics: dict[str, float] = {}
    is_w = None
    if correction != "none":
        is_w, metrics = rollout_correction(prox_logp, behav_logp, mask, correction, cap, upper, lower)  # [B, T]
    loss, pm = clipped_pg_loss(logp, prox_logp, advantages, weights, mask=mask, is_weights=is_w, **pg_kwargs)
    metrics.update(pm)
    return loss, metrics

