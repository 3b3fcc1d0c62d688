"""The online RL loop (GRPO, RLOO, PPO, ..., online DPO), top to bottom: each step rolls out
groups of episodes, scores them, turns rewards into advantages, updates the policy and syncs the
new weights into the engine (`rl_step`). Maths lives in `actloop.algos`; the update on one padded
batch in `actloop.train.rl.update`; the bookkeeping around a step (timing, totals, failures, metrics,
evaluation, signals, checkpoints) in `actloop.train.runtime.run.Run`, shared with DPO and SFT.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from actloop.algos import ALGORITHMS, KL_CONTROLLERS
from actloop.algos.batching import dynamic_sampling_filter
from actloop.algos.shaping import overlong_penalty
from actloop.config import Config, ConfigError
from actloop.data.sampler import PromptSampler
from actloop.gateway.agent import build_run_task
from actloop.tasks import LoadedTask
from actloop.models import Models, load_models
from actloop.models.routing import require_routing
from actloop.rollout.engine import SamplingParams
from actloop.rollout.episodes import run_batched
from actloop.rollout.factory import make_engine, resolve_engine
from actloop.rollout.renderer import Renderer
from actloop.train.numerics.mixed_precision import hold_in_bf16, uses_bf16_weights
from actloop.train.numerics.optim import adamw, warmup_schedule
from actloop.train.offline.preference import preference_update
from actloop.train.rl.ahead import AheadRollouts
from actloop.train.rl.critic import Critic
from actloop.train.rl.update import UpdateContext, rl_update
from actloop.train.runtime import checkpoint
from actloop.train.runtime.distributed import Dist, init_distributed
from actloop.train.runtime.memory import mmap_threshold
from actloop.train.runtime.run import Run, RunResult, StepResult, setup_process
from actloop.types import Scored


# ------------------------------------------------------------------------------------ one step


def rl_step(step: int, cfg: Config, learner: Learner, run: Run) -> StepResult:
    """One step of the online loop: rollout -> score -> advantages -> update -> sync."""
    L = learner
    # 1. roll out G episodes for each of the step's prompts and score them (refilling all-equal groups)
    with run.phase("rollout"):  # generation, environment steps and scoring
        if L.ahead is None:
            seen: list[Scored] = []
            scored, dropped, scoring_s = rollout_groups(cfg, L.task, L.engine, L.renderer, L.sampler, L.sampling,
                                                        seen=seen)
            extra: dict[str, Any] = {}
        else:  # the oldest groups the producer finished, within the staleness bound
            got = L.ahead.take(step)
            scored, dropped, scoring_s, seen, extra = got.scored, got.dropped, got.scoring_s, got.seen, got.metrics
    # 2. advantages and the policy update (actloop.train.rl.update: failed trajectories are masked, a
    #    step with nothing valid trains nothing). A colocated vLLM frees its GPU memory for the
    #    update; an HF engine's bf16 copy becomes the storage of the update's bf16 weights
    #    (train.bf16_mode=weights), refilled by the sync below. Running ahead, the engine keeps its
    #    memory: the producer's episodes go on through the update, which runs between two decode steps.
    if L.ahead is None and L.lend:
        L.ctx.lent_weights = L.engine.lend_weights(L.models.policy)
    elif L.ahead is None:
        L.engine.sleep()
    on_model = L.on_model_thread if L.ahead is None else L.engine.run_in_flight
    L.ctx.version = step - 1  # the proximal policy: the weights before this update
    with run.phase("update"), mmap_threshold(L.update_mmap_mb):
        upd = on_model(L.update_step, L.ctx, scored, cfg.train.group_size)  # rl_update, or online DPO's
        with warnings.catch_warnings():  # a step that trained nothing made no optimizer step
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
            L.scheduler.step()
        # 3. the new weights into the engine (FSDP: the gathered full weights)
        with run.timed("sync"):
            on_model(L.dist.sync_engine, L.engine, L.models.policy)
    if L.ahead is not None:
        L.ahead.synced(step)  # the staleness bound moves on
    # 4. the KL coefficient for the next step (fixed, or adaptive towards kl.target); a step that
    #    trained nothing (all masked) measured no KL: its 0.0 is a placeholder, beta stays
    if upd.get("trained_trajectories", 1):
        L.ctx.beta = KL_CONTROLLERS[cfg.kl.controller](L.ctx.beta, upd["kl"], cfg.kl.target, cfg.kl.horizon,
                                                       len(scored) * L.dist.world)
    return StepResult(scored, seen, dropped, scoring_s, upd, extra)


def train_online(cfg: Config, progress: bool = True, print_fn=print) -> RunResult:
    setup_process(cfg)
    dist = init_distributed(cfg)  # torchrun: this rank's place; one process: a no-op (docs/distributed.md)
    print_fn, progress = dist.printer(print_fn), progress and dist.is_main  # rank 0 alone prints and writes
    # config, reward functions and data checked before a run directory exists (agent.entry: agent code behind
    # the gateway, as a registry task)
    task: LoadedTask = build_run_task(cfg)
    run = Run(cfg, task, print_fn, dist)  # a new run directory, or resume=RUN_DIR's and its newest checkpoint
    run.summary.update(steps=cfg.train.steps, data=task.info)
    learner = build_learner(cfg, run, task, dist)
    run.restore(learner)  # resume: the checkpoint's optimizer, scheduler, sampler, KL coefficient, totals
    # rollout.max_staleness > 0: groups sampled ahead of training by a producer thread (None: synchronous)
    learner.ahead = (rollouts_ahead(cfg, task, learner.engine, learner.renderer, learner.sampler, learner.sampling,
                                    run.start - 1, run.run_dir) if cfg.rollout.max_staleness else None)
    if learner.ahead is not None and getattr(learner.engine, "decodes_in_flight", False) and cfg.rollout.decode_during_update:
        # sampling goes on between the update's micro-batches (vLLM; the HF engine's runs drain first)
        learner.ctx.between_passes = learner.engine.decode_for
    # metrics.jsonl, samples, alarms, failures.jsonl; the producer's state rides in the checkpoint
    run.open_logs(online=True, stateful={"ahead": learner.ahead} if learner.ahead is not None else {})
    if run.ckpt is None:
        run.evaluate("eval_before")
    with run.loop(progress, learner.ahead) as steps:
        for step in steps:
            run.begin_step()
            out = rl_step(step, cfg, learner, run)
            if run.end_step(step, out, learner):  # metrics, failures, evaluation, signals, checkpoint
                break
    return run.finish(learner.optimizer, learner.save_model)


# ----------------------------------------------------------------------------------- the setup


@dataclass
class Learner:
    """What the online loop trains with: the policy (and critic), its optimizer and schedule, the
    engine that samples from it, the prompts, and the update its algorithm declares."""

    cfg: Config
    task: LoadedTask
    dist: Dist
    models: Models
    renderer: Renderer
    engine: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    critic: Critic | None
    ctx: UpdateContext
    update_step: Callable  # rl_update, or online DPO's preference_update
    sampler: Any  # PromptSampler (each rank: its block of whole groups)
    sampling: SamplingParams
    on_model_thread: Callable  # runs a function on the thread that computes (the engine's, or this one)
    lend: bool  # the update borrows the HF engine's bf16 copy as its bf16 weights
    update_mmap_mb: float  # the update's glibc mmap threshold
    ahead: AheadRollouts | None = None

    def state_dict(self) -> dict[str, Any]:
        """The learner's part of a checkpoint (the policy and AdamW state are written beside it)."""
        return {"scheduler": self.scheduler.state_dict(), "sampler": self.sampler.state_dict(),
                "critic": self.critic.state_dict() if self.critic is not None else None, "beta": self.ctx.beta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        cfg = self.cfg
        self.scheduler.load_state_dict(state["scheduler"])
        lrs = [cfg.train.lr, cfg.ppo.critic_lr][: len(self.optimizer.param_groups)]
        checkpoint.apply_optimizer_config(self.optimizer, self.scheduler, lrs,
                                          cfg.train.weight_decay)  # a resume may change train.lr
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
        self.sampler.load_state_dict(state["sampler"])
        self.ctx.beta = state["beta"]

    def save_model(self, out: Path) -> None:
        """final/: the policy as a transformers checkpoint (FSDP: gathered on every rank, written by rank 0)."""
        self.dist.save_pretrained(self.models.policy, out)
        if self.dist.is_main:
            self.models.tokenizer.save_pretrained(out)


def build_learner(cfg: Config, run: Run, task: LoadedTask, dist: Dist) -> Learner:
    """Models, engine, optimizer and update of the online loop; a resume's policy weights."""
    alg, ckpt = ALGORITHMS[cfg.algo], run.ckpt
    print_fn, peaks = run.print, run.peaks
    print_fn("engine: {} ({})".format(*resolve_engine(cfg)))
    # One thread computes: an engine with a thread of its own (HF's continuous batch, colocated vLLM) runs
    # decode, the update and the weight sync there (`engine.run`), with this process's torch threads; this
    # thread keeps one, so that it never starts an OpenMP pool of its own (two pools on the same cores
    # throttle libgomp's spin-wait: every parallel region of either waits on a futex; HFEngine's docstring)
    compute_threads = torch.get_num_threads()
    one_compute_thread = not dist.active
    if one_compute_thread:
        torch.set_num_threads(1)
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
    if cfg.rollout.max_staleness and (dist.active or not (one_compute_thread or engine.samples_apart)):
        raise ConfigError("rollout.max_staleness > 0 runs in one process, with an engine that computes on a thread "
                          "of its own (vllm, or hf on a model it batches continuously) or a vllm-server")
    if ckpt is not None and not dist.active:
        engine.sync_weights(models.policy)  # engines that load their own weights get the checkpoint's
        engine.version = ckpt.step  # the policy version its tokens carry: updates so far
    models.policy = dist.prepare(cfg, models, engine)  # FSDP2 under torchrun, after the engine's copy
    run.models, run.renderer, run.engine = models, renderer, engine  # for evaluation and the step's counters
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
    return Learner(
        cfg, task, dist, models, renderer, engine, optimizer, warmup_schedule(optimizer, cfg.train.warmup_steps),
        critic, ctx, update_step,
        sampler=dist.sampler(PromptSampler(task.train_rows, cfg.seed)),  # each rank: its block of whole groups
        sampling=SamplingParams(cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.top_p),
        on_model_thread=on_model_thread,
        lend=uses_bf16_weights(cfg.train.precision, cfg.train.bf16_mode, sharded=dist.fsdp),
        # the update's own glibc mmap threshold, unless train.mmap_threshold_mb fixed one for the process
        update_mmap_mb=0.0 if cfg.train.mmap_threshold_mb else cfg.train.update_mmap_threshold_mb,
    )


# ------------------------------------------------------------------------- prompts and rollouts


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
    """The producer of rollout.max_staleness > 0 (actloop.train.rl.ahead): `rollout_groups`' episodes and
    scoring, a group at a time, running ahead of training."""
    def run_group(eng, rows):
        return run_batched(task, eng, renderer, rows, sampling, cfg.rollout.max_turns, cfg.rollout.max_context,
                           cfg.rollout.max_batch, cfg.rollout.schedule)

    return AheadRollouts(cfg, engine, sampler, run_group, lambda trajs: shape_rewards(cfg, task.rubric.score(trajs)),
                         version, run_dir)


def shape_rewards(cfg: Config, scored: list[Scored]) -> list[Scored]:
    """DAPO's soft overlong penalty and overlong filtering (masking truncated episodes)."""
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
