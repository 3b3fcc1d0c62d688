"""One policy update on a rollout batch, for every online algorithm (grpo, rloo, reinforce_pp,
ppo). The maths is in `actloop.algos`; this module moves tensors between the trajectories and
those pure functions:

1. a no-grad pass for what the update needs fixed: old log-probs (unless the exact on-policy
   fast path applies), reference log-probs (KL), critic values (PPO);
2. advantages from the algorithm's estimator (one table: ALGO_ESTIMATORS);
3. epochs x mini-batches of the clipped policy loss (plus the value loss for PPO), with the
   rollout-vs-trainer importance weights when correction is on.

Per-trajectory token quantities are kept "packed": a 1-D tensor over the trajectory's sampled
tokens, in order (see `actloop.train.logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from actloop.algos import ADVANTAGE_ESTIMATORS
from actloop.algos.advantages import place_rewards_at_turn_ends
from actloop.algos.batching import minibatches
from actloop.algos.correction import rollout_correction
from actloop.algos.kl import KL_ESTIMATORS
from actloop.algos.losses import clipped_pg_loss, token_weights, value_loss
from actloop.config import Config
from actloop.models import Models
from actloop.monitor.metrics import mean
from actloop.train.critic import Critic
from actloop.rollout.engine import autocast_context
from actloop.train.logprobs import backbone_and_head, hidden_at_targets, pack, scatter, token_logprobs
from actloop.train.memory import step_peak
from actloop.types import Scored

# algo -> advantage estimator (names of actloop.algos.ADVANTAGE_ESTIMATORS)
ALGO_ESTIMATORS = {"grpo": "grpo", "rloo": "rloo", "reinforce_pp": "reinforce_pp", "ppo": "gae"}


@dataclass
class UpdateContext:
    cfg: Config
    models: Models
    optimizer: torch.optim.Optimizer
    critic: Critic | None
    beta: float  # current KL coefficient (fixed or adaptive)
    correction: str  # resolved IS-correction mode ("none" when the engine is the trainer's forward)
    dist: Any = None  # actloop.train.distributed.Dist under torchrun (docs/distributed.md); None = one process


def _engine_logprobs(s: Scored) -> torch.Tensor:
    t = s.trajectory
    return torch.tensor([lp for lp, m in zip(t.logprobs, t.loss_mask) if m], dtype=torch.float32)


def _turn_ids(s: Scored) -> torch.Tensor:
    return torch.tensor([k for k, turn in enumerate(s.trajectory.turns) for _ in turn.token_ids])


def _routing(ctx: UpdateContext, scored: list[Scored], mb: list[int]) -> dict[str, Any]:
    """token_logprobs keywords for the engine's MoE routing of these trajectories: compared with
    the trainer's routers always, replayed with train.routing_replay (docs/models.md)."""
    routes = [scored[i].trajectory.routing for i in mb]
    if all(r is None for r in routes):
        return {}
    return {"routing": routes, "replay": ctx.cfg.train.routing_replay}


def _micro(idx: list[int], size: int):
    for start in range(0, len(idx), size):
        yield idx[start : start + size]


def _share_prefix(ctx: UpdateContext) -> bool:
    """The shared-prefix KV cache adds a data-dependent backbone call, which FSDP's per-module
    hooks cannot follow (docs/distributed.md): off for a sharded policy."""
    return ctx.dist is None or not ctx.dist.fsdp


def _packed_pass(ctx: UpdateContext, scored: list[Scored], idx: list[int], need_ref: bool, need_values: bool):
    """No-grad pass: {i: old logp}, {i: ref logp}, {i: values} as packed 1-D tensors."""
    t = ctx.cfg.train
    old, ref, values = {}, {}, {}
    with torch.no_grad():
        micros = list(_micro(idx, t.micro_batch_size))
        pad = ctx.dist.missing(len(micros)) if ctx.dist is not None else 0  # FSDP: as many passes as every rank
        for _ in range(pad):
            ctx.dist.dummy_pass(ctx, grad=False)
        for mb in micros:
            seqs = [scored[i].trajectory.input_ids for i in mb]
            masks = [scored[i].trajectory.loss_mask for i in mb]
            out = token_logprobs(ctx.models.policy, seqs, masks, ctx.cfg.rollout.temperature, t.precision,
                                 return_hidden=need_values and ctx.critic.mode == "head", chunk=t.logits_chunk,
                                 checkpointing=t.gradient_checkpointing, share_prefix=_share_prefix(ctx),
                                 **_routing(ctx, scored, mb))
            vals = None
            if need_values:
                vals = (ctx.critic.values_from_hidden(out.hidden) if ctx.critic.mode == "head"
                        else ctx.critic.values(seqs, masks, t.precision))
                vals = vals.float().split(out.mask.sum(-1).tolist())
            rows = out.logp.float().split(1)
            for k, i in enumerate(mb):
                old[i] = rows[k][out.mask[k : k + 1]].cpu()
                if vals is not None:
                    values[i] = vals[k].cpu()
            if need_ref:
                with ctx.models.reference_context():
                    r = token_logprobs(ctx.models.reference_model(), seqs, masks, ctx.cfg.rollout.temperature,
                                       t.precision, chunk=t.logits_chunk, checkpointing=t.gradient_checkpointing)
                for k, i in enumerate(mb):
                    ref[i] = r.logp[k][r.mask[k]].float().cpu()
    return old, ref, values


def estimator_name(cfg: Config) -> str:
    return "turn_grpo" if cfg.train.turn_credit and cfg.algo == "grpo" else ALGO_ESTIMATORS[cfg.algo]


def turn_credit_advantages(scored: list[Scored], is_valid: torch.Tensor, group_size: int, gamma: float,
                           scale: bool) -> dict[int, torch.Tensor]:
    """Per-token advantages from turn-level returns (actloop.algos turn_level_advantages)."""
    K = max((len(s.trajectory.turns) for s in scored), default=1) or 1
    B = len(scored)
    turn_rewards = torch.zeros(B, K)
    turn_valid = torch.zeros(B, K, dtype=torch.bool)
    for i, s in enumerate(scored):
        turns = s.trajectory.turns
        for k, t in enumerate(turns):
            turn_rewards[i, k] = t.reward or 0.0
            turn_valid[i, k] = bool(is_valid[i])
        if turns:
            turn_rewards[i, len(turns) - 1] += s.reward  # the outcome lands on the last turn
    ids, mask = pack([_turn_ids(s).float() for s in scored])
    ids = torch.where(mask, ids, torch.full_like(ids, -1)).long()
    est = ADVANTAGE_ESTIMATORS["turn_grpo"]
    adv = est.fn(turn_rewards=turn_rewards.view(-1, group_size, K), turn_valid=turn_valid.view(-1, group_size, K),
                 turn_ids=ids, gamma=gamma, scale=scale)
    return {i: adv[i, : int(mask[i].sum())] for i in range(B)}


def compute_advantages(ctx: UpdateContext, scored: list[Scored], valid: list[int], group_size: int,
                       old: dict, ref: dict, values: dict) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], dict]:
    """-> ({i: per-token advantages}, {i: per-token returns (PPO)}, metrics)."""
    cfg = ctx.cfg
    est = ADVANTAGE_ESTIMATORS[estimator_name(cfg)]
    n = len(scored)
    rewards = torch.tensor([s.reward for s in scored], dtype=torch.float32)
    is_valid = torch.zeros(n, dtype=torch.bool)
    is_valid[valid] = True
    metrics: dict[str, float] = {}
    lengths = [sum(scored[i].trajectory.loss_mask) for i in range(n)]
    kl_pen = {}
    if cfg.kl.mode == "reward" and ctx.beta > 0:  # KL as a per-token reward penalty
        for i in valid:
            kl_pen[i] = ctx.beta * KL_ESTIMATORS[cfg.kl.estimator](old[i], ref[i])
        metrics["kl_penalty"] = mean(float(kl_pen[i].sum()) for i in valid)
    if est is ADVANTAGE_ESTIMATORS["turn_grpo"]:
        return turn_credit_advantages(scored, is_valid, group_size, cfg.train.turn_gamma,
                                      cfg.train.adv_scale != "none"), {}, metrics
    if est.level == "sequence":
        seq_r = rewards.clone()
        for i, p in kl_pen.items():
            seq_r[i] -= float(p.sum())
        extra = {"scale": cfg.train.adv_scale} if cfg.algo == "grpo" else {}  # group / batch / none (Dr. GRPO)
        adv = est.fn(rewards=seq_r.view(-1, group_size), valid=is_valid.view(-1, group_size), **extra).flatten()
        return {i: torch.full((lengths[i],), float(adv[i])) for i in range(n)}, {}, metrics
    # token level (PPO): rewards at turn ends (per-turn env rewards, the outcome at the last turn)
    token_rewards = []
    for i, s in enumerate(scored):
        turns = s.trajectory.turns
        per_turn = torch.tensor([[(t.reward or 0.0) for t in turns] or [0.0]])
        per_turn[0, -1] += s.reward
        ends = torch.tensor([[max(sum(len(t.token_ids) for t in turns[: k + 1]) - 1, 0) for k in range(len(turns))] or [0]])
        r = place_rewards_at_turn_ends(per_turn, ends, max(lengths[i], 1))[0][: lengths[i]]
        if i in kl_pen:
            r = r - kl_pen[i]
        token_rewards.append(r)
    tr, mask = pack(token_rewards)
    vals, _ = pack([values.get(i, torch.zeros(lengths[i])) for i in range(n)])
    adv, ret = est.fn(token_rewards=tr, values=vals, mask=mask.float(), gamma=cfg.ppo.gamma, lam=cfg.ppo.lam)
    adv = torch.where(mask, adv, torch.zeros_like(adv))
    flat = adv[mask[torch.tensor(valid)]] if valid else torch.zeros(0)
    if flat.numel() > 1:  # whiten over the batch's valid tokens (standard PPO)
        adv = (adv - flat.mean()) / (flat.std() + 1e-6)
    return ({i: adv[i, : lengths[i]] for i in range(n)}, {i: ret[i, : lengths[i]] for i in range(n)}, metrics)


def expand_segments(scored: list[Scored]) -> tuple[list[Scored], dict[int, int]]:
    """Episodes with several segments (an agent that rewrote its history; actloop.gateway):
    each earlier segment becomes an item of its own after the batch, trained with its episode's
    reward. -> (items, {item index: episode index})."""
    import dataclasses

    items, owner = list(scored), {}
    for i, s in enumerate(scored):
        for seg in s.trajectory.segments:
            owner[len(items)] = i
            items.append(dataclasses.replace(s, trajectory=seg))
    return items, owner


def rl_update(ctx: UpdateContext, scored: list[Scored], group_size: int) -> dict[str, Any]:
    cfg, t = ctx.cfg, ctx.cfg.train
    policy = ctx.models.policy
    est = ADVANTAGE_ESTIMATORS[estimator_name(cfg)]
    episodes, valid_episodes = scored, [i for i, s in enumerate(scored) if not s.masked]
    # a segment shares its episode's sequence-level advantage; token-level estimators (PPO, turn
    # credit) follow one token sequence, so they train an episode's last segment only
    seq_level = est.level == "sequence" and estimator_name(cfg) != "turn_grpo"
    scored, owner = expand_segments(episodes) if seq_level else (episodes, {})
    segments_dropped = 0 if seq_level else sum(len(s.trajectory.segments) for s in episodes if not s.masked)
    valid = [i for i, s in enumerate(scored) if not s.masked]
    mb_size = t.minibatch_size or len(valid) or 1
    on_policy = t.epochs == 1 and mb_size >= len(valid)
    need_ref = ctx.beta > 0 and ctx.models.reference_model() is not None
    need_values = est.needs_critic
    need_old = not on_policy or need_values or (need_ref and cfg.kl.mode == "reward")
    old, ref, values = _packed_pass(ctx, scored, valid, need_ref, need_values) if (need_old or need_ref) else ({}, {}, {})
    adv, returns, metrics = compute_advantages(ctx, episodes, valid_episodes, group_size, old, ref, values)
    for j, i in owner.items():
        if not scored[j].masked:
            adv[j] = torch.full((sum(scored[j].trajectory.loss_mask),), float(adv[i][0]) if len(adv[i]) else 0.0)
    if owner or segments_dropped:
        metrics.update(extra_segments=sum(1 for j in owner if not scored[j].masked), segments_dropped=segments_dropped)

    # Trajectories with zero advantage add nothing to a sequence-level policy gradient: skip them
    # when nothing else (a KL loss term, an entropy bonus) needs them. They still count below.
    skip_zero = est.level == "sequence" and not (need_ref and cfg.kl.mode == "loss") and t.entropy_coef == 0
    work = [i for i in valid if not (skip_zero and bool((adv[i] == 0).all()))]
    work.sort(key=lambda i: len(scored[i].trajectory.input_ids))  # similar lengths share a micro-batch
    max_tokens = cfg.rollout.max_new_tokens * cfg.rollout.max_turns
    policy.train()
    acc: dict[str, list[float]] = {}
    grad_norms = []
    batches = minibatches(len(work), mb_size, t.epochs, seed=cfg.seed, shuffle=t.epochs > 1 or mb_size < len(work))
    if ctx.dist is not None and ctx.dist.max_int(len(work)) and not batches:  # a rank with nothing to train
        batches = [[] for _ in range(t.epochs)]  # still takes every optimizer step with the others
    for batch in batches:
        idx = [work[j] for j in batch]
        num_seqs = len(idx) if mb_size < len(valid) else len(valid)
        num_tokens = sum(len(adv[i]) for i in (idx if mb_size < len(valid) else valid))
        micros = list(_micro(sorted(idx, key=lambda i: len(scored[i].trajectory.input_ids)), t.micro_batch_size))
        pad = 0
        if ctx.dist is not None:  # totals over all ranks: the ranks' summed gradients are one process's
            num_seqs, num_tokens = ctx.dist.sum_ints(num_seqs, num_tokens)
            pad = ctx.dist.missing(len(micros))
        ctx.optimizer.zero_grad(set_to_none=True)
        for _ in range(pad):
            ctx.dist.dummy_pass(ctx, grad=True)
        for mb in micros:
            seqs = [scored[i].trajectory.input_ids for i in mb]
            masks = [scored[i].trajectory.loss_mask for i in mb]
            routing = _routing(ctx, scored, mb)
            out = token_logprobs(policy, seqs, masks, cfg.rollout.temperature, t.precision,
                                 return_hidden=need_values and ctx.critic.mode == "head", chunk=t.logits_chunk,
                                 checkpointing=t.gradient_checkpointing, share_prefix=_share_prefix(ctx), **routing)
            if out.routing_disagreement is not None:  # MoE: experts the engine and the trainer chose
                acc.setdefault("routing_disagreement", []).append(out.routing_disagreement)
                acc.setdefault("router_disagreement", []).append(out.router_disagreement)
            mask = out.mask
            old_logp = scatter([old[i] for i in mb], mask) if not on_policy else out.logp.detach()
            is_w = None
            if ctx.correction != "none":
                is_w, m = rollout_correction(old_logp, scatter([_engine_logprobs(scored[i]) for i in mb], mask), mask,
                                             ctx.correction, cfg.correction.cap, cfg.correction.upper, cfg.correction.lower)
                for k, v in m.items():
                    acc.setdefault(k, []).append(v)
            ref_logp = scatter([ref[i] for i in mb], mask) if (need_ref and cfg.kl.mode == "loss") else None
            weights = token_weights(mask, t.loss_agg, num_seqs, num_tokens, max_tokens)
            loss, m = clipped_pg_loss(
                out.logp, old_logp, scatter([adv[i] for i in mb], mask), weights, t.clip_eps, ref_logp, ctx.beta,
                cfg.kl.estimator, policy_loss=t.policy_loss, clip_low=t.clip_low, clip_high=t.clip_high,
                dual_clip=t.dual_clip, mask=mask, is_weights=is_w, entropy=None, entropy_coef=0.0)
            if t.entropy_coef > 0:  # the bonus needs entropy with gradient, from the same logits
                loss = loss - t.entropy_coef * _entropy_with_grad(policy, seqs, masks, cfg, weights, routing)
            if need_values:
                v = (ctx.critic.values_from_hidden(out.hidden) if ctx.critic.mode == "head"
                     else ctx.critic.values(seqs, masks, t.precision))
                vl, vm = value_loss(scatter_values(v, mask), scatter([values[i] for i in mb], mask),
                                    scatter([returns[i] for i in mb], mask), weights, cfg.ppo.value_clip)
                loss = loss + cfg.ppo.vf_coef * vl
                for k, val in vm.items():
                    acc.setdefault(k, []).append(val)
            loss.backward()
            n = mask.sum().clamp(min=1)
            acc.setdefault("entropy", []).append(float((out.entropy * mask).sum() / n))
            for k, val in m.items():
                acc.setdefault(k, []).append(val)
        params = [p for g in ctx.optimizer.param_groups for p in g["params"]]
        clip = ctx.dist.clip_grad_norm_ if ctx.dist is not None else torch.nn.utils.clip_grad_norm_
        grad_norms.append(float(clip(params, t.max_grad_norm)))
        ctx.optimizer.step()
    if need_ref and "kl" not in acc:  # KL as a reward penalty: report the measured KL
        acc["kl"] = [mean(float(KL_ESTIMATORS[cfg.kl.estimator](old[i], ref[i]).mean()) for i in valid)]
    n_work = len(work)
    if ctx.dist is not None:  # every rank's micro-batch metrics, as one process would log them
        acc, metrics, n_work = ctx.dist.gather_update_metrics(acc, metrics, n_work)
    out_metrics = {k: mean(v) for k, v in acc.items()}
    out_metrics.update(metrics)
    out_metrics.update(grad_norm=mean(grad_norms), optimizer_steps=len(batches), trained_trajectories=n_work,
                       beta=ctx.beta)
    out_metrics.setdefault("kl", 0.0)
    out_metrics.setdefault("clip_frac", 0.0)
    out_metrics.setdefault("entropy", 0.0)
    out_metrics.update(step_peak())  # peak memory since the previous update ended: this whole step
    return out_metrics


def scatter_values(v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """values [N] at masked positions (already in mask order) -> [B, S] with gradient."""
    return torch.zeros(mask.shape, device=v.device, dtype=v.dtype).index_put(mask.nonzero(as_tuple=True), v)


def _entropy_with_grad(policy, seqs, masks, cfg: Config, weights: torch.Tensor, routing=None) -> torch.Tensor:
    """Weighted mean policy entropy with gradient (an extra head pass; only when entropy_coef > 0)."""
    backbone, head = backbone_and_head(policy)
    h, _, sel, _, _, _ = hidden_at_targets(backbone, seqs, masks, cfg.train.precision,
                                           checkpointing=cfg.train.gradient_checkpointing, **(routing or {}))
    with autocast_context(cfg.train.precision):
        logits = head(h).float() / cfg.rollout.temperature
    logp = torch.log_softmax(logits, -1)
    ent = -(logp.exp() * logp).sum(-1)  # [N]
    return (ent * weights[sel]).sum()
