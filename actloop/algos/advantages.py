"""Advantage estimators (pure functions), selected by name from `ADVANTAGE_ESTIMATORS`.

Shapes: P prompts, G samples per prompt (a group), B = P * G sequences, T token positions,
K assistant turns per episode. "Valid" marks trajectories (or turns) that count; failed rollouts
are masked, get advantage 0 and never enter a baseline.

Outcome (one reward per trajectory, [P, G] -> [P, G]):
    grpo           A_i = (r_i - mean_g r) / (std_g r + eps)          Shao et al. 2024 (DeepSeekMath)
    grpo_batch_std A_i = (r_i - mean_g r) / (std_batch(r - mean_g r) + eps)
                                          REINFORCE++-baseline, Hu et al. 2025; Liu et al. 2025 (Lite PPO)
    dr_grpo        A_i =  r_i - mean_g r                             Liu et al. 2025 (Dr. GRPO)
    rloo           A_i =  r_i - mean_{j != i} r_j                    Ahmadian et al. 2024
    reinforce_pp   A_i = (r_i - mean_batch r) / (std_batch r + eps)  Hu et al. 2025 (REINFORCE++)
Per token ([B, T] -> [B, T]):
    reinforce_pp_token  discounted return-to-go of per-token rewards (KL-in-reward), whitened
                        over the batch's tokens                      Hu et al. 2025
    gae                 GAE(gamma, lambda) with a critic             Schulman et al. 2016
    turn_grpo           per-turn discounted return-to-go minus the group mean at the same turn
                        index, broadcast to the turn's tokens        (see docs/algorithms.md)

Every std is the unbiased sample std (as TRL computes it). A group whose rewards are all equal
carries no signal: its advantages are exactly 0 (never NaN, even with eps=0). A group with one
valid sample has advantage 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


# ---------------------------------------------------------------------------------------------
# outcome-reward estimators: rewards [P, G] -> advantages [P, G]
# ---------------------------------------------------------------------------------------------


def _safe_div(x: torch.Tensor, std: torch.Tensor, eps: float) -> torch.Tensor:
    """x / (std + eps), and exactly 0 where std == 0 (then x is 0 too: nothing to scale)."""
    return torch.where(std > 0, x / (std + eps), torch.zeros_like(x))


def _group_std(centered: torch.Tensor, v: torch.Tensor, n: torch.Tensor, eps: float) -> torch.Tensor:
    """Divide by the unbiased std of each group. centered [P, G] (0 where invalid), n [P, 1]."""
    std = ((centered**2).sum(-1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()  # [P, 1]
    return _safe_div(centered, std, eps)  # [P, G]


def _batch_std(centered: torch.Tensor, v: torch.Tensor, n: torch.Tensor, eps: float) -> torch.Tensor:
    """Divide by the unbiased std of the group-centred rewards over every valid sample of a group
    with >= 2 valid samples (a single-sample group has no centred reward to speak of)."""
    counted = v * (n > 1)  # [P, G]
    N = counted.sum()  # scalar: samples that carry a centred reward
    std = ((centered**2 * counted).sum() / (N - 1).clamp(min=1)).sqrt()  # scalar
    return _safe_div(centered, std, eps)  # [P, G]


def _no_std(centered: torch.Tensor, v: torch.Tensor, n: torch.Tensor, eps: float) -> torch.Tensor:
    return centered  # [P, G]: Dr. GRPO does not scale


# how grpo_advantages scales the group-centred rewards: one table, no if/elif
ADVANTAGE_SCALES: dict[str, Callable[..., torch.Tensor]] = {
    "group": _group_std,  # GRPO
    "batch": _batch_std,  # group mean, batch std (REINFORCE++-baseline / Lite PPO)
    "none": _no_std,  # Dr. GRPO
}


def grpo_advantages(rewards: torch.Tensor, valid: torch.Tensor | None = None, scale: bool | str = True,
                    eps: float = 1e-4) -> torch.Tensor:
    """rewards [P, G] (P prompts, G samples each) -> advantages [P, G].

        A_i = (r_i - mean_group(r)) / (s + eps)

    with s chosen by `scale` (a key of ADVANTAGE_SCALES, or a bool for backward compatibility):
        "group" (True)  s = std of the group's rewards               GRPO, Shao et al. 2024
        "batch"         s = std of all group-centred rewards in the batch
        "none"  (False) s = 1, no eps                                Dr. GRPO, Liu et al. 2025

    valid [P, G] (bool) marks trajectories that count; masked ones (failed rollouts) get 0 and
    do not enter their group's mean or any std.
    """
    if isinstance(scale, bool):
        scale = "group" if scale else "none"
    rewards = rewards.float()  # [P, G]
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    rewards = torch.where(valid.bool(), rewards, torch.zeros_like(rewards))  # a masked NaN reward stays out
    v = valid.float()  # [P, G]
    n = v.sum(-1, keepdim=True)  # [P, 1] valid samples per group
    mean = (rewards * v).sum(-1, keepdim=True) / n.clamp(min=1)  # [P, 1]
    centered = (rewards - mean) * v  # [P, G], 0 where invalid
    adv = ADVANTAGE_SCALES[scale](centered, v, n, eps)  # [P, G]
    return torch.where(n > 1, adv, torch.zeros_like(adv)) * v  # [P, G]


def dr_grpo_advantages(rewards: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): A_i = r_i - mean_group(r).
    rewards [P, G] -> [P, G]. Pair it with the `constant` loss aggregation."""
    return grpo_advantages(rewards, valid, scale="none")


def grpo_batch_std_advantages(rewards: torch.Tensor, valid: torch.Tensor | None = None,
                              eps: float = 1e-4) -> torch.Tensor:
    """Group mean, batch std: A_i = (r_i - mean_group(r)) / (std_batch(r - mean_group(r)) + eps).
    rewards [P, G] -> [P, G]. A group of easy (or hopeless) prompts with a tiny std is not blown
    up to unit scale, as it is with the group std."""
    return grpo_advantages(rewards, valid, scale="batch", eps=eps)


def rloo_advantages(rewards: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024, "Back to Basics"; Kool et al. 2019): leave-one-out baseline,

        A_i = r_i - 1/(n-1) * sum_{j != i} r_j  =  n/(n-1) * (r_i - mean_group(r))

    The baseline does not depend on sample i, so the estimator is unbiased.
    rewards [P, G] -> [P, G]; groups with fewer than 2 valid samples get 0."""
    rewards = rewards.float()  # [P, G]
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    rewards = torch.where(valid.bool(), rewards, torch.zeros_like(rewards))  # a masked NaN reward stays out
    v = valid.float()  # [P, G]
    n = v.sum(-1, keepdim=True)  # [P, 1]
    total = (rewards * v).sum(-1, keepdim=True)  # [P, 1]
    baseline = (total - rewards * v) / (n - 1).clamp(min=1)  # [P, G] mean of the others
    adv = rewards - baseline  # [P, G]
    return torch.where(n > 1, adv, torch.zeros_like(adv)) * v  # [P, G]


def reinforce_pp_advantages(rewards: torch.Tensor, valid: torch.Tensor | None = None,
                            eps: float = 1e-4) -> torch.Tensor:
    """REINFORCE++ (Hu et al. 2025), outcome rewards: no per-prompt baseline, the whole batch is
    normalised together,

        A_i = (r_i - mean_batch(r)) / (std_batch(r) + eps)

    rewards [P, G] -> [P, G] (G may be 1). For the token-level KL-in-reward form see
    `reinforce_pp_token_advantages`."""
    rewards = rewards.float()  # [P, G]
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    return masked_whiten(rewards, valid, eps=eps)  # [P, G]


# ---------------------------------------------------------------------------------------------
# per-token estimators: [B, T] -> [B, T]
# ---------------------------------------------------------------------------------------------


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """(x - mean) / (std + eps) over the entries where mask is 1 (unbiased std), 0 elsewhere.
    x, mask [...] -> [...]. Fewer than 2 entries, or std 0, give 0: never NaN."""
    m = mask.float()  # [...]
    x = torch.where(mask.bool(), x.float(), torch.zeros_like(m))  # [...] masked entries never enter
    N = m.sum()  # scalar
    mean = (x * m).sum() / N.clamp(min=1)  # scalar
    centered = (x - mean) * m  # [...]
    std = ((centered**2).sum() / (N - 1).clamp(min=1)).sqrt()  # scalar (0 when N <= 1)
    return _safe_div(centered, std, eps)  # [...]


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Return-to-go over the sampled tokens of each sequence:

        R_t = r_t + gamma * R_{t'}      t' = the next position with mask 1 (R = 0 after the last)

    Positions with mask 0 (prompt, env/tool tokens, padding) are skipped: they are not actions,
    and a reward placed on them is ignored (put rewards on sampled tokens, e.g. with
    `place_rewards_at_turn_ends`). token_rewards, mask [B, T] -> returns [B, T] (0 where mask 0)."""
    values = torch.zeros_like(token_rewards, dtype=torch.float)  # [B, T]
    returns, _ = gae_advantages(token_rewards, values, mask, gamma=gamma, lam=1.0)
    return returns  # [B, T]


def reinforce_pp_token_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                                  eps: float = 1e-4) -> torch.Tensor:
    """REINFORCE++ (Hu et al. 2025) with per-token rewards, e.g. the outcome reward on the last
    token plus a KL penalty -beta * KL_t on every token (`kl_reward_penalty`):

        G_t = sum_{s >= t} gamma^(s - t) r_s          (over sampled tokens)
        A_t = (G_t - mean_batch(G)) / (std_batch(G) + eps)   (over every sampled token of the batch)

    token_rewards, mask [B, T] -> advantages [B, T] (0 where mask 0)."""
    returns = discounted_returns(token_rewards, mask, gamma)  # [B, T]
    return masked_whiten(returns, mask, eps=eps)  # [B, T]


@torch.no_grad()
def gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                   lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016, "High-Dimensional Continuous
    Control Using GAE"), one step per sampled token:

        delta_t = r_t + gamma * V_{t'} - V_t                 t' = next sampled position (V = 0 at the end)
        A_t     = delta_t + gamma * lam * A_{t'}
        R_t     = A_t + V_t                                  (the critic's regression target)

    Positions with mask 0 (env/tool tokens between turns, padding) are skipped, so in a multi-turn
    episode the state after a turn's last token is valued at the next turn's first token. The
    episode is treated as terminated after its last sampled token (V = 0 there).

    token_rewards [B, T], values [B, T] (critic, detached), mask [B, T]
    -> (advantages [B, T], returns [B, T]), both 0 where mask is 0. Not whitened: use
    `masked_whiten(advantages, mask)` for PPO's usual batch normalisation."""
    r = token_rewards.float()  # [B, T]
    V = values.float()  # [B, T]
    m = mask.bool()  # [B, T]
    B, T = r.shape
    adv = torch.zeros_like(r)  # [B, T]
    next_value = torch.zeros(B, dtype=r.dtype, device=r.device)  # [B] V_{t'}
    next_adv = torch.zeros(B, dtype=r.dtype, device=r.device)  # [B] A_{t'}
    for t in range(T - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - V[:, t]  # [B]
        a_t = delta + gamma * lam * next_adv  # [B]
        adv[:, t] = torch.where(m[:, t], a_t, torch.zeros_like(a_t))
        next_value = torch.where(m[:, t], V[:, t], next_value)  # skipped positions carry V_{t'} through
        next_adv = torch.where(m[:, t], a_t, next_adv)
    returns = (adv + V) * m  # [B, T]
    return adv, returns


# ---------------------------------------------------------------------------------------------
# turns: ids, reward placement, turn-level credit
# ---------------------------------------------------------------------------------------------


def turn_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """mask [B, T] (1 on sampled tokens) -> turn_ids [B, T]: k on the tokens of the k-th
    assistant turn (0-based), -1 elsewhere.

    Each maximal run of 1s is one turn: consecutive turns are always separated by env tokens
    (closing tags, tool results, the next generation prompt), which have mask 0. A turn with no
    sampled token has no run; build turn ids from the trajectory's turns if that can happen."""
    m = mask.bool()  # [B, T]
    prev = torch.zeros_like(m)  # [B, T] mask shifted right by one
    prev[:, 1:] = m[:, :-1]
    starts = m & ~prev  # [B, T] first token of each turn
    ids = starts.long().cumsum(-1) - 1  # [B, T]
    return torch.where(m, ids, torch.full_like(ids, -1))  # [B, T]


def turn_end_positions(turn_ids: torch.Tensor, num_turns: int) -> torch.Tensor:
    """turn_ids [B, T] -> positions [B, K] (K = num_turns) of the last token of each turn; -1 for
    a turn the sequence does not have."""
    B, T = turn_ids.shape
    k = torch.arange(num_turns, device=turn_ids.device)  # [K]
    pos = torch.arange(T, device=turn_ids.device)  # [T]
    in_turn = turn_ids[:, None, :] == k[None, :, None]  # [B, K, T]
    return torch.where(in_turn, pos, torch.full_like(pos, -1)).amax(-1)  # [B, K]


def place_rewards_at_turn_ends(turn_rewards: torch.Tensor, end_positions: torch.Tensor, num_positions: int) -> torch.Tensor:
    """Per-token rewards from per-turn rewards: turn k's reward sits on the last sampled token of
    turn k, every other position gets 0.

    turn_rewards [B, K], end_positions [B, K] (long; -1 = no such turn, its reward is dropped;
    from `turn_end_positions`) -> token_rewards [B, T] with T = num_positions. Feed the result
    to `gae_advantages` or `reinforce_pp_token_advantages` (add `kl_reward_penalty` for KL in
    the reward). An outcome reward is the case K = 1 (or the reward on the last turn)."""
    present = end_positions >= 0  # [B, K]
    idx = end_positions.clamp(min=0).long()  # [B, K]
    src = turn_rewards.float() * present  # [B, K]
    out = torch.zeros(turn_rewards.shape[0], num_positions, dtype=src.dtype, device=src.device)  # [B, T]
    if num_positions == 0:  # no sampled token anywhere: nowhere to put a reward
        return out
    return out.scatter_add_(1, idx, src)  # [B, T]


def turn_returns(turn_rewards: torch.Tensor, turn_valid: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Discounted return-to-go per turn: G_k = sum_{k' >= k} gamma^(k' - k) r_{k'} over the valid
    turns. turn_rewards, turn_valid [..., K] -> [..., K] (0 where invalid)."""
    r = torch.where(turn_valid.bool(), turn_rewards.float(), torch.zeros_like(turn_rewards, dtype=torch.float))  # [..., K]
    out = torch.zeros_like(r)  # [..., K]
    running = torch.zeros_like(r[..., 0])  # [...]
    for k in range(r.shape[-1] - 1, -1, -1):
        running = r[..., k] + gamma * running  # [...]
        out[..., k] = running
    return out * turn_valid.float()  # [..., K]


def turn_level_advantages(turn_rewards: torch.Tensor, turn_valid: torch.Tensor, turn_ids: torch.Tensor,
                          gamma: float = 1.0, scale: bool | str = False, leave_one_out: bool = False,
                          eps: float = 1e-4) -> torch.Tensor:
    """Turn-level credit for multi-turn episodes (derivation in docs/algorithms.md).

    For sample i of a group and assistant turn k, with per-turn rewards r_{i,k}:

        G_{i,k} = sum_{k' >= k} gamma^(k' - k) r_{i,k'}         return-to-go from turn k
        b_k     = mean of G_{j,k} over the group's samples j that reached turn k
                  (leave_one_out: over j != i — unbiased, like RLOO)
        A_{i,k} = G_{i,k} - b_k          (scale: / (std_k + eps), per-turn GRPO normalisation;
                                          a key of ADVANTAGE_SCALES, as grpo_advantages takes it)

    and every sampled token of turn k gets A_{i,k}. A turn only one sample reached has no
    comparison and gets 0 (its return still counts in the earlier turns' G).

    turn_rewards [P, G, K], turn_valid [P, G, K] (bool: sample reached turn k and is not masked),
    turn_ids [B, T] (B = P * G, row-major; from `turn_ids_from_mask`) -> advantages [B, T]
    (0 on tokens with turn id -1)."""
    P, G, K = turn_rewards.shape
    v = turn_valid.float()  # [P, G, K]
    ret = turn_returns(turn_rewards, v, gamma)  # [P, G, K]
    # the group baseline per turn index = grpo over the group axis, one "group" per (prompt, turn)
    ret_pk = ret.transpose(1, 2).reshape(P * K, G)  # [P*K, G]
    val_pk = turn_valid.transpose(1, 2).reshape(P * K, G).bool()  # [P*K, G]
    adv_pk = (rloo_advantages(ret_pk, val_pk) if leave_one_out
              else grpo_advantages(ret_pk, val_pk, scale=scale, eps=eps))  # [P*K, G]
    adv = adv_pk.view(P, K, G).transpose(1, 2).reshape(P * G, K)  # [B, K]
    return broadcast_turn_values(adv, turn_ids)  # [B, T]


def broadcast_turn_values(per_turn: torch.Tensor, turn_ids: torch.Tensor) -> torch.Tensor:
    """per_turn [B, K], turn_ids [B, T] -> [B, T]: token t gets per_turn[b, turn_ids[b, t]], 0 where
    turn_ids is -1 (or beyond K)."""
    K = per_turn.shape[-1]
    inside = (turn_ids >= 0) & (turn_ids < K)  # [B, T]
    gathered = per_turn.gather(1, turn_ids.clamp(0, max(K - 1, 0)).long())  # [B, T]
    return torch.where(inside, gathered, torch.zeros_like(gathered))  # [B, T]


def broadcast_to_tokens(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """advantages [B] (one per sequence) -> [B, T], 0 where mask is 0."""
    return advantages[:, None].float() * mask.float()  # [B, T]


# ---------------------------------------------------------------------------------------------
# the registry
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdvantageEstimator:
    """An entry of ADVANTAGE_ESTIMATORS.

    fn      the pure function
    inputs  names of the tensors the caller passes as keyword arguments:
              rewards [P, G], valid [P, G]                       (outcome estimators)
              token_rewards [B, T], values [B, T], mask [B, T]   (per-token)
              turn_rewards [P, G, K], turn_valid [P, G, K], turn_ids [B, T]
    params  names of the hyper-parameters it takes as keyword arguments (all have defaults)
    level   "sequence": returns [P, G], one advantage per trajectory;
            "token":    returns [B, T] (gae returns (advantages, returns))
    needs_critic  True when `values` (a value model) is required
    """

    fn: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
    inputs: tuple[str, ...]
    params: tuple[str, ...]
    level: str
    needs_critic: bool = False


_OUTCOME = ("rewards", "valid")
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": AdvantageEstimator(grpo_advantages, _OUTCOME, ("scale", "eps"), "sequence"),
    "grpo_batch_std": AdvantageEstimator(grpo_batch_std_advantages, _OUTCOME, ("eps",), "sequence"),
    "dr_grpo": AdvantageEstimator(dr_grpo_advantages, _OUTCOME, (), "sequence"),
    "rloo": AdvantageEstimator(rloo_advantages, _OUTCOME, (), "sequence"),
    "reinforce_pp": AdvantageEstimator(reinforce_pp_advantages, _OUTCOME, ("eps",), "sequence"),
    "reinforce_pp_token": AdvantageEstimator(reinforce_pp_token_advantages, ("token_rewards", "mask"),
                                             ("gamma", "eps"), "token"),
    "gae": AdvantageEstimator(gae_advantages, ("token_rewards", "values", "mask"), ("gamma", "lam"), "token",
                              needs_critic=True),
    "turn_grpo": AdvantageEstimator(turn_level_advantages, ("turn_rewards", "turn_valid", "turn_ids"),
                                    ("gamma", "scale", "leave_one_out", "eps"), "token"),
}
