"""The GRPO training loop, top to bottom: sample prompts, roll out groups, score, compute
advantages, update, log, checkpoint. Maths lives in `actloop.algos`; this file only calls it.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from actloop.algos.advantages import grpo_advantages
from actloop.algos.losses import clipped_pg_loss, token_weights
from actloop.config import Config
from actloop.data.tasks import Task, build_task
from actloop.models import Models, load_models
from actloop.monitor.metrics import JsonlSink, mean, std
from actloop.rollout.engine import HFEngine, SamplingParams
from actloop.rollout.episodes import run_episodes
from actloop.rollout.renderer import Renderer
from actloop.train.evaluate import evaluate
from actloop.train.logprobs import token_logprobs
from actloop.types import Scored


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any]


def make_run_dir(cfg: Config) -> Path:
    name = cfg.run_name or datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(cfg.output_dir) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    return run_dir


class PromptSampler:
    """Shuffled passes over the training rows, deterministic under the seed."""

    def __init__(self, rows: list[dict[str, Any]], seed: int):
        self.rows, self.rng, self.order, self.pos = rows, random.Random(seed), [], 0

    def next(self, n: int) -> list[dict[str, Any]]:
        out = []
        while len(out) < n:
            if self.pos >= len(self.order):
                self.order, self.pos = list(range(len(self.rows))), 0
                self.rng.shuffle(self.order)
            out.append(self.rows[self.order[self.pos]])
            self.pos += 1
        return out


def grpo_update(cfg: Config, models: Models, optimizer: torch.optim.Optimizer, scored: list[Scored],
                advantages: torch.Tensor) -> dict[str, float]:
    """One optimizer step on a rollout batch (one update per batch: the on-policy fast path,
    old log-probs = current ones detached, ratio exactly 1).

    Trajectories with zero advantage add nothing to the policy gradient, so without a KL term
    they are skipped — they still count in the loss normaliser, so the loss is the same."""
    t = cfg.train
    valid = [i for i, s in enumerate(scored) if not s.masked]
    work = [i for i in valid if t.beta > 0 or advantages[i] != 0]
    work.sort(key=lambda i: len(scored[i].trajectory.input_ids))  # similar lengths share a micro-batch: less padding
    num_seqs = len(valid)
    num_tokens = sum(scored[i].trajectory.num_response_tokens for i in valid)
    policy = models.policy
    policy.train()
    optimizer.zero_grad(set_to_none=True)
    metrics: dict[str, list[float]] = {"clip_frac": [], "kl": [], "entropy": []}
    for start in range(0, len(work), t.micro_batch_size):
        idx = work[start : start + t.micro_batch_size]
        seqs = [scored[i].trajectory.input_ids for i in idx]
        masks = [scored[i].trajectory.loss_mask for i in idx]
        out = token_logprobs(policy, seqs, masks, cfg.rollout.temperature, t.precision)
        ref_logp = None
        if t.beta > 0:
            with torch.no_grad(), models.reference_context():
                ref_logp = token_logprobs(models.reference_model(), seqs, masks, cfg.rollout.temperature, t.precision).logp
        weights = token_weights(out.mask, t.loss_agg, num_seqs, num_tokens)
        loss, m = clipped_pg_loss(out.logp, out.logp.detach(), advantages[idx].to(out.logp.device), weights,
                                  t.clip_eps, ref_logp, t.beta)
        loss.backward()
        n = out.mask.sum().clamp(min=1)
        metrics["entropy"].append(float((out.entropy * out.mask).sum() / n))
        metrics["clip_frac"].append(m["clip_frac"])
        if "kl" in m:
            metrics["kl"].append(m["kl"])
    params = [p for p in policy.parameters() if p.requires_grad]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm)) if work else 0.0
    if work:
        optimizer.step()
    return {
        "grad_norm": grad_norm,
        "entropy": mean(metrics["entropy"]),
        "clip_frac": mean(metrics["clip_frac"]),
        "kl": mean(metrics["kl"]),
        "trained_trajectories": len(work),
    }


def step_metrics(step: int, scored: list[Scored], group_size: int) -> dict[str, Any]:
    """Reward, success and tool-use statistics of one rollout batch."""
    trajs = [s.trajectory for s in scored]
    rewards = [s.reward for s in scored]
    groups = [rewards[i : i + group_size] for i in range(0, len(rewards), group_size)]
    record: dict[str, Any] = {
        "step": step,
        "reward_mean": mean(rewards),
        "reward_std": std(rewards),
        "success": mean(s.success for s in scored),
        "zero_variance_groups": mean(len(set(g)) == 1 for g in groups),
        "response_tokens": sum(t.num_response_tokens for t in trajs),
        "tool_tokens": sum(t.num_env_tokens for t in trajs),
        "tool_calls_per_episode": mean(t.num_tool_calls for t in trajs),
        "malformed_call_rate": mean(t.num_malformed_calls > 0 for t in trajs),
        "truncated_rate": mean(t.truncated for t in trajs),
        "failed_rollouts": sum(s.masked for s in scored),
    }
    names = sorted({k for s in scored for k in s.components})
    for k in names:
        record[f"reward/{k}"] = mean(s.components[k] for s in scored if k in s.components)
    return record


def train(cfg: Config, progress: bool = True, print_fn=print) -> RunResult:
    """Run `cfg.algo`: the online RL loop below, or the offline trainers (dpo, sft)."""
    if cfg.algo in OFFLINE_TRAINERS:
        import importlib

        module, name = OFFLINE_TRAINERS[cfg.algo].split(":")
        return getattr(importlib.import_module(module), name)(cfg, progress=progress, print_fn=print_fn)
    return train_online(cfg, progress=progress, print_fn=print_fn)


# Offline algorithms live in their own modules; online ones (grpo, rloo, reinforce_pp, ppo) share
# the rollout loop below and differ only in their advantage estimator.
OFFLINE_TRAINERS = {"dpo": "actloop.train.dpo:train_dpo", "sft": "actloop.train.sft:train_sft"}


def train_online(cfg: Config, progress: bool = True, print_fn=print) -> RunResult:
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    run_dir = make_run_dir(cfg)
    print_fn(f"run directory: {run_dir}")
    task: Task = build_task(cfg)
    models = load_models(cfg.model, lora=cfg.lora, need_reference=cfg.train.beta > 0)
    renderer = Renderer(models.tokenizer)
    engine = HFEngine(models.policy, models.tokenizer, renderer.eos_token_ids, renderer.stop_strings,
                      precision=cfg.train.precision, weights="live" if models.lora else "copy")
    params = [p for p in models.policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / cfg.train.warmup_steps) if cfg.train.warmup_steps else 1.0)
    sampler = PromptSampler(task.train_rows, cfg.seed)
    sampling = SamplingParams(cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.top_p)
    sink = JsonlSink(run_dir / "metrics.jsonl")
    summary: dict[str, Any] = {"task": task.name, "model": cfg.model, "steps": cfg.train.steps}

    def run_eval(label: str) -> None:
        res = evaluate(engine, renderer, task, task.eval_rows, cfg.rollout.max_new_tokens, cfg.rollout.max_turns)
        summary[label] = res
        print_fn(f"{label}: greedy success {res['success']:.1%} on {res['n']} held-out problems ({res['seconds']:.0f}s)")

    if cfg.train.eval_before and task.eval_rows:
        run_eval("eval_before")

    step_seconds, gen_tokens, gen_seconds = [], 0, 0.0
    bar = _progress(cfg.train.steps, progress)
    with bar:
        task_id = bar.add_task("train", total=cfg.train.steps, reward=0.0, success=0.0)
        for step in range(1, cfg.train.steps + 1):
            t0 = time.time()
            # 1. roll out G episodes for each of the step's prompts
            rows = sampler.next(cfg.train.prompts_per_step)
            group_rows = [r for r in rows for _ in range(cfg.train.group_size)]
            tok0 = engine.generated_tokens
            trajs = run_episodes(engine, renderer, task.make_env, group_rows, sampling, cfg.rollout.max_turns)
            t1 = time.time()
            # 2. score them
            scored = task.rubric.score(trajs)
            t2 = time.time()
            # 3. group-relative advantages
            rewards = torch.tensor([s.reward for s in scored]).view(-1, cfg.train.group_size)
            valid = torch.tensor([not s.masked for s in scored]).view(-1, cfg.train.group_size)
            advantages = grpo_advantages(rewards, valid, scale=cfg.train.adv_scale).flatten()
            # 4. update the policy, then hand the new weights to the engine
            upd = grpo_update(cfg, models, optimizer, scored, advantages)
            scheduler.step()
            engine.sync_weights(models.policy)
            t3 = time.time()
            # 5. log
            new_tokens = engine.generated_tokens - tok0
            gen_tokens, gen_seconds = gen_tokens + new_tokens, gen_seconds + (t1 - t0)
            record = step_metrics(step, scored, cfg.train.group_size)
            record.update(upd)
            record.update(
                lr=scheduler.get_last_lr()[0],
                rollout_s=round(t1 - t0, 3),
                scoring_s=round(t2 - t1, 3),
                update_s=round(t3 - t2, 3),
                step_s=round(t3 - t0, 3),
                gen_tokens_per_s=round(new_tokens / max(t1 - t0, 1e-9), 1),
            )
            sink.log(record)
            step_seconds.append(t3 - t0)
            bar.update(task_id, advance=1, reward=record["reward_mean"], success=record["success"])

    sink.close()
    summary["seconds_per_step"] = round(mean(step_seconds), 2)
    summary["generated_tokens_per_s"] = round(gen_tokens / gen_seconds, 1) if gen_seconds else 0.0
    if task.rubric.errors:
        summary["reward_errors"] = len(task.rubric.errors)
    if cfg.train.eval_after and task.eval_rows:
        run_eval("eval_after")
    if cfg.train.save_final:
        final = run_dir / "final"
        models.policy.save_pretrained(final)
        models.tokenizer.save_pretrained(final)
        summary["final_dir"] = str(final)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return RunResult(run_dir, summary)


def _progress(total: int, enabled: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]step"),
        MofNCompleteColumn(),
        BarColumn(),
        TextColumn("reward {task.fields[reward]:.3f}"),
        TextColumn("success {task.fields[success]:.1%}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        disable=not enabled,
    )
