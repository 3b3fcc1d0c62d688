"""KL control between the policy and a reference (pure functions).

Per-token estimators (Schulman 2020, "Approximating KL Divergence"), with log-ratio
x = log pi_ref(a) - log pi(a) for a ~ pi:

    k1 = -x                      unbiased, high variance, can be negative
    k2 = x^2 / 2                 biased, low variance
    k3 = exp(x) - 1 - x          unbiased, low variance, always >= 0   (GRPO's choice)

Two ways to apply it (the trainer picks one):
    as a loss term      loss_t += beta * KL_t                 (GRPO; `clipped_pg_loss(ref_logp=, beta=)`)
    as a reward penalty r_t    -= beta * KL_t on every token  (Ziegler et al. 2019, InstructGPT,
                        REINFORCE++; `kl_reward_penalty`, then a per-token advantage estimator)

The coefficient beta is fixed, or adapted toward a target KL (Ziegler et al. 2019):

    e      = clip(KL_observed / KL_target - 1, -0.2, 0.2)
    beta' = beta * (1 + e * n_steps / horizon)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """[B, T], [B, T] -> [B, T]: log pi - log pi_ref."""
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """[B, T], [B, T] -> [B, T]: (log pi_ref - log pi)^2 / 2."""
    return 0.5 * (ref_logp - logp) ** 2


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """[B, T], [B, T] -> [B, T]: exp(x) - 1 - x with x = log pi_ref - log pi, clamped to +-20."""
    x = (ref_logp - logp).clamp(-20, 20)  # guards exp against extreme ratios
    return torch.exp(x) - 1 - x


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_reward_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, beta: float,
                      estimator: str = "k1") -> torch.Tensor:
    """Per-token reward adjustments for KL-in-reward: -beta * KL_t on sampled tokens, 0 elsewhere.

    logp, ref_logp, mask [B, T] -> [B, T], detached (a reward, not a loss). Add it to the
    per-token rewards (`place_rewards_at_turn_ends`) before `gae_advantages` or
    `reinforce_pp_token_advantages`. k1 is the classic choice (its sum over a sequence is the
    sequence-level log-ratio, an unbiased estimate of the sequence KL)."""
    kl = KL_ESTIMATORS[estimator](logp.detach(), ref_logp.detach())  # [B, T]
    return -beta * kl * mask.float()  # [B, T]


def next_beta(beta: float, observed_kl: float, target_kl: float, horizon: float, n_steps: int) -> float:
    """Adaptive KL coefficient, Ziegler et al. 2019 ("Fine-Tuning Language Models from Human
    Preferences", eq. 2.5): a proportional controller on log(beta),

        e_t      = clip(KL_t / KL_target - 1, -0.2, 0.2)
        beta_t+1 = beta_t * (1 + K_beta * e_t),   K_beta = n_steps / horizon

    n_steps: samples (or steps) since the last update; horizon: how many of them it takes to
    close most of the gap (Ziegler: 10,000)."""
    error = min(max(observed_kl / target_kl - 1.0, -0.2), 0.2)
    return beta * (1.0 + error * n_steps / horizon)


def fixed_beta(beta: float, observed_kl: float, target_kl: float, horizon: float, n_steps: int) -> float:
    """A fixed coefficient: beta does not change (same signature as `next_beta`)."""
    return beta


KL_CONTROLLERS = {"fixed": fixed_beta, "adaptive": next_beta}


@dataclass(frozen=True)
class AdaptiveKLController:
    """Holds the controller's constants; `next` is pure (the caller keeps beta)."""

    target_kl: float
    horizon: float = 10_000.0

    def next(self, beta: float, observed_kl: float, n_steps: int) -> float:
        return next_beta(beta, observed_kl, self.target_kl, self.horizon, n_steps)
