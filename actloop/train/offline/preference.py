"""Preference (DPO/IPO) losses on token log-probs, and the preference update of the online loop.

`algo=dpo dpo.online=true` runs in the same rollout loop as the policy-gradient algorithms
(actloop.train.rl.loop: failure guard, monitor, checkpoints, resume); its row in
`actloop.algos.ALGORITHMS` declares `loss="preference"`, so the loop calls `preference_update`
where the others call `rl_update`: each group's best-vs-worst pair (`algos.build_preference_pairs`,
ties skipped), the policy's log-probs with gradient, the reference's under
`models.reference_context()`, `algos.dpo_loss`, one optimizer step. Offline DPO
(actloop.train.offline.dpo) uses the same loss on fixed pairs.

Sequence log-prob = sum over the completion's assistant tokens (sigmoid, as in the DPO paper);
mean over tokens for IPO (as in the IPO paper and TRL). Log-probs use temperature 1 (the policy's
own distribution), whatever `rollout.temperature` sampled the pairs.
"""

from __future__ import annotations

from typing import Any

import torch

from actloop.algos import KL_ESTIMATORS
from actloop.algos.batching import token_budget_batches
from actloop.algos.dpo import build_preference_pairs, dpo_loss
from actloop.models import Models
from actloop.train.numerics.logprobs import token_logprobs
from actloop.train.numerics.mixed_precision import update_precision
from actloop.train.offline.pairs import Sequence
from actloop.types import Scored

# How a completion's token log-probs become its sequence log-prob, per `dpo.loss`.
SEQUENCE_LOGP = {"sigmoid": torch.sum, "ipo": torch.mean}


def sequence_logps(model, seqs: list[Sequence], precision: str = "auto", temperature: float = 1.0) -> list[torch.Tensor]:
    """Per-token log-probs of each sequence's loss-masked tokens, in order: a list of [T_i].
    Differentiable when grad is enabled."""
    out = token_logprobs(model, [list(s.ids) for s in seqs], [list(s.mask) for s in seqs], temperature, precision)
    return [out.logp[i][out.mask[i]] for i in range(len(seqs))]


def pairs_kl(policy: list[torch.Tensor], ref: list[torch.Tensor], estimator: str) -> float:
    """Mean per-token KL estimate between policy and reference on the pairs' tokens. For online
    pairs (sampled from the policy) it estimates KL(pi || ref); on offline data it is the same
    statistic on someone else's samples."""
    if not policy:
        return 0.0
    lp = torch.cat([p.detach().float().cpu() for p in policy])
    rl = torch.cat([r.float().cpu() for r in ref])
    return float(KL_ESTIMATORS[estimator](lp, rl).mean()) if lp.numel() else 0.0


def preference_loss(pol_c: list[torch.Tensor], pol_r: list[torch.Tensor], ref_c: list[torch.Tensor],
                    ref_r: list[torch.Tensor], beta: float, loss_type: str, label_smoothing: float
                    ) -> tuple[torch.Tensor, dict[str, float]]:
    """Token log-probs of N pairs (lists of [T_i]) -> algos.dpo_loss over their sequence log-probs."""
    agg = SEQUENCE_LOGP[loss_type]
    device = pol_c[0].device if pol_c else torch.device("cpu")

    def seq(xs: list[torch.Tensor]) -> torch.Tensor:  # [N]
        return torch.stack([agg(x.float().to(device)) if x.numel() else torch.zeros((), device=device) for x in xs]) \
            if xs else torch.zeros(0, device=device)

    return dpo_loss(seq(pol_c), seq(pol_r), seq(ref_c), seq(ref_r), beta=beta, loss_type=loss_type,
                    label_smoothing=label_smoothing)


def scored_sequence(s: Scored) -> Sequence:
    return Sequence(tuple(s.trajectory.input_ids), tuple(s.trajectory.loss_mask))


def _group_pairs(scored: list[Scored], rewards: torch.Tensor, valid: torch.Tensor | None) -> tuple[list[int], list[int]]:
    P, G = rewards.shape
    if valid is None:
        valid = torch.tensor([not s.masked for s in scored]).view(P, G)
    chosen, rejected, _groups = build_preference_pairs(rewards, valid)
    return chosen.tolist(), rejected.tolist()


def _pair_logps(models: Models, seqs: list[Sequence], precision: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(policy token log-probs with gradient, reference token log-probs) of `seqs`."""
    pol = sequence_logps(models.policy, seqs, precision)
    with torch.no_grad(), models.reference_context():
        ref = [r.detach() for r in sequence_logps(models.reference_model(), seqs, precision)]
    return pol, ref


def online_dpo_loss(models: Models, scored: list[Scored], rewards: torch.Tensor, valid: torch.Tensor | None = None, *,
                    beta: float = 0.1, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                    precision: str = "auto", kl_estimator: str = "k3") -> tuple[torch.Tensor, dict[str, float]]:
    """Rollout groups -> the DPO loss of their best-vs-worst pairs (one forward for all pairs).

    scored: the P * G scored trajectories of a step (row-major groups); rewards [P, G]; valid
    [P, G] (default: not masked). Returns (loss, metrics); loss is a 0 without gradient when every
    group ties — call `.backward()` only when `loss.requires_grad`."""
    chosen, rejected = _group_pairs(scored, rewards, valid)
    n = len(chosen)
    if n == 0:
        return torch.zeros(()), {"loss": 0.0, "rewards_chosen": 0.0, "rewards_rejected": 0.0, "reward_margin": 0.0,
                                 "reward_accuracy": 0.0, "pairs": 0.0, "kl": 0.0}
    pol, ref = _pair_logps(models, [scored_sequence(scored[i]) for i in chosen + rejected], precision)
    loss, m = preference_loss(pol[:n], pol[n:], ref[:n], ref[n:], beta, loss_type, label_smoothing)
    m["loss"] = m.pop("dpo_loss")
    m["kl"] = pairs_kl(pol, ref, kl_estimator)
    return loss, m


def preference_update(ctx: Any, scored: list[Scored], group_size: int) -> dict[str, Any]:
    """One optimizer step of DPO on the step's rollout groups (the update of `loss="preference"`
    rows; ctx is actloop.train.rl.update.UpdateContext). Pairs go through in micro-batches of
    train.micro_batch_size sequences (within train.max_tokens_per_microbatch); the gradient is that of the mean loss over all pairs. A
    step where every group ties trains nothing (trained_trajectories 0, no optimizer step)."""
    cfg, t = ctx.cfg, ctx.cfg.train
    rewards = torch.tensor([s.reward for s in scored], dtype=torch.float32).view(-1, group_size)
    chosen, rejected = _group_pairs(scored, rewards, None)
    n = len(chosen)
    policy = ctx.models.policy
    policy.train()
    ctx.optimizer.zero_grad(set_to_none=True)
    pair_len = [max(len(scored[c].trajectory.input_ids), len(scored[r].trajectory.input_ids))
                for c, r in zip(chosen, rejected)]  # a pair is two sequences of one forward
    budget = t.max_tokens_per_microbatch // 2 if t.max_tokens_per_microbatch else 0
    pc_all, pr_all, rc_all, rr_all = [], [], [], []
    sharded = ctx.dist is not None and ctx.dist.fsdp
    with update_precision(t.precision, t.bf16_mode, policy, ctx.models.reference_model(), sharded=sharded,
                          buffers=ctx.lent_weights):
        for part in token_budget_batches(pair_len, max(1, t.micro_batch_size // 2), budget):
            c, r = [chosen[j] for j in part], [rejected[j] for j in part]
            pol, ref = _pair_logps(ctx.models, [scored_sequence(scored[i]) for i in c + r], t.precision)
            k = len(c)
            loss, _ = preference_loss(pol[:k], pol[k:], ref[:k], ref[k:], cfg.dpo.beta, cfg.dpo.loss,
                                      cfg.dpo.label_smoothing)
            (loss * k / n).backward()
            pc_all += [x.detach() for x in pol[:k]]
            pr_all += [x.detach() for x in pol[k:]]
            rc_all += ref[:k]
            rr_all += ref[k:]
    grad_norm = 0.0
    if n:
        params = [p for g in ctx.optimizer.param_groups for p in g["params"]]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm))
        ctx.optimizer.step()
    ctx.optimizer.zero_grad(set_to_none=True)  # not held through the next rollout
    _, m = preference_loss(pc_all, pr_all, rc_all, rr_all, cfg.dpo.beta, cfg.dpo.loss, cfg.dpo.label_smoothing)
    m["loss"] = m.pop("dpo_loss")
    m.update(kl=pairs_kl(pc_all + pr_all, rc_all + rr_all, cfg.kl.estimator), pairs=float(n), grad_norm=grad_norm,
             optimizer_steps=int(n > 0), trained_trajectories=2 * n, beta=ctx.beta)
    return m
