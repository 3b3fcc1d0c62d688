"""DPO: preference training, offline (fixed pairs) or online (pairs from each step's rollout groups).

Offline (`algo=dpo`, the default `dpo.online=false`):

    pairs ─► reference log-probs, once ─► for each epoch, batches of dpo.batch_size pairs:
             policy log-probs of chosen + rejected ─► algos.dpo_loss ─► clip ─► AdamW

  The pairs come from `data.path` (JSONL rows `prompt`, `chosen`, `rejected`; see
  `actloop.train.pairs`) or, without it, from the initial policy on `data.task` (calculator):
  `train.steps * train.prompts_per_step` training problems, `train.group_size` samples each,
  best vs worst reward per group (`algos.build_preference_pairs`, ties skipped), generated once
  at the start and written to RUN_DIR/pairs.jsonl. The reference is the initial policy, so its
  log-probs are computed with the policy itself before the first update and kept as numbers: no
  reference model is held during training.

Online (`dpo.online=true`): the GRPO loop's rollout step, then one DPO update per step on the
best-vs-worst pairs of that step's groups (`online_dpo_loss`), with the reference a frozen copy
(or the LoRA adapter disabled).

Sequence log-prob = sum over the completion's assistant tokens (sigmoid, as in the DPO paper);
mean over tokens for IPO (as in the IPO paper and TRL). Log-probs use temperature 1 (the policy's
own distribution), whatever `rollout.temperature` sampled the pairs.
"""

from __future__ import annotations

import json
import time
import torch

from actloop.algos import KL_ESTIMATORS
from actloop.algos.dpo import build_preference_pairs, dpo_loss
from actloop.config import Config
from actloop.models import Models
from actloop.monitor.metrics import mean
from actloop.rollout.engine import SamplingParams
from actloop.rollout.episodes import run_episodes
from actloop.tasks import build_task
from actloop.train.common import Run, Timer, offline_schedule, progress_bar
from actloop.train.logprobs import token_logprobs
from actloop.train.pairs import (Pair, Sequence, check_rows, load_preference_pairs, messages_json,
                                 parse_preference_row)
from actloop.train.trainer import PromptSampler, RunResult, step_metrics
from actloop.types import Scored

# How a completion's token log-probs become its sequence log-prob, per `dpo.loss`.
SEQUENCE_LOGP = {"sigmoid": torch.sum, "ipo": torch.mean}


def sequence_logps(model, seqs: list[Sequence], precision: str = "auto", temperature: float = 1.0) -> list[torch.Tensor]:
    """Per-token log-probs of each sequence's loss-masked tokens, in order: a list of [T_i].
    Differentiable when grad is enabled."""
    out = token_logprobs(model, [list(s.ids) for s in seqs], [list(s.mask) for s in seqs], temperature, precision)
    return [out.logp[i][out.mask[i]] for i in range(len(seqs))]


@torch.no_grad()
def reference_logps(model, pairs: list[Pair], precision: str, micro_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(chosen [T_c], rejected [T_r]) reference token log-probs of every pair, computed once."""
    was_training = model.training
    model.eval()
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    per = max(1, micro_batch // 2)
    for i in range(0, len(pairs), per):
        chunk = pairs[i : i + per]
        lps = sequence_logps(model, [p.chosen for p in chunk] + [p.rejected for p in chunk], precision)
        out += [(lps[j].detach().float().cpu(), lps[len(chunk) + j].detach().float().cpu()) for j in range(len(chunk))]
    model.train(was_training)
    return out


def _kl(policy: list[torch.Tensor], ref: list[torch.Tensor], estimator: str) -> float:
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


def pair_loss(cfg: Config, pol_c, pol_r, ref_c, ref_r) -> tuple[torch.Tensor, dict[str, float]]:
    return preference_loss(pol_c, pol_r, ref_c, ref_r, cfg.dpo.beta, cfg.dpo.loss, cfg.dpo.label_smoothing)


def dpo_step(cfg: Config, run: Run, optimizer, scheduler, pairs: list[Pair],
             refs: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """One optimizer step on a batch of pairs, in micro-batches of `train.micro_batch_size`
    sequences (the mean loss over the batch, accumulated exactly)."""
    policy = run.models.policy
    policy.train()
    optimizer.zero_grad(set_to_none=True)
    per = max(1, cfg.train.micro_batch_size // 2)
    all_pc, all_pr = [], []
    for i in range(0, len(pairs), per):
        chunk, rchunk = pairs[i : i + per], refs[i : i + per]
        lps = sequence_logps(policy, [p.chosen for p in chunk] + [p.rejected for p in chunk], cfg.train.precision)
        pc, pr = lps[: len(chunk)], lps[len(chunk) :]
        loss, _ = pair_loss(cfg, pc, pr, [r[0] for r in rchunk], [r[1] for r in rchunk])
        (loss * len(chunk) / len(pairs)).backward()
        all_pc += [x.detach() for x in pc]
        all_pr += [x.detach() for x in pr]
    grad_norm = run.clip_and_step(optimizer, scheduler)
    _, m = pair_loss(cfg, all_pc, all_pr, [r[0] for r in refs], [r[1] for r in refs])
    m["loss"] = m.pop("dpo_loss")
    m["kl"] = _kl(all_pc + all_pr, [r[0] for r in refs] + [r[1] for r in refs], cfg.kl.estimator)
    m["grad_norm"] = grad_norm
    m["tokens"] = sum(p.chosen.num_loss_tokens + p.rejected.num_loss_tokens for p in pairs)  # scored this step
    return m


# ------------------------------------------------------------------------------ offline pairs


def sample_pairs(cfg: Config, run: Run, print_fn=print) -> list[Pair]:
    """Pairs from the initial policy: G samples per training problem, best vs worst reward."""
    G, P = cfg.train.group_size, cfg.train.prompts_per_step
    n_prompts = min(cfg.train.steps * P, len(run.task.train_rows))
    sampler = PromptSampler(run.task.train_rows, cfg.seed)
    sampling = SamplingParams(cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.top_p)
    pairs: list[Pair] = []
    rewards_all: list[float] = []
    tied = 0
    t0 = time.time()
    with (run.run_dir / "pairs.jsonl").open("w") as f:
        for start in range(0, n_prompts, P):
            rows = sampler.next(min(P, n_prompts - start))
            trajs = (run.task.rollout or run_episodes)(run.engine, run.renderer, run.task.make_env, [r for r in rows for _ in range(G)],
                                 sampling, cfg.rollout.max_turns, cfg.rollout.max_context)
            scored = run.task.rubric.score(trajs)
            rewards = torch.tensor([s.reward for s in scored]).view(-1, G)
            valid = torch.tensor([not s.masked for s in scored]).view(-1, G)
            chosen, rejected, groups = build_preference_pairs(rewards, valid)
            tied += len(rows) - len(groups)
            rewards_all += rewards.flatten().tolist()
            for c, r in zip(chosen.tolist(), rejected.tolist()):
                sc, sr = scored[c], scored[r]
                pairs.append(Pair(_seq(sc), _seq(sr), sc.trajectory.row))
                f.write(json.dumps({"prompt": messages_json(sc.trajectory.prompt_messages),
                                    "chosen": messages_json(_completion(sc)), "rejected": messages_json(_completion(sr)),
                                    "chosen_reward": sc.reward, "rejected_reward": sr.reward,
                                    "question": sc.trajectory.row.get("question")}) + "\n")
    info = {"source": "initial policy samples", "prompts": n_prompts, "group_size": G, "pairs": len(pairs),
            "tied_groups": tied, "sample_reward_mean": round(mean(rewards_all), 4), "seconds": round(time.time() - t0, 1)}
    run.summary["pair_data"] = info
    print_fn(f"preference pairs: {len(pairs)} from {n_prompts} prompts x {G} samples ({tied} tied groups skipped, "
             f"{info['seconds']:.0f}s)")
    return pairs


def _seq(s: Scored) -> Sequence:
    return Sequence(tuple(s.trajectory.input_ids), tuple(s.trajectory.loss_mask))


def _completion(s: Scored):
    t = s.trajectory
    return t.messages[len(t.prompt_messages):]


# ------------------------------------------------------------------------------------ training


def train_dpo(cfg: Config, progress: bool = True, print_fn=print) -> RunResult:
    """`algo=dpo`: offline on fixed pairs, or online (`dpo.online=true`)."""
    if cfg.dpo.online:
        return train_online_dpo(cfg, progress, print_fn)
    return train_offline_dpo(cfg, progress, print_fn)


def train_offline_dpo(cfg: Config, progress: bool = True, print_fn=print) -> RunResult:
    if cfg.data.path:
        check_rows(cfg.data.path, parse_preference_row)  # bad data fails before a run directory exists
    run = Run(cfg, print_fn)
    run.evaluate("eval_before")
    if cfg.data.path:
        pairs = load_preference_pairs(cfg.data.path, run.renderer)
        run.summary["pair_data"] = {"source": cfg.data.path, "pairs": len(pairs)}
        print_fn(f"preference pairs: {len(pairs)} from {cfg.data.path}")
    else:
        pairs = sample_pairs(cfg, run, print_fn)
    t0 = time.time()
    refs = reference_logps(run.models.policy, pairs, cfg.train.precision, cfg.train.micro_batch_size)
    run.summary["reference_seconds"] = round(time.time() - t0, 2)
    optimizer, scheduler = run.optimizer()
    plan = offline_schedule(cfg, len(pairs), cfg.dpo.batch_size, cfg.dpo.epochs, "pairs", "dpo.epochs", print_fn)
    with progress_bar(len(plan), progress) as bar:
        tid = bar.add_task("dpo", total=len(plan), loss=0.0)
        for step, epoch, idx in plan:
            timer = Timer()
            m = dpo_step(cfg, run, optimizer, scheduler, [pairs[i] for i in idx], [refs[i] for i in idx])
            record = {"step": step, "epoch": epoch, **m, "lr": scheduler.get_last_lr()[0], "step_s": round(timer(), 3)}
            run.log(record, timer())
            bar.update(tid, advance=1, loss=m["loss"])
    if not pairs:
        print_fn("no preference pairs: nothing to train on (every group tied?)")
    return run.finish()


def online_dpo_loss(models: Models, scored: list[Scored], rewards: torch.Tensor, valid: torch.Tensor | None = None, *,
                    beta: float = 0.1, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
                    precision: str = "auto", kl_estimator: str = "k3") -> tuple[torch.Tensor, dict[str, float]]:
    """Rollout groups -> the DPO loss of their best-vs-worst pairs, for the GRPO loop to call.

    scored: the P * G scored trajectories of a step (row-major groups); rewards [P, G]; valid
    [P, G] (default: not masked). The policy's log-probs carry gradient; the reference's come from
    `models.reference_model()` under `models.reference_context()` (a frozen copy, or the LoRA
    adapter disabled). Returns (loss, metrics); loss is a 0 without gradient when every group
    ties — call `.backward()` only when `loss.requires_grad`."""
    P, G = rewards.shape
    if valid is None:
        valid = torch.tensor([not s.masked for s in scored]).view(P, G)
    chosen, rejected, _groups = build_preference_pairs(rewards, valid)
    n = len(chosen)
    if n == 0:
        return torch.zeros(()), {"loss": 0.0, "rewards_chosen": 0.0, "rewards_rejected": 0.0, "reward_margin": 0.0,
                                 "reward_accuracy": 0.0, "pairs": 0.0, "kl": 0.0}
    seqs = [_seq(scored[i]) for i in chosen.tolist()] + [_seq(scored[i]) for i in rejected.tolist()]
    pol = sequence_logps(models.policy, seqs, precision)
    with torch.no_grad(), models.reference_context():
        ref = [r.detach() for r in sequence_logps(models.reference_model(), seqs, precision)]
    loss, m = preference_loss(pol[:n], pol[n:], ref[:n], ref[n:], beta, loss_type, label_smoothing)
    m["loss"] = m.pop("dpo_loss")
    m["kl"] = _kl(pol, ref, kl_estimator)
    return loss, m


def train_online_dpo(cfg: Config, progress: bool = True, print_fn=print) -> RunResult:
    run = Run(cfg, print_fn, need_reference=True, task=build_task(cfg))
    run.evaluate("eval_before")
    optimizer, scheduler = run.optimizer()
    sampler = PromptSampler(run.task.train_rows, cfg.seed)
    sampling = SamplingParams(cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.top_p)
    G = cfg.train.group_size
    gen_tokens, gen_seconds = 0, 0.0
    policy = run.models.policy
    with progress_bar(cfg.train.steps, progress) as bar:
        tid = bar.add_task("dpo", total=cfg.train.steps, loss=0.0)
        for step in range(1, cfg.train.steps + 1):
            t0 = time.time()
            rows = sampler.next(cfg.train.prompts_per_step)
            tok0 = run.engine.generated_tokens
            trajs = (run.task.rollout or run_episodes)(run.engine, run.renderer, run.task.make_env, [r for r in rows for _ in range(G)],
                                 sampling, cfg.rollout.max_turns, cfg.rollout.max_context)
            t1 = time.time()
            scored = run.task.rubric.score(trajs)
            t2 = time.time()
            rewards = torch.tensor([s.reward for s in scored]).view(-1, G)
            policy.train()
            optimizer.zero_grad(set_to_none=True)
            loss, m = online_dpo_loss(run.models, scored, rewards, beta=cfg.dpo.beta, loss_type=cfg.dpo.loss,
                                      label_smoothing=cfg.dpo.label_smoothing, precision=cfg.train.precision,
                                      kl_estimator=cfg.kl.estimator)
            if loss.requires_grad:
                loss.backward()
                m["grad_norm"] = run.clip_and_step(optimizer, scheduler)
                run.engine.sync_weights(policy)
            else:  # every group tied: nothing to prefer this step
                m["grad_norm"] = 0.0
                scheduler.step()
            t3 = time.time()
            new_tokens = run.engine.generated_tokens - tok0
            gen_tokens, gen_seconds = gen_tokens + new_tokens, gen_seconds + (t1 - t0)
            record = step_metrics(step, scored, G)
            record.update(m)
            record.update(lr=scheduler.get_last_lr()[0], rollout_s=round(t1 - t0, 3), scoring_s=round(t2 - t1, 3),
                          update_s=round(t3 - t2, 3), step_s=round(t3 - t0, 3),
                          gen_tokens_per_s=round(new_tokens / max(t1 - t0, 1e-9), 1))
            run.log(record, t3 - t0)
            bar.update(tid, advance=1, loss=m["loss"])
    run.summary["generated_tokens_per_s"] = round(gen_tokens / gen_seconds, 1) if gen_seconds else 0.0
    if run.task.rubric.errors:
        run.summary["reward_errors"] = len(run.task.rubric.errors)
    return run.finish()
