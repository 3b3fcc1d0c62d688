"""One policy update on a rollout batch, for every online algorithm (the rows of
actloop.algos.ALGORITHMS whose trainer is "online"). The maths is in `actloop.algos`; this module moves tensors between the trajectories and
those pure functions:

1. a no-grad pass for what the update needs fixed: old log-probs (unless the exact on-policy
   fast path applies), reference log-probs (KL), critic values (PPO);
2. advantages from the algorithm's estimator, fed the inputs it declares (one table: ALGORITHMS);
3. epochs x mini-batches of the clipped policy loss (plus the value loss for PPO), with the
   rollout-vs-trainer importance weights when correction is on.

Everything per token lives in one `RolloutBatch`, built once per step: padded [B, T] tensors in
the packed layout (row i holds trajectory i's sampled tokens in order; see
`actloop.train.numerics.logprobs`), sliced per micro-batch with `RolloutBatch.rows`. The policy's
log-probs of a micro-batch are put in the same layout, and the loss is one call on the slice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields, replace
from typing import Any, Callable

import torch

from actloop.algos import ALGORITHMS
from actloop.algos.advantages import broadcast_to_tokens, masked_whiten, place_rewards_at_turn_ends
from actloop.algos.batching import is_on_policy, minibatches, token_budget_batches
from actloop.algos.kl import KL_ESTIMATORS, kl_reward_penalty
from actloop.algos.losses import token_weights, value_loss
from actloop.algos.offpolicy import approx_proximal_logp, decoupled_pg_loss
from actloop.config import Config, get_key
from actloop.models import Models
from actloop.monitor.metrics import mean
from actloop.train.rl.critic import Critic
from actloop.rollout.engine import autocast_context
from actloop.train.numerics.logprobs import backbone_and_head, hidden_at_targets, pack, place, token_logprobs
from actloop.train.numerics.mixed_precision import update_precision
from actloop.types import Scored

@dataclass
class UpdateContext:
    cfg: Config
    models: Models
    optimizer: torch.optim.Optimizer
    critic: Critic | None
    beta: float  # current KL coefficient (fixed or adaptive)
    correction: str  # resolved IS-correction mode ("none" when the engine is the trainer's forward)
    dist: Any = None  # actloop.train.runtime.distributed.Dist under torchrun (docs/distributed.md); None = one process
    lent_weights: dict[int, torch.Tensor] | None = None  # the engine's bf16 tensors for the update's casts (lend_weights)
    version: int = 0  # weight syncs before this update: the proximal policy's version (rollout.max_staleness)
    # rollout.max_staleness > 0 on vLLM: the engine's turn between two micro-batches, given the seconds the
    # last one took (Engine.decode_for, rollout.decode_during_update); None: the update runs without a break
    between_passes: Callable[[float], Any] | None = None


def _turn_ids(s: Scored) -> torch.Tensor:
    return torch.tensor([k for k, turn in enumerate(s.trajectory.turns) for _ in turn.token_ids])


@dataclass
class RolloutBatch:
    """One step's trajectories for the update, built once (`from_scored`) and sliced per
    micro-batch (`rows`). Tensors are [B, T] in the packed layout: row i holds trajectory i's
    sampled tokens in order, T is the most any row has, padding is 0 (`mask` False). What the
    algorithm does not need stays None."""

    seqs: list[list[int]]  # full token ids of each trajectory: the forward's (ragged) input
    loss_masks: list[list[int]]  # their loss masks (1 on sampled tokens)
    routing: list[Any]  # the engine's MoE routing per trajectory (None: not recorded)
    mask: torch.Tensor  # [B, T] bool, sampled tokens
    engine_logp: torch.Tensor  # [B, T] log-probs the engine sampled with
    turn_ids: torch.Tensor  # [B, T] assistant turn of each token, -1 on padding
    advantages: torch.Tensor | None = None  # [B, T]
    returns: torch.Tensor | None = None  # [B, T] critic targets
    old_logp: torch.Tensor | None = None  # [B, T] policy before the update (None: not computed)
    ref_logp: torch.Tensor | None = None  # [B, T] reference policy (KL)
    values: torch.Tensor | None = None  # [B, T] critic at rollout time
    versions: torch.Tensor | None = None  # [B, T] policy version of each token (proximal approximation only)
    moe_routing: bool = False  # some trajectory carries routing

    @classmethod
    def from_scored(cls, scored: list[Scored]) -> RolloutBatch:
        trajs = [s.trajectory for s in scored]
        engine = [torch.tensor([lp for lp, m in zip(t.logprobs, t.loss_mask) if m], dtype=torch.float32) for t in trajs]
        engine_logp, mask = pack(engine)
        ids, _ = pack([_turn_ids(s).float() for s in scored])
        return cls([list(t.input_ids) for t in trajs], [list(t.loss_mask) for t in trajs], [t.routing for t in trajs],
                   mask, engine_logp, torch.where(mask, ids, torch.full_like(ids, -1)).long(),
                   moe_routing=any(t.routing is not None for t in trajs))

    @property
    def lengths(self) -> list[int]:
        return self.mask.sum(-1).tolist()

    def rows(self, idx: list[int]) -> RolloutBatch:
        """The trajectories `idx`, their tensors cut to the longest of them."""
        T = int(self.mask[idx].sum(-1).max()) if idx else 0
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                out[f.name] = v[idx, :T]
            elif isinstance(v, list):
                out[f.name] = [v[i] for i in idx]
        return replace(self, **out)

    def put(self, name: str, idx: list[int], rows: list[torch.Tensor]) -> None:
        """Set tensor `name` [B, T] on rows idx from per-row 1-D tensors (zeros elsewhere)."""
        if getattr(self, name) is None:
            setattr(self, name, torch.zeros(self.mask.shape))
        full = getattr(self, name)
        for i, r in zip(idx, rows):
            full[i, : len(r)] = r


def _routing(ctx: UpdateContext, part: RolloutBatch) -> dict[str, Any]:
    """token_logprobs keywords for the engine's MoE routing of these trajectories: compared with
    the trainer's routers always, replayed with train.routing_replay (docs/models.md)."""
    if not part.moe_routing or all(r is None for r in part.routing):
        return {}
    return {"routing": part.routing, "replay": ctx.cfg.train.routing_replay}


def _micro(ctx: UpdateContext, batch: RolloutBatch, idx: list[int]) -> list[list[int]]:
    """Rows idx, shortest first, in micro-batches of train.micro_batch_size trajectories (at most
    rollout.decode_during_update when the engine gets a turn after each) within the
    train.max_tokens_per_microbatch budget."""
    idx = sorted(idx, key=lambda i: len(batch.seqs[i]))  # similar lengths share a micro-batch
    t = ctx.cfg.train
    size = t.micro_batch_size if ctx.between_passes is None else min(t.micro_batch_size,
                                                                       ctx.cfg.rollout.decode_during_update)
    parts = token_budget_batches([len(batch.seqs[i]) for i in idx], size, t.max_tokens_per_microbatch)
    return [[idx[j] for j in part] for part in parts]


def _share_prefix(ctx: UpdateContext) -> bool:
    """The shared-prefix KV cache adds a data-dependent backbone call, which FSDP's per-module
    hooks cannot follow (docs/distributed.md): off for a sharded policy."""
    return ctx.dist is None or not ctx.dist.fsdp


def _precision(ctx: UpdateContext, need_policy: bool = True, need_ref: bool = False):
    """The context of the update's passes (actloop.train.numerics.mixed_precision): bf16 weights of the
    policy when a pass runs it, and of the reference model when KL needs it (with LoRA the two are one
    model), under train.bf16_mode=weights."""
    t = ctx.cfg.train
    return update_precision(t.precision, t.bf16_mode, ctx.models.policy if need_policy else None,
                            ctx.models.reference_model() if need_ref else None,
                            sharded=ctx.dist is not None and ctx.dist.fsdp, buffers=ctx.lent_weights)


def _fixed_pass(ctx: UpdateContext, batch: RolloutBatch, idx: list[int], need_old: bool, need_ref: bool,
                need_values: bool) -> dict[str, float]:
    """No-grad passes over rows idx, micro-batch by micro-batch under one precision context: the
    policy's (old log-probs, critic values with need_values) when need_old, the reference's
    (need_ref) on the same micro-batches. On-policy GRPO with the KL term in the loss needs only
    the reference's: its old log-probs are the update's own, detached. -> {"old_logp_s": seconds
    of the policy's pass, "ref_s": seconds of the reference's, "decode_in_update_s": seconds the
    engine decoded between them}."""
    t = ctx.cfg.train
    secs = {"old_logp_s": 0.0, "ref_s": 0.0, "decode_in_update_s": 0.0}
    # on-policy GRPO with the KL term in the loss runs only the reference here: the policy's weights
    # are not cast to bf16 for a pass that does not read them
    with torch.no_grad(), _precision(ctx, need_policy=need_old, need_ref=need_ref):
        micros = _micro(ctx, batch, idx)
        pad = ctx.dist.missing(len(micros)) if ctx.dist is not None else 0  # FSDP: as many passes as every rank
        for _ in range(pad):
            ctx.dist.dummy_pass(ctx, grad=False)
        for mb in micros:
            part = batch.rows(mb)
            t0 = time.perf_counter()
            if need_old:
                out = token_logprobs(ctx.models.policy, part.seqs, part.loss_masks, ctx.cfg.rollout.temperature,
                                     t.precision, return_hidden=need_values and ctx.critic.mode == "head",
                                     chunk=t.logits_chunk, checkpointing=t.gradient_checkpointing,
                                     share_prefix=_share_prefix(ctx), pad_to=t.pad_to_multiple, **_routing(ctx, part))
                n = out.mask.sum(-1).tolist()
                batch.put("old_logp", mb, out.logp[out.mask].float().cpu().split(n))
                if need_values:
                    vals = (ctx.critic.values_from_hidden(out.hidden) if ctx.critic.mode == "head"
                            else ctx.critic.values(part.seqs, part.loss_masks, t.precision))
                    batch.put("values", mb, vals.float().cpu().split(n))
            t1 = time.perf_counter()
            if need_ref:
                with ctx.models.reference_context():
                    r = token_logprobs(ctx.models.reference_model(), part.seqs, part.loss_masks,
                                       ctx.cfg.rollout.temperature, t.precision, chunk=t.logits_chunk,
                                       checkpointing=t.gradient_checkpointing, pad_to=t.pad_to_multiple,
                                       # a separate copy is never FSDP-sharded; LoRA's is the (sharded?) policy
                                       share_prefix=ctx.models.reference is not None or _share_prefix(ctx))
                batch.put("ref_logp", mb, r.logp[r.mask].float().cpu().split(r.mask.sum(-1).tolist()))
            secs["old_logp_s"] += t1 - t0
            secs["ref_s"] += time.perf_counter() - t1
            secs["decode_in_update_s"] += _between(ctx, time.perf_counter() - t0)
    return secs


def _between(ctx: UpdateContext, seconds: float) -> float:
    """The engine's turn after a micro-batch that took `seconds` (ctx.between_passes, running ahead):
    -> the seconds it took."""
    if ctx.between_passes is None:
        return 0.0
    t0 = time.perf_counter()
    ctx.between_passes(seconds)
    return time.perf_counter() - t0


def _versions(scored: list[Scored], mask: torch.Tensor) -> torch.Tensor:
    """[B, T] the policy version of each sampled token, in the packed layout (0 where not counted)."""
    out = torch.zeros(mask.shape, dtype=torch.long)  # [B, T]
    for i, s in enumerate(scored):
        vs = s.trajectory.versions[: mask.shape[1]]
        out[i, : len(vs)] = torch.tensor(vs, dtype=torch.long)
    return out


def estimator_name(cfg: Config) -> str:
    """The advantage estimator of cfg.algo's row in ALGORITHMS (its turn-level one with train.turn_credit)."""
    return ALGORITHMS[cfg.algo].estimator_key(cfg.train.turn_credit)


def _turn_tables(scored: list[Scored], is_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (turn_rewards [B, K], turn_valid [B, K]): each turn's env reward, the outcome added on
    the last turn (a missing Turn.reward is 0)."""
    K = max((len(s.trajectory.turns) for s in scored), default=1) or 1
    turn_rewards = torch.zeros(len(scored), K)  # [B, K]
    turn_valid = torch.zeros(len(scored), K, dtype=torch.bool)  # [B, K]
    for i, s in enumerate(scored):
        turns = s.trajectory.turns
        for k, t in enumerate(turns):
            turn_rewards[i, k] = t.reward or 0.0
            turn_valid[i, k] = bool(is_valid[i])
        if turns:
            turn_rewards[i, len(turns) - 1] += s.reward  # the outcome lands on the last turn
    return turn_rewards, turn_valid


class _Inputs:
    """The tensors an estimator may declare (`AdvantageEstimator.inputs`), each built on first use:
    rewards / valid [P, G]; token_rewards / mask / values [B, T]; turn_rewards / turn_valid
    [P, G, K] and turn_ids [B, T]."""

    def __init__(self, scored: list[Scored], batch: RolloutBatch, is_valid: torch.Tensor, group_size: int,
                 kl_pen: torch.Tensor):
        self.scored, self.batch, self.is_valid, self.G, self.kl_pen = scored, batch, is_valid, group_size, kl_pen
        self._turns = _turn_tables(scored, is_valid)

    def __getitem__(self, name: str) -> torch.Tensor:
        return getattr(self, name)()

    def rewards(self) -> torch.Tensor:  # [P, G] outcome minus the summed KL penalty (kl.mode=reward)
        r = torch.tensor([s.reward for s in self.scored], dtype=torch.float32) - self.kl_pen.sum(-1)
        return r.view(-1, self.G)

    def valid(self) -> torch.Tensor:  # [P, G]
        return self.is_valid.view(-1, self.G)

    def mask(self) -> torch.Tensor:  # [B, T]
        return self.batch.mask.float()

    def token_rewards(self) -> torch.Tensor:  # [B, T] turn rewards at turn ends, minus the per-token KL penalty
        turn_rewards = self._turns[0]  # [B, K]
        ends = torch.full(turn_rewards.shape, -1, dtype=torch.long)  # [B, K] last sampled token of each turn
        for i, s in enumerate(self.scored):  # an empty turn's reward goes on the token before it
            lens = torch.tensor([len(t.token_ids) for t in s.trajectory.turns], dtype=torch.long)
            ends[i, : len(lens)] = (lens.cumsum(0) - 1).clamp(min=0)
        r = place_rewards_at_turn_ends(turn_rewards, ends, self.batch.mask.shape[1])  # [B, T]
        return r - self.kl_pen

    def values(self) -> torch.Tensor:  # [B, T] critic values at rollout time
        return self.batch.values if self.batch.values is not None else torch.zeros(self.batch.mask.shape)

    def turn_ids(self) -> torch.Tensor:  # [B, T]
        return self.batch.turn_ids

    def turn_rewards(self) -> torch.Tensor:  # [P, G, K]
        r = self._turns[0]
        return r.view(-1, self.G, r.shape[1])

    def turn_valid(self) -> torch.Tensor:  # [P, G, K]
        v = self._turns[1]
        return v.view(-1, self.G, v.shape[1])


def _row_kl(ctx: UpdateContext, batch: RolloutBatch) -> torch.Tensor:
    """Per-token KL(old || ref) [B, T] with the configured estimator, 0 on padding."""
    kl = KL_ESTIMATORS[ctx.cfg.kl.estimator](batch.old_logp, batch.ref_logp)  # [B, T]
    return torch.where(batch.mask, kl, torch.zeros_like(kl))


def compute_advantages(ctx: UpdateContext, scored: list[Scored], batch: RolloutBatch, valid: list[int],
                       group_size: int) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """-> (advantages [B, T], returns [B, T] or None (critic targets), metrics).

    The estimator of cfg.algo's row gets the inputs it declares and the hyper-parameters its row
    maps from config; a sequence-level result is broadcast to the tokens, a token-level one is
    whitened when the row says so. No branch on the algorithm's name."""
    cfg = ctx.cfg
    alg = ALGORITHMS[cfg.algo]
    est = alg.estimator(cfg.train.turn_credit)
    is_valid = torch.zeros(len(scored), dtype=torch.bool)
    is_valid[valid] = True
    metrics: dict[str, float] = {}
    kl_pen = torch.zeros(batch.mask.shape)  # [B, T]
    if cfg.kl.mode == "reward" and ctx.beta > 0 and batch.ref_logp is not None:  # KL as a per-token reward penalty
        kl_pen = -kl_reward_penalty(batch.old_logp, batch.ref_logp, batch.mask & is_valid[:, None], ctx.beta,
                                    cfg.kl.estimator)  # [B, T] beta * KL_t, subtracted from the rewards
        metrics["kl_penalty"] = float(kl_pen.sum() / max(len(valid), 1))
    inputs = _Inputs(scored, batch, is_valid, group_size, kl_pen)
    hyper = {k: get_key(cfg, key) for k, key in alg.params.items() if k in est.params}
    out = est.fn(**{k: inputs[k] for k in est.inputs}, **hyper)
    adv, ret = out if isinstance(out, tuple) else (out, None)  # gae: (advantages, returns)
    mask = batch.mask.float()  # [B, T]
    if est.level == "sequence":
        adv = broadcast_to_tokens(adv.flatten(), mask)  # [P, G] -> [B, T]
    adv = adv * mask
    if alg.whiten:  # over the valid trajectories' tokens (PPO's batch normalisation)
        adv = masked_whiten(adv, mask * is_valid[:, None])
    return adv, ret, metrics


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
    est = ALGORITHMS[cfg.algo].estimator(t.turn_credit)
    episodes, valid_episodes = scored, [i for i, s in enumerate(scored) if not s.masked]
    # a segment shares its episode's sequence-level advantage; token-level estimators (PPO, turn
    # credit) follow one token sequence, so they train an episode's last segment only
    seq_level = est.level == "sequence"
    scored, owner = expand_segments(episodes) if seq_level else (episodes, {})
    segments_dropped = 0 if seq_level else sum(len(s.trajectory.segments) for s in episodes if not s.masked)
    valid = [i for i, s in enumerate(scored) if not s.masked]
    mb_size = t.minibatch_size or len(valid) or 1
    on_policy = is_on_policy(len(valid), t.minibatch_size or None, t.epochs)
    need_ref = ctx.beta > 0 and ctx.models.reference_model() is not None
    need_values = est.needs_critic
    need_old = not on_policy or need_values or (need_ref and cfg.kl.mode == "reward")
    batch = RolloutBatch.from_scored(scored)  # [B, T], once per step (episodes, then extra segments)
    fixed_s = {"old_logp_s": 0.0, "ref_s": 0.0, "decode_in_update_s": 0.0}  # the per-phase seconds in the metrics
    if (need_old and not need_ref and not need_values and cfg.rollout.max_staleness > 0
            and t.proximal_logp == "loglinear"):  # the pass was for the proximal log-probs alone: approximated
        need_old, batch.versions = False, _versions(scored, batch.mask)
    if need_old or need_ref:
        fixed_s = _fixed_pass(ctx, batch, valid, need_old, need_ref, need_values)
    n_ep = len(episodes)
    ep_batch = batch.rows(list(range(n_ep))) if owner else batch  # the estimator sees the [P, G] episodes
    adv_ep, batch.returns, metrics = compute_advantages(ctx, episodes, ep_batch, valid_episodes, group_size)
    batch.advantages = torch.zeros(batch.mask.shape)  # [B, T]
    batch.advantages[:n_ep, : adv_ep.shape[1]] = adv_ep
    for j, i in owner.items():  # a segment: its episode's (sequence-level) advantage on every token
        if not scored[j].masked and bool(ep_batch.mask[i].any()):
            batch.advantages[j] = adv_ep[i, 0] * batch.mask[j]
    if owner or segments_dropped:
        metrics.update(extra_segments=sum(1 for j in owner if not scored[j].masked), segments_dropped=segments_dropped)
    kl_measured = None
    if need_ref and cfg.kl.mode != "loss":  # KL as a reward penalty: report it; the loss has no KL term
        kl_measured, batch.ref_logp = _row_kl(ctx, batch), None
    if on_policy:
        batch.old_logp = None  # the exact on-policy fast path: old = logp.detach() in the loss

    # Trajectories with zero advantage add nothing to a sequence-level policy gradient: skip them
    # when nothing else (a KL loss term, an entropy bonus) needs them. They still count below.
    skip_zero = est.level == "sequence" and batch.ref_logp is None and t.entropy_coef == 0
    work = [i for i in valid if not (skip_zero and not bool(batch.advantages[i].any()))]
    work.sort(key=lambda i: len(batch.seqs[i]))  # similar lengths share a micro-batch
    max_tokens = cfg.rollout.max_new_tokens * cfg.rollout.max_turns
    policy.train()
    acc: dict[str, list[float]] = {}
    grad_norms = []
    batches = minibatches(len(work), mb_size, t.epochs, seed=cfg.seed, shuffle=t.epochs > 1 or mb_size < len(work))
    if ctx.dist is not None and ctx.dist.max_int(len(work)) and not batches:  # a rank with nothing to train
        batches = [[] for _ in range(t.epochs)]  # still takes every optimizer step with the others
    lengths = batch.lengths
    for step_idx in batches:
        idx = [work[j] for j in step_idx]
        num_seqs = len(idx) if mb_size < len(valid) else len(valid)
        num_tokens = sum(lengths[i] for i in (idx if mb_size < len(valid) else valid))
        micros = _micro(ctx, batch, idx)
        pad = 0
        if ctx.dist is not None:  # totals over all ranks: the ranks' summed gradients are one process's
            num_seqs, num_tokens = ctx.dist.sum_ints(num_seqs, num_tokens)
            pad = ctx.dist.missing(len(micros))
        ctx.optimizer.zero_grad(set_to_none=True)
        with _precision(ctx):  # bf16 weights for the passes; the fp32 gradients are in place after it
            for _ in range(pad):
                ctx.dist.dummy_pass(ctx, grad=True)
            for mb in micros:
                t0 = time.perf_counter()
                loss, m = micro_batch_loss(ctx, batch.rows(mb), token_weights_args=(num_seqs, num_tokens, max_tokens))
                loss.backward()
                for k, val in m.items():
                    acc.setdefault(k, []).append(val)
                fixed_s["decode_in_update_s"] += _between(ctx, time.perf_counter() - t0)
        params = [p for g in ctx.optimizer.param_groups for p in g["params"]]
        clip = ctx.dist.clip_grad_norm_ if ctx.dist is not None else torch.nn.utils.clip_grad_norm_
        grad_norms.append(float(clip(params, t.max_grad_norm)))
        ctx.optimizer.step()
    ctx.optimizer.zero_grad(set_to_none=True)  # the gradients (one fp32 copy of the weights) are not held through the rollout
    if kl_measured is not None and "kl" not in acc and valid:
        per_row = kl_measured.sum(-1) / batch.mask.sum(-1).clamp(min=1)  # [B] mean over each row's tokens
        acc["kl"] = [float(per_row[valid].mean())]
    n_work = len(work)
    if ctx.dist is not None:  # every rank's micro-batch metrics, as one process would log them
        acc, metrics, n_work = ctx.dist.gather_update_metrics(acc, metrics, n_work)
    out_metrics = {k: mean(v) for k, v in acc.items()}
    out_metrics.update(metrics)
    out_metrics.update({k: round(v, 3) for k, v in fixed_s.items()})
    out_metrics.update(grad_norm=mean(grad_norms), optimizer_steps=len(batches), trained_trajectories=n_work,
                       beta=ctx.beta)
    out_metrics.setdefault("kl", 0.0)
    out_metrics.setdefault("clip_frac", 0.0)
    out_metrics.setdefault("entropy", 0.0)
    return out_metrics


def micro_batch_loss(ctx: UpdateContext, part: RolloutBatch, token_weights_args: tuple[int, int, int]
                     ) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one micro-batch (a slice of the step's RolloutBatch): the policy's forward, its
    log-probs put in the batch's layout, then one call of `clipped_pg_loss` (plus the critic's
    `value_loss` when the batch has values). token_weights_args: (num_seqs, num_tokens,
    max_tokens) of the whole optimizer step."""
    cfg, t = ctx.cfg, ctx.cfg.train
    policy = ctx.models.policy
    need_values = part.values is not None
    routing = _routing(ctx, part)
    out = token_logprobs(policy, part.seqs, part.loss_masks, cfg.rollout.temperature, t.precision,
                         return_hidden=need_values and ctx.critic.mode == "head", chunk=t.logits_chunk,
                         checkpointing=t.gradient_checkpointing, share_prefix=_share_prefix(ctx),
                         pad_to=t.pad_to_multiple, **routing)
    m: dict[str, float] = {}
    if out.routing_disagreement is not None:  # MoE: experts the engine and the trainer chose
        m.update(routing_disagreement=out.routing_disagreement, router_disagreement=out.router_disagreement)
    mask = part.mask  # [b, T]
    logp = place(out.logp[out.mask], mask)  # [b, T] with gradient, in the batch's layout
    # the proximal policy (the weights before this update): the fixed pass's, AReaL's approximation from each
    # token's version (stale data, train.proximal_logp=loglinear), or on the one-step fast path the current one
    if part.old_logp is not None:
        old_logp = part.old_logp
    elif part.versions is not None:
        old_logp = approx_proximal_logp(part.engine_logp, logp, part.versions, ctx.version, mask)  # [b, T]
    else:
        old_logp = logp.detach()
    weights = token_weights(mask, t.loss_agg, *token_weights_args)  # [b, T]
    # the bonus needs entropy with gradient (an extra head pass); otherwise the forward's, for the metric
    entropy = (_entropy_with_grad(policy, part, cfg, routing) if t.entropy_coef > 0
               else place(out.entropy[out.mask], mask))  # [b, T]
    # the decoupled objective: clipped around the proximal policy, weighted by proximal / behaviour (the engine's
    # log-probs: older weights under rollout.max_staleness > 0, the engine's numerics always), capped per correction.*
    loss, pm = decoupled_pg_loss(logp, old_logp, part.engine_logp, part.advantages, weights, correction=ctx.correction,
                                 cap=cfg.correction.cap, upper=cfg.correction.upper, lower=cfg.correction.lower,
                                 mask=mask, clip_eps=t.clip_eps, ref_logp=part.ref_logp, beta=ctx.beta,
                                 kl_estimator=cfg.kl.estimator, policy_loss=t.policy_loss, clip_low=t.clip_low,
                                 clip_high=t.clip_high, dual_clip=t.dual_clip, entropy=entropy,
                                 entropy_coef=t.entropy_coef)
    m.update(pm)
    if need_values:
        v = (ctx.critic.values_from_hidden(out.hidden) if ctx.critic.mode == "head"
             else ctx.critic.values(part.seqs, part.loss_masks, t.precision))  # [N]
        vl, vm = value_loss(place(v, mask), part.values, part.returns, weights, cfg.ppo.value_clip)
        loss = loss + cfg.ppo.vf_coef * vl
        m.update(vm)
    return loss, m


def _entropy_with_grad(policy, part: RolloutBatch, cfg: Config, routing=None) -> torch.Tensor:
    """Policy entropy [b, T] with gradient, in the batch's layout (an extra head pass; only when
    entropy_coef > 0)."""
    backbone, head = backbone_and_head(policy)
    h, _, _, _, _, _ = hidden_at_targets(backbone, part.seqs, part.loss_masks, cfg.train.precision,
                                         checkpointing=cfg.train.gradient_checkpointing,
                                         pad_to=cfg.train.pad_to_multiple, **(routing or {}))
    with autocast_context(cfg.train.precision):
        logits = head(h).float() / cfg.rollout.temperature
    logp = torch.log_softmax(logits, -1)
    ent = -(logp.exp() * logp).sum(-1)  # [N], row-major over the sampled tokens
    return place(ent, part.mask)  # [b, T]
