"""The GRPO training loop, top to bottom: sample prompts, roll out groups, score, compute
advantages, update, log, checkpoint. Maths lives in `actloop.algos`; this file only calls it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
import warnings
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from actloop.algos import ALGORITHMS, KL_CONTROLLERS
from actloop.algos.algorithms import online_algorithms
from actloop.algos.batching import dynamic_sampling_filter
from actloop.algos.shaping import overlong_penalty
from actloop.config import Config, ConfigError, load_config
from actloop.data.mix import per_source_metrics
from actloop.gateway.agent import build_run_task
from actloop.tasks import LoadedTask
from actloop.models import Models, load_models
from actloop.models.routing import require_routing
from actloop.monitor.metrics import mean, std
from actloop.monitor.monitor import Monitor
from actloop.rollout.engine import SamplingParams
from actloop.rollout.factory import make_engine, resolve_engine
from actloop.rollout.renderer import Renderer
from actloop.rewards.judge import judge_usage
from actloop.sandbox import clock as sandbox_clock
from actloop.train import checkpoint, rundir
from actloop.train.evaluate import component_means, eval_line, evaluate, run_batched
from actloop.train.ahead import AheadRollouts
from actloop.train.failures import (FailureGuard, FailureLog, RunAborted, classify, count_kinds, failure_metrics,
                                    masked_line, tool_line)
from actloop.train.interrupt import GracefulStop
from actloop.train.memory import PhasePeaks, frozen_gc, mmap_threshold, set_mmap_threshold
from actloop.train.mixed_precision import hold_in_bf16, uses_bf16_weights
from actloop.train.critic import Critic
from actloop.train.distributed import init_distributed, launched_by_torchrun
from actloop.train.optim import adamw, drop_state
from actloop.train.preference import preference_update
from actloop.train.update import UpdateContext, rl_update
from actloop.types import Scored


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any]


def make_run_dir(cfg: Config) -> Path:
    """A new run directory, locked for this process (`actloop.train.rundir`): a name already used
    is refused unless `cfg.overwrite`, and one another live run holds is always refused."""
    import dataclasses

    name = cfg.run_name or datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = rundir.prepare_new(Path(cfg.output_dir) / name, cfg.overwrite)
    (run_dir / "config.yaml").write_text(dataclasses.replace(cfg, overwrite=False).to_yaml())
    return run_dir


def write_problems(run_dir: Path, label: str, res: dict[str, Any]) -> dict[str, Any]:
    """Move a held-out evaluation's per-problem records (`evaluate(..., keep_problems=True)`) to
    RUN_DIR/<label>.jsonl, one line a problem (id, source, correct, samples, rewards), and return
    the rest for summary.json: `actloop compare` pairs the problems across runs for its tests."""
    problems = res.pop("problems", [])
    (run_dir / f"{label}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in problems))
    return res


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

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.getstate(), "order": list(self.order), "pos": self.pos}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.rng.setstate(d["rng"])
        self.order, self.pos = list(d["order"]), int(d["pos"])


def rollout_groups(cfg: Config, task: LoadedTask, engine, renderer, sampler: PromptSampler, sampling: SamplingParams,
                   seen: list[Scored] | None = None):
    """Roll out and score `prompts_per_step` groups. With dynamic sampling, groups whose rewards
    are all equal are dropped and replaced by fresh prompts, for at most `max_refill_rounds`
    extra rounds (whatever is still missing then is trained without).
    Returns (scored, groups dropped, seconds spent scoring); `seen` receives every scored
    trajectory, dropped groups included (their failures count too)."""
    G, want = cfg.train.group_size, cfg.train.prompts_per_step
    kept: list[Scored] = []
    dropped, scoring_s = 0, 0.0
    for round_ in range(1 + (cfg.train.max_refill_rounds if cfg.train.dynamic_sampling else 0)):
        n = want - len(kept) // G
        if n <= 0:
            break
        rows = sampler.next(n)
        episode_rows = [r for r in rows for _ in range(G)]
        trajs = run_batched(task, engine, renderer, episode_rows, sampling, cfg.rollout.max_turns,
                            cfg.rollout.max_context, cfg.rollout.max_batch, cfg.rollout.schedule)
        t0 = time.time()
        scored = shape_rewards(cfg, task.rubric.score(trajs))
        scoring_s += time.time() - t0
        if seen is not None:
            seen += scored
        if not cfg.train.dynamic_sampling:
            return scored, 0, scoring_s
        rewards = torch.tensor([s.reward for s in scored]).view(-1, G)
        valid = torch.tensor([not s.masked for s in scored]).view(-1, G)
        keep, n_drop = dynamic_sampling_filter(rewards, valid)
        dropped += n_drop
        last = round_ == cfg.train.max_refill_rounds
        for g in range(len(rows)):
            if keep[g] or (last and not kept):  # never end a step with nothing to train on
                kept += scored[g * G : (g + 1) * G]
    return kept, dropped, scoring_s


def rollouts_ahead(cfg: Config, task: LoadedTask, engine, renderer, sampler: PromptSampler, sampling: SamplingParams,
                   version: int, run_dir: Path) -> AheadRollouts:
    """The producer of rollout.max_staleness > 0 (actloop.train.ahead): `rollout_groups`' episodes and
    scoring, a group at a time, running ahead of training."""
    def run_group(eng, rows):
        return run_batched(task, eng, renderer, rows, sampling, cfg.rollout.max_turns, cfg.rollout.max_context,
                           cfg.rollout.max_batch, cfg.rollout.schedule)

    return AheadRollouts(cfg, engine, sampler, run_group, lambda trajs: shape_rewards(cfg, task.rubric.score(trajs)),
                         version, run_dir)


def shape_rewards(cfg: Config, scored: list[Scored]) -> list[Scored]:
    """DAPO's soft overlong penalty and overlong filtering (masking truncated episodes)."""
    import dataclasses

    t = cfg.train
    if t.overlong_buffer <= 0 and not t.mask_truncated:
        return scored
    out = []
    for s in scored:
        longest = max((len(turn.token_ids) for turn in s.trajectory.turns), default=0)
        reward, components = s.reward, dict(s.components)
        if t.overlong_buffer > 0:
            pen = float(overlong_penalty(torch.tensor([longest]), cfg.rollout.max_new_tokens, t.overlong_buffer,
                                         t.overlong_penalty)[0])
            reward, components["overlong"] = reward + pen, pen
        masked = s.masked or (t.mask_truncated and s.trajectory.truncated)
        out.append(dataclasses.replace(s, reward=reward, components=components, masked=masked))
    return out


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
        "prompt_tokens": sum(len(t.prompt_ids) for t in trajs),
        "response_tokens": sum(t.num_response_tokens for t in trajs),
        "tool_tokens": sum(t.num_env_tokens for t in trajs),
        "tool_calls_per_episode": mean(t.num_tool_calls for t in trajs),
        "malformed_call_rate": mean(t.num_malformed_calls > 0 for t in trajs),
        "truncated_rate": mean(t.truncated for t in trajs),
        "truncated_context": sum(t.truncated_context for t in trajs),
        "failed_rollouts": sum(s.masked for s in scored),
    }
    gateway = [t.info["gateway"] for t in trajs if "gateway" in t.info]  # agent episodes (actloop.gateway)
    if gateway:
        for k in ("calls", "extensions", "new_segments", "drift"):
            record[f"gateway/{k}"] = sum(g[k] for g in gateway)
    record.update(per_source_metrics(scored))  # source/<name>/... when rows come from a data.mix
    record.update({f"reward/{k}": v for k, v in sorted(component_means(scored).items())})
    return record


def eval_metrics(res: dict[str, Any]) -> dict[str, Any]:
    """A periodic evaluation's line in metrics.jsonl: greedy success (`eval_success`, which the
    reward-hacking alarm watches), mean reward (`eval_reward`: for a graded share such as the
    instructions task's, the loose accuracy), and per source of a data.mix `eval/<source>/success`
    and `eval/<source>/reward`."""
    out = {"eval_success": res["success"], "eval_reward": res["reward"], "eval_s": round(res["seconds"], 3)}
    for src, r in res.get("per_source", {}).items():
        out[f"eval/{src}/success"], out[f"eval/{src}/reward"] = r["success"], r["reward"]
    return out


def train(cfg: Config, progress: bool = True, print_fn=print) -> RunResult:
    """Run `cfg.algo`: the online RL loop below, or the trainer its row of ALGORITHMS names."""
    threads = torch.get_num_threads()
    try:
        alg = ALGORITHMS[cfg.algo]
        if alg.in_loop(cfg):  # grpo, rloo, ..., and online DPO: the rollout loop below
            return train_online(cfg, progress=progress, print_fn=print_fn)
        import importlib

        if launched_by_torchrun():  # each rank would run its own copy into the same run directory
            raise ConfigError(f"algo={cfg.algo} runs in one process; launch it without torchrun")

        if cfg.resume:
            raise ConfigError(f"resume is for the algorithms of the rollout loop ({', '.join(online_algorithms())}, "
                              f"dpo with dpo.online=true), not {cfg.algo} here")

        module, name = alg.trainer.split(":")
        return getattr(importlib.import_module(module), name)(cfg, progress=progress, print_fn=print_fn)
    finally:
        rundir.release()  # the run directory's lock (the kernel drops it anyway when the process ends)
        torch.set_num_threads(cfg.train.threads or threads)  # the loop kept one for itself (train_online)


def open_run(cfg: Config, print_fn=print) -> tuple[Path, checkpoint.Checkpoint | None]:
    """A new run directory, or with `resume=RUN_DIR` that directory and its newest checkpoint."""
    if not cfg.resume:
        return make_run_dir(cfg), None
    run_dir = Path(cfg.resume)
    saved = load_config(run_dir / "config.yaml")
    rundir.claim(run_dir)  # not while another process still runs into it
    ckpt = checkpoint.load_latest(run_dir)
    if ckpt is None:
        raise ConfigError(f"cannot resume {run_dir}: no checkpoint in {run_dir / checkpoint.CHECKPOINTS} (one is "
                          "written every checkpoint.every steps, on Ctrl-C, and after the last step with "
                          "checkpoint.at_end=true)")
    fixed, allowed = checkpoint.config_changes(saved, cfg)
    if fixed:
        raise ConfigError(f"cannot resume {run_dir} with a changed " + "; ".join(fixed)
                          + " (these decide what the checkpoint holds or which data comes next)")
    for line in allowed:
        print_fn(f"resume: {line}")
    (run_dir / "config.yaml").write_text(cfg.to_yaml())
    return run_dir, ckpt


def _usage(task: LoadedTask) -> dict[str, dict[str, float]]:
    """Process-wide sandbox totals and the task's judges' totals, read before and after a step."""
    rubrics = [task.rubric, *getattr(task.rubric, "parts", {}).values()]  # a data mix: its sources' rubrics
    return {"sandbox": sandbox_clock.totals(), "judge": judge_usage([t.func for r in rubrics for t in r.terms])}


def usage_delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Per-step keys of the cost monitor: sandbox wall time, runs and timeouts; judge requests,
    failures, tokens and cost (docs/runs.md)."""
    sb0, sb1 = before["sandbox"], after["sandbox"]
    rec: dict[str, Any] = {"sandbox_s": round(sb1["seconds"] - sb0["seconds"], 3),
                           "sandbox_runs": sb1["runs"] - sb0["runs"], "sandbox_timeouts": sb1["timeouts"] - sb0["timeouts"]}
    for k, v in after["judge"].items():
        rec[f"judge/{k}"] = round(v - before["judge"][k], 8) if isinstance(v, float) else v - before["judge"][k]
    return rec


def setup_process(cfg: Config) -> None:
    """What every trainer sets first: seeds, torch threads, glibc's mmap threshold."""
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    set_mmap_threshold(cfg.train.mmap_threshold_mb)


def train_online(cfg: Config, progress: bool = True, print_fn=print) -> RunResult:
    setup_process(cfg)
    dist = init_distributed(cfg)  # torchrun: this rank's place; one process: a no-op (docs/distributed.md)
    print_fn, progress = dist.printer(print_fn), progress and dist.is_main  # rank 0 alone prints and writes
    # config, reward functions and data checked before a run directory exists (agent.entry: agent code behind
    # the gateway, as a registry task)
    task: LoadedTask = build_run_task(cfg)
    run_dir, ckpt = open_run(cfg, print_fn) if dist.is_main else (dist.scratch_dir(), None)
    ckpt_dir = dist.broadcast_object(run_dir)  # sharded checkpoints: every rank writes into rank 0's
    ckpt = dist.broadcast_object(ckpt)
    if ckpt is not None and ckpt.sharded != dist.active:
        raise ConfigError(f"cannot resume {ckpt.path}: it was written " + (
            "under torchrun (sharded); resume it under torchrun with as many processes" if ckpt.sharded else
            "by one process; resume it without torchrun"))
    print_fn(f"run directory: {run_dir}")
    for note in task.info.get("notes", []):  # e.g. how many custom rows are held out for evaluation
        print_fn(note)
    alg = ALGORITHMS[cfg.algo]
    print_fn("engine: {} ({})".format(*resolve_engine(cfg)))
    # One thread computes: an engine with a thread of its own (HF's continuous batch, colocated vLLM) runs
    # decode, the update and the weight sync there (`engine.run`), with this process's torch threads; this
    # thread keeps one, so that it never starts an OpenMP pool of its own (two pools on the same cores
    # throttle libgomp's spin-wait: every parallel region of either waits on a futex; HFEngine's docstring)
    compute_threads = torch.get_num_threads()
    one_compute_thread = not dist.active
    if one_compute_thread:
        torch.set_num_threads(1)
    peaks = PhasePeaks(trim=cfg.train.malloc_trim)  # peak RSS per phase: metrics peak_mem_mb/<phase>, summary peak_mem_mb
    with peaks("model_load"):
        models = load_models(cfg.model, lora=cfg.lora, need_reference=cfg.train.beta > 0 or alg.needs_reference,
                             attn_implementation=cfg.train.attn_implementation)
        if models.reference is not None and uses_bf16_weights(cfg.train.precision, cfg.train.bf16_mode,
                                                              sharded=dist.active and cfg.distributed.fsdp):
            hold_in_bf16(models.reference)  # never trained: cast once, not at every update
    if cfg.train.routing_replay:
        require_routing(models.policy)  # a clear error for a model without a replayable MoE router
    if ckpt is not None and not dist.active:
        ckpt.load_policy(models.policy)  # before the engine copies the weights (sharded: after `prepare`)
    renderer = Renderer.from_config(models.tokenizer, cfg)
    with peaks("model_load"):
        engine = make_engine(cfg, models, renderer, threads=compute_threads)
    if one_compute_thread and not engine.own_thread:  # lock-step HF decode (sliding windows, MoE), remote engines
        torch.set_num_threads(compute_threads)
        one_compute_thread = False
    on_model_thread = engine.run if one_compute_thread else (lambda fn, *a: fn(*a))
    if cfg.rollout.max_staleness and (dist.active or not one_compute_thread):
        raise ConfigError("rollout.max_staleness > 0 runs in one process, with an engine that computes on a thread "
                          "of its own (vllm, or hf on a model it batches continuously)")
    if ckpt is not None and not dist.active:
        engine.sync_weights(models.policy)  # engines that load their own weights get the checkpoint's
        engine.version = ckpt.step  # the policy version its tokens carry: updates so far
    models.policy = dist.prepare(cfg, models, engine)  # FSDP2 under torchrun, after the engine's copy
    critic = Critic(models.policy, cfg.ppo.critic) if alg.needs_critic else None
    param_groups = [{"params": [p for p in models.policy.parameters() if p.requires_grad], "lr": cfg.train.lr}]
    if critic is not None:
        param_groups.append({"params": list(critic.parameters()), "lr": cfg.ppo.critic_lr})
    optimizer = adamw(param_groups, cfg.train.lr, cfg.train.weight_decay, fused=not dist.active,
                      kind=cfg.train.optimizer)
    # IS correction is on by default when the engine samples from its own copy of the weights
    correction = cfg.correction.mode
    if correction == "auto":
        correction = "tis_token" if engine.weights == "copy" or cfg.rollout.max_staleness else "none"
    ctx = UpdateContext(cfg, models, optimizer, critic, cfg.train.beta, correction, dist=dist if dist.active else None)
    update_step = {"policy": rl_update, "preference": preference_update}[alg.loss]  # the row's declared loss
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / cfg.train.warmup_steps) if cfg.train.warmup_steps else 1.0)
    sampler = dist.sampler(PromptSampler(task.train_rows, cfg.seed))  # each rank: its block of whole groups
    sampling = SamplingParams(cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.top_p)
    summary: dict[str, Any] = {"task": task.name, "model": cfg.model, "steps": cfg.train.steps, "data": task.info}
    # what the summary is computed from, kept across a resume
    totals: dict[str, Any] = {"step_seconds": [], "gen_tokens": 0, "gen_seconds": 0.0, "failures": {},
                              "reward_errors": 0, "checkpoint_seconds": 0.0, "unmasked_steps": 0}
    guard = FailureGuard(cfg.failures)
    start, state = 1, None
    if ckpt is not None:
        if dist.active:  # every rank: its shards of the policy and AdamW state, its own RNGs
            state = checkpoint.load_sharded(ckpt, dist, models.policy, optimizer)
            dist.sync_engine(engine, models.policy)
        else:
            state = ckpt.load_state()
            optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        checkpoint.apply_optimizer_config(optimizer, scheduler, [cfg.train.lr, cfg.ppo.critic_lr][: len(param_groups)],
                                          cfg.train.weight_decay)  # a resume may change train.lr
        if critic is not None:
            critic.load_state_dict(state["critic"])
        sampler.load_state_dict(state["sampler"])
        guard.load_state_dict(state["failure_guard"])
        ctx.beta, summary, totals = state["beta"], state["summary"], state["totals"]
        summary["steps"] = cfg.train.steps
        start = ckpt.step + 1
        for name in ("metrics.jsonl", "failures.jsonl", "samples.jsonl", "alarms.jsonl", "groups.jsonl"):  # a killed step may have left a line (or half of one)
            checkpoint.truncate_jsonl(run_dir / name, ckpt.step)
        print_fn(f"resuming from {ckpt.path} (step {ckpt.step} of {cfg.train.steps})")
    monitor = Monitor(dist.main_only(cfg), run_dir, print_fn)  # metrics.jsonl, samples, alarms, TensorBoard/W&B
    failure_log = FailureLog(run_dir / "failures.jsonl")
    stateful = {"monitor": monitor}  # components whose state_dict() rides in the checkpoint's `extra`
    # rollout.max_staleness > 0: groups sampled ahead of training by a producer thread (None: synchronous)
    ahead = (rollouts_ahead(cfg, task, engine, renderer, sampler, sampling, start - 1, run_dir)
             if cfg.rollout.max_staleness else None)
    if ahead is not None:
        stateful["ahead"] = ahead  # the sampler as it left it, finished groups, running groups' rows
    if state is not None:
        for name, obj in stateful.items():
            if name in state.get("extra", {}) and hasattr(obj, "load_state_dict"):
                obj.load_state_dict(state["extra"][name])

    def save_checkpoint(step: int) -> str | None:
        """Write checkpoint `step`; None, or why it could not be written (the run then stops:
        the previous checkpoint is intact)."""
        t = time.time()
        state = {
            "scheduler": scheduler.state_dict(),
            "critic": critic.state_dict() if critic is not None else None, "sampler": sampler.state_dict(),
            "beta": ctx.beta, "rng": checkpoint.rng_state(), "summary": summary, "totals": totals,
            "failure_guard": guard.state_dict(),
            "extra": {n: o.state_dict() for n, o in stateful.items() if hasattr(o, "state_dict")},
        }
        try:
            with peaks("checkpoint"):
                if dist.active:  # sharded policy and AdamW state: torch.distributed.checkpoint, every rank
                    checkpoint.save_sharded(ckpt_dir, step, dist, models.policy, optimizer, state,
                                            keep=cfg.checkpoint.keep)
                else:
                    checkpoint.save(run_dir, step, models.policy, {"optimizer": optimizer.state_dict(), **state},
                                    keep=cfg.checkpoint.keep)
        except checkpoint.CheckpointError as e:
            return str(e)
        totals["checkpoint_seconds"] += time.time() - t
        return None

    def run_eval(label: str, rows: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
        if not dist.is_main:  # rank 0 evaluates; the others wait for it at the next collective
            return None
        with peaks("eval"):
            res = evaluate(engine, renderer, task, rows if rows is not None else task.eval_rows,
                           cfg.rollout.max_new_tokens, cfg.rollout.max_turns, max_context=cfg.rollout.max_context,
                           schedule=cfg.rollout.schedule, max_batch=cfg.rollout.max_batch, keep_problems=rows is None)
        if rows is None:
            summary[label] = write_problems(run_dir, label, res)
        print_fn(eval_line(label, res))
        return res

    if ckpt is None and cfg.train.eval_before and task.eval_rows:
        run_eval("eval_before")
    if state is not None:  # last: the generators continue exactly where the checkpoint left them
        checkpoint.set_rng_state(state["rng"])

    # the update's own glibc mmap threshold, unless train.mmap_threshold_mb fixed one for the process
    update_mmap_mb = 0.0 if cfg.train.mmap_threshold_mb else cfg.train.update_mmap_threshold_mb
    lend = uses_bf16_weights(cfg.train.precision, cfg.train.bf16_mode, sharded=dist.fsdp)
    bar = _progress(cfg.train.steps, progress)
    stop_msg, requested, last = None, None, start - 1
    with (GracefulStop(print_fn, cfg.checkpoint.on_interrupt) as stop, bar, frozen_gc(),  # setup's objects: no GC walks
          ahead or contextlib.nullcontext()):  # the producer samples from here to the loop's end
        task_id = bar.add_task("train", total=cfg.train.steps, completed=start - 1, reward=0.0, success=0.0)
        for step in range(start, cfg.train.steps + 1):
            t0 = time.time()
            # 1. roll out G episodes for each of the step's prompts (refilling all-equal groups)
            tok0, usage0, errors0, seen = engine.generated_tokens, _usage(task), len(task.rubric.errors), []
            with peaks("rollout"):  # generation, environment steps and scoring
                if ahead is None:
                    scored, dropped, scoring_s = rollout_groups(cfg, task, engine, renderer, sampler, sampling, seen=seen)
                else:  # the oldest groups the producer finished, within the staleness bound
                    got = ahead.take(step)
                    scored, dropped, scoring_s, seen = got.scored, got.dropped, got.scoring_s, got.seen
            t2 = time.time()
            t1 = t2 - scoring_s  # rollout time excludes scoring
            # 2. advantages and the policy update (actloop.train.update), then new weights to the engine;
            #    failed trajectories are masked (a step with nothing valid trains nothing)
            # a colocated vLLM frees its GPU memory for the update; an HF engine's bf16 copy becomes the
            # storage of the update's bf16 weights (train.bf16_mode=weights), refilled by the sync below
            # (running ahead, the engine keeps its memory: the producer's episodes go on through the update)
            if lend and ahead is None:
                ctx.lent_weights = engine.lend_weights(models.policy)
            elif ahead is None:
                engine.sleep()
            model_call = on_model_thread if ahead is None else engine.run_in_flight  # between two decode steps
            ctx.version = step - 1  # the proximal policy: the weights before this update
            with peaks("update"), mmap_threshold(update_mmap_mb):
                # rl_update, or online DPO's preference update, on the engine's thread (one thread computes)
                upd = model_call(update_step, ctx, scored, cfg.train.group_size)
                with warnings.catch_warnings():  # a step that trained nothing made no optimizer step
                    warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
                    scheduler.step()
                t_sync = time.time()
                model_call(dist.sync_engine, engine, models.policy)  # FSDP: the gathered full weights
                sync_s = time.time() - t_sync
            if ahead is not None:
                ahead.synced(step)  # the staleness bound moves on
            # 3. KL coefficient for the next step (fixed, or adaptive towards kl.target); a step that
            #    trained nothing (all masked) measured no KL: its 0.0 is a placeholder, beta stays
            if upd.get("trained_trajectories", 1):
                ctx.beta = KL_CONTROLLERS[cfg.kl.controller](ctx.beta, upd["kl"], cfg.kl.target, cfg.kl.horizon,
                                                        len(scored) * dist.world)
            t3 = time.time()
            # 4. log: metrics, failures (failures.jsonl), then a checkpoint
            failures = classify(step, seen, task.rubric.errors[errors0:])
            totals["reward_errors"] += len(task.rubric.errors) - errors0
            new_tokens = engine.generated_tokens - tok0
            totals["gen_tokens"] += new_tokens
            totals["gen_seconds"] += t1 - t0
            record = step_metrics(step, dist.gather_lists(scored), cfg.train.group_size)  # all ranks' groups
            record.update(upd)
            record["dropped_groups"] = dropped
            record.update(got.metrics if ahead is not None else {})  # staleness, waits (rollout.max_staleness)
            record.update(failure_metrics(failures, len(seen), cfg.failures))
            record.update(usage_delta(usage0, _usage(task)))
            record.update(
                lr=scheduler.get_last_lr()[0],
                rollout_s=round(t1 - t0, 3),
                scoring_s=round(t2 - t1, 3),
                update_s=round(t3 - t2, 3),
                sync_s=round(sync_s, 3),  # new weights into the engine (part of update_s)
                step_s=round(t3 - t0, 3),
                gen_tokens_per_s=round(new_tokens / max(t1 - t0, 1e-9), 1),
            )
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and task.eval_rows:
                # greedy (no random numbers drawn), so a resumed run stays identical
                res = run_eval(f"eval at step {step}", task.eval_rows[: cfg.train.eval_every_rows or None])
                if res is not None:
                    record.update(eval_metrics(res))
            record.update(peaks.step_metrics())  # this step's phases (a checkpoint's lands in the next step)
            monitor.log_step(record, scored)
            failure_log.write(failures)
            for f in failures:
                totals["failures"][f.kind] = totals["failures"].get(f.kind, 0) + 1
            for line in (masked_line(step, failures, len(seen), failure_log.path),
                         tool_line(step, failures, len(seen), failure_log.path)):
                if line is not None:
                    print_fn(line)
            if any(not s.masked for s in scored):  # a step that had something to train on (ties included)
                totals["unmasked_steps"] = totals.get("unmasked_steps", 1) + 1  # missing: an older checkpoint
            stop_msg = dist.first(guard.check(step, failures, len(seen), run_dir))  # every rank stops together
            totals["step_seconds"].append(t3 - t0)
            last = step
            bar.update(task_id, advance=1, reward=record["reward_mean"], success=record["success"])
            # read once: a signal landing after this read is handled at the next step's end (never a
            # stop without a checkpoint); every rank stops at the same step (torchrun signals each rank)
            requested = dist.first(stop.requested)
            every = cfg.checkpoint.every
            if ((every and step % every == 0) or stop_msg or requested
                    or (step == cfg.train.steps and cfg.checkpoint.at_end)):
                full = save_checkpoint(step)  # a disk full stops the run here
                if full:
                    stop_msg = full
                else:
                    totals["checkpoint_step"] = step
            if stop_msg or requested:
                break

    monitor.close()
    summary["monitor"] = monitor.summary()
    failure_log.close()
    summary["seconds_per_step"] = round(mean(totals["step_seconds"]), 2)
    summary["generated_tokens_per_s"] = (round(totals["gen_tokens"] / totals["gen_seconds"], 1)
                                         if totals["gen_seconds"] else 0.0)
    summary["failures"] = dict(totals["failures"])
    summary["checkpoint_seconds"] = round(totals["checkpoint_seconds"], 2)
    summary["peak_mem_mb"] = dict(peaks.run)  # this process's peak RSS per phase (MiB)
    if totals["reward_errors"]:
        summary["reward_errors"] = totals["reward_errors"]
    trained_somewhere = dist.first(True if totals.get("unmasked_steps", 1) else None)  # any rank, any step
    if (not stop_msg and not requested and last >= start and not trained_somewhere
            and cfg.failures.nothing_trained == "error"):
        kinds = count_kinds(totals["failures"])
        stop_msg = (f"no step trained anything: every trajectory of steps 1-{last} was masked ({kinds}). "
                    f"Tracebacks are in {run_dir / 'failures.jsonl'}; failures.nothing_trained=ignore finishes anyway.")
    summary["steps"] = max(last, 0)  # completed (a stopped run: fewer than train.steps)
    if last < cfg.train.steps:
        summary["steps_planned"] = cfg.train.steps
    else:
        summary.pop("steps_planned", None)
    if stop_msg or requested:
        summary["stopped"] = {"step": last, "reason": stop_msg or requested}
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        if stop_msg:
            raise RunAborted(stop_msg)
        print_fn(f"stopped after step {last} ({requested}); continue with `actloop train resume={run_dir}`")
        return RunResult(run_dir, summary)
    summary.pop("stopped", None)
    if start > cfg.train.steps:
        print_fn(f"the run already reached step {cfg.train.steps}; extend it with train.steps=N")
    if last >= start and totals.get("checkpoint_step") != last and not dist.active:  # torchrun: none written yet
        print_fn(f"no checkpoint of the last step {last} (checkpoint.at_end=false)"
                 + ("; final/ holds the trained model" if cfg.train.save_final else "")
                 + "; to extend a run later with resume=, train it with checkpoint.at_end=true")
    drop_state(optimizer)  # no step follows (the at-end checkpoint is written): AdamW's moments are not held
    if cfg.train.eval_after and task.eval_rows:
        run_eval("eval_after")
    if cfg.train.save_final:
        final, tmp = run_dir / "final", run_dir / f"final.tmp-{os.getpid()}"
        dist.save_pretrained(models.policy, tmp)  # FSDP: gathered on every rank, written by rank 0
        if dist.is_main:
            models.tokenizer.save_pretrained(tmp)
            checkpoint.install(tmp, final)  # an earlier final/ is deleted only once the new one is in place
        summary["final_dir"] = str(final)
    if not dist.active and (cfg.train.save_final or totals.get("checkpoint_step") == last):
        for path in checkpoint.drop_outrun(run_dir, last, cfg.checkpoint.every):  # what a stop wrote
            print_fn(f"removed {path} (written when the run was stopped; the run has finished)")
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    run_dir = dist.broadcast_object(run_dir)  # every rank reports rank 0's run directory
    dist.close()
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
