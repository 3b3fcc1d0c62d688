"""Direct preference losses (pure functions). N = number of preference pairs.

Inputs are sequence log-probabilities (sums over the completion's sampled tokens) of the chosen
(w) and rejected (l) completions under the policy (pi) and the frozen reference (ref). With

    h = (log pi(w) - log ref(w)) - (log pi(l) - log ref(l))        [N]

    sigmoid  L = -(1 - s) log sigma(beta h) - s log sigma(-beta h)
             DPO, Rafailov et al. 2023; label smoothing s (conservative DPO, Mitchell 2023)
    ipo      L = (h - 1 / (2 beta))^2
             IPO, Azar et al. 2023 ("A General Theoretical Paradigm ..."). The paper (and TRL)
             use log-probs averaged over tokens rather than summed: pass means if you want that.

Implicit rewards: r(w) = beta (log pi(w) - log ref(w)), r(l) likewise; metrics report their
mean, the margin r(w) - r(l) and the accuracy mean[r(w) > r(l)].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sigmoid_dpo(h: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """h [N] -> per-pair loss [N]. log-sigmoid is stable for any h (finite for |h| large)."""
    return -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)  # [N]


def ipo(h: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """h [N] -> per-pair loss [N]; label_smoothing is not used by IPO."""
    return (h - 1 / (2 * beta)) ** 2  # [N]


DPO_LOSSES = {"sigmoid": sigmoid_dpo, "ipo": ipo}


def dpo_loss(
    policy_chosen_logps: torch.Tensor,  # [N] sum of log pi over the chosen completion
    policy_rejected_logps: torch.Tensor,  # [N]
    ref_chosen_logps: torch.Tensor,  # [N] same under the reference (no gradient)
    ref_rejected_logps: torch.Tensor,  # [N]
    beta: float = 0.1,
    loss_type: str = "sigmoid",  # key of DPO_LOSSES
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean preference loss over the N pairs, and metrics. N = 0 gives loss 0 (no NaN)."""
    chosen = policy_chosen_logps - ref_chosen_logps.detach()  # [N] log-ratio of the chosen
    rejected = policy_rejected_logps - ref_rejected_logps.detach()  # [N]
    h = chosen - rejected  # [N]
    losses = DPO_LOSSES[loss_type](h, beta, label_smoothing)  # [N]
    n = max(h.numel(), 1)
    loss = losses.sum() / n
    r_w, r_l = beta * chosen.detach(), beta * rejected.detach()  # [N] implicit rewards
    metrics = {
        "dpo_loss": float(loss.detach()),
        "rewards_chosen": float(r_w.sum() / n),
        "rewards_rejected": float(r_l.sum() / n),
        "reward_margin": float((r_w - r_l).sum() / n),
        "reward_accuracy": float((r_w > r_l).float().sum() / n),
        "pairs": float(h.numel()),
    }
    return loss, metrics


def build_preference_pairs(rewards: torch.Tensor, valid: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Online pairs from rollout groups: in each group, the best-rewarded sample is chosen and the
    worst rejected; groups whose best and worst tie (or with < 2 valid samples) are skipped.
    Ties within the best (or worst) go to the lowest index, so the result is deterministic.

    rewards [P, G], valid [P, G] -> (chosen [M], rejected [M], group [M]) as long tensors;
    chosen / rejected are flat indices into the P * G trajectories (row-major)."""
    rewards = rewards.float()  # [P, G]
    P, G = rewards.shape
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    inf = float("inf")
    hi = torch.where(valid, rewards, -inf)  # [P, G] invalid can never be best
    lo = torch.where(valid, rewards, inf)  # [P, G] ... nor worst
    best = hi.max(-1)  # values [P], first index of the max
    worst = lo.min(-1)  # [P]
    keep = (valid.sum(-1) >= 2) & (best.values > worst.values)  # [P]
    group = keep.nonzero(as_tuple=True)[0]  # [M]
    offset = group * G  # [M]
    return offset + best.indices[group], offset + worst.indices[group], group
