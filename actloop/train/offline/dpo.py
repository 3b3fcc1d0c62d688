"""DPO: preference training, offline (fixed pairs) or online (pairs from each step's rollout groups).

Offline (`algo=dpo`, the default `dpo.online=false`):

    pairs ─► reference log-probs, once ─► for each epoch, batches of dpo.batch_size pairs:
             policy log-probs of chosen + rejected ─► algos.dpo_loss ─► clip ─► AdamW

  The pairs come from `data.path` (JSONL rows `prompt`, `chosen`, `rejected`; see
  `actloop.train.offline.pairs`) or, without it, from the initial policy on `data.task` (calculator):
  `train.steps * train.prompts_per_step` training problems, `train.group_size` samples each,
  best vs worst reward per group (`algos.build_preference_pairs`, ties skipped), generated once
  at the start and written to RUN_DIR/pairs.jsonl. The reference is the initial policy, so its
  log-probs are computed with the policy itself before the first update and kept as numbers: no
  reference model is held during training.

Online (`dpo.online=true`) is not here: it runs in the online loop of actloop.train.rl.loop with
`actloop.train.offline.preference.preference_update` as its update (failure guard, monitor, checkpoints
and resume included). The loss on token log-probs (`preference_loss`) is shared.
"""

from __future__ import annotations

import json
import time
import torch

from actloop.algos.dpo import build_preference_pairs
from actloop.config import Config
from actloop.data.sampler import PromptSampler
from actloop.monitor.metrics import mean
from actloop.rollout.engine import SamplingParams
from actloop.rollout.episodes import run_episodes
from actloop.train.offline.common import (clip_and_step, offline_loop, offline_optimizer, offline_run, offline_schedule,
                                          save_full_model)
from actloop.train.numerics.mixed_precision import update_precision
from actloop.train.offline.pairs import Pair, check_rows, load_preference_pairs, messages_json, parse_preference_row
from actloop.train.offline.preference import (online_dpo_loss, pairs_kl, preference_loss, scored_sequence,  # noqa: F401
                                      sequence_logps)
from actloop.train.runtime.run import Run, RunResult
from actloop.types import Scored

@torch.no_grad()
def reference_logps(model, pairs: list[Pair], precision: str, micro_batch: int, bf16_mode: str = "weights"
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(chosen [T_c], rejected [T_r]) reference token log-probs of every pair, computed once, in
    the numerics of the policy's passes (`dpo_step`'s train.bf16_mode)."""
    was_training = model.training
    model.eval()
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    per = max(1, micro_batch // 2)
    with update_precision(precision, bf16_mode, model):
        for i in range(0, len(pairs), per):
            chunk = pairs[i : i + per]
            lps = sequence_logps(model, [p.chosen for p in chunk] + [p.rejected for p in chunk], precision)
            out += [(lps[j].detach().float().cpu(), lps[len(chunk) + j].detach().float().cpu())
                    for j in range(len(chunk))]
    model.train(was_training)
    return out


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
    with update_precision(cfg.train.precision, cfg.train.bf16_mode, policy):
        for i in range(0, len(pairs), per):
            chunk, rchunk = pairs[i : i + per], refs[i : i + per]
            lps = sequence_logps(policy, [p.chosen for p in chunk] + [p.rejected for p in chunk], cfg.train.precision)
            pc, pr = lps[: len(chunk)], lps[len(chunk) :]
            loss, _ = pair_loss(cfg, pc, pr, [r[0] for r in rchunk], [r[1] for r in rchunk])
            (loss * len(chunk) / len(pairs)).backward()
            all_pc += [x.detach() for x in pc]
            all_pr += [x.detach() for x in pr]
    grad_norm = clip_and_step(cfg, run.models, optimizer, scheduler)
    _, m = pair_loss(cfg, all_pc, all_pr, [r[0] for r in refs], [r[1] for r in refs])
    m["loss"] = m.pop("dpo_loss")
    m["kl"] = pairs_kl(all_pc + all_pr, [r[0] for r in refs] + [r[1] for r in refs], cfg.kl.estimator)
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
                pairs.append(Pair(scored_sequence(sc), scored_sequence(sr), sc.trajectory.row))
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


def _completion(s: Scored):
    t = s.trajectory
    return t.messages[len(t.prompt_messages):]


# ------------------------------------------------------------------------------------ training


def train_dpo(cfg: Config, progress: bool = True, print_fn=print) -> RunResult:
    """`algo=dpo` on fixed pairs (`dpo.online=true` runs in the online loop instead: ALGORITHMS)."""
    return train_offline_dpo(cfg, progress, print_fn)


def train_offline_dpo(cfg: Config, progress: bool = True, print_fn=print) -> RunResult:
    if cfg.data.path:
        check_rows(cfg.data.path, parse_preference_row)  # bad data fails before a run directory exists
    run = offline_run(cfg, print_fn)
    run.evaluate("eval_before")
    if cfg.data.path:
        pairs = load_preference_pairs(cfg.data.path, run.renderer)
        run.summary["pair_data"] = {"source": cfg.data.path, "pairs": len(pairs)}
        print_fn(f"preference pairs: {len(pairs)} from {cfg.data.path}")
    else:
        pairs = sample_pairs(cfg, run, print_fn)
    t0 = time.time()
    refs = reference_logps(run.models.policy, pairs, cfg.train.precision, cfg.train.micro_batch_size,
                           cfg.train.bf16_mode)
    run.summary["reference_seconds"] = round(time.time() - t0, 2)
    optimizer, scheduler = offline_optimizer(cfg, run.models)
    plan = offline_schedule(cfg, len(pairs), cfg.dpo.batch_size, cfg.dpo.epochs, "pairs", "dpo.epochs", print_fn)
    offline_loop(run, plan, "dpo", progress, scheduler,
                 lambda idx: dpo_step(cfg, run, optimizer, scheduler, [pairs[i] for i in idx], [refs[i] for i in idx]))
    if not pairs:
        print_fn("no preference pairs: nothing to train on (every group tied?)")
    return run.finish(optimizer, lambda out: save_full_model(run.models, out))
