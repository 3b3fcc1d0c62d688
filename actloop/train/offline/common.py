"""What the DPO and SFT trainers share with each other: the held-out evaluation task, the model and
engine, the optimizer, the schedule of an offline run, the final model. The run's bookkeeping is the
GRPO loop's own `actloop.train.runtime.run.Run`."""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import torch

from actloop.algos.batching import minibatches
from actloop.config import Config
from actloop.tasks import LoadedTask, build_task
from actloop.models import Models, load_models
from actloop.rollout.factory import make_engine
from actloop.rollout.renderer import Renderer
from actloop.train.numerics.optim import adamw, warmup_schedule
from actloop.train.runtime.run import Run, progress_bar, setup_process


def eval_task(cfg: Config) -> LoadedTask:
    """The task whose held-out rows measure an offline run.

    `data.path` holds the offline trainer's own rows (pairs, conversations), not task rows, so
    evaluation uses `data.eval_path` (custom rows scored by `reward.funcs`) when given, else the
    built-in `data.task` (calculator)."""
    if cfg.data.eval_path:
        data = dataclasses.replace(cfg.data, path=cfg.data.eval_path)
    else:
        data = dataclasses.replace(cfg.data, path=None)
    return build_task(dataclasses.replace(cfg, data=data))


def describe_eval(cfg: Config, task: LoadedTask) -> str:
    """What an offline run's held-out evaluation measures, said at the start."""
    if cfg.data.eval_path:
        return f"{len(task.eval_rows)} rows of data.eval_path {cfg.data.eval_path} (scored by reward.funcs)"
    held = f"{len(task.eval_rows)} held-out problems of data.task={task.name}"
    if not cfg.data.path:  # the trainer's data are the task's own (gold traces, sampled pairs)
        return held
    return f"{held} (data.path holds the training data; set data.eval_path to evaluate on your own rows)"


def offline_run(cfg: Config, print_fn=print) -> Run:
    """The run of an offline trainer (DPO, SFT): its `Run` (the GRPO loop's bookkeeping), the model,
    and the same engine as the GRPO loop (its own bf16 copy, LoRA merged in), so that eval_before of
    every algorithm on one model is the same number."""
    setup_process(cfg)
    task = eval_task(cfg)  # checked before the run directory exists
    run = Run(cfg, task, print_fn)
    run.summary["algo"] = cfg.algo
    if (cfg.train.eval_before or cfg.train.eval_after) and task.eval_rows:
        print_fn(f"evaluating on {describe_eval(cfg, task)}")
    run.models = load_models(cfg.model, lora=cfg.lora, attn_implementation=cfg.train.attn_implementation)
    run.renderer = Renderer.from_config(run.models.tokenizer, cfg)
    run.engine = make_engine(cfg, run.models, run.renderer)
    run.sync_before_eval = True  # the engine samples only to evaluate: it gets the weights then
    run.open_logs(online=False)
    return run


def offline_optimizer(cfg: Config, models: Models) -> tuple[torch.optim.Optimizer, Any]:
    params = [p for p in models.policy.parameters() if p.requires_grad]
    opt = adamw(params, cfg.train.lr, cfg.train.weight_decay, kind=cfg.train.optimizer)
    return opt, warmup_schedule(opt, cfg.train.warmup_steps)


def clip_and_step(cfg: Config, models: Models, optimizer, scheduler) -> float:
    params = [p for p in models.policy.parameters() if p.requires_grad]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.train.max_grad_norm))
    optimizer.step()
    scheduler.step()
    return grad_norm


def save_full_model(models: Models, out: Path) -> None:
    """A plain transformers checkpoint (LoRA merged in), so `model=<run>/final` loads it — the
    hand-off from SFT (or DPO) to a GRPO run."""
    policy = models.policy
    if models.lora:
        policy = policy.merge_and_unload()
        models.policy = policy
    policy.save_pretrained(out)
    models.tokenizer.save_pretrained(out)


def offline_schedule(cfg: Config, n: int, batch_size: int, epochs: int, what: str, epochs_key: str,
                     print_fn=print) -> list[tuple[int, int, list[int]]]:
    """The (step, epoch, item indices) of an offline run over `n` items, said at the start.

    By default `epochs` shuffled passes in batches of `batch_size`. When `train.steps` was set
    (file or override) and the items come from `data.path`, exactly that many steps: passes repeat
    as needed (the last one cut short), so train.steps caps or extends the run as it does for GRPO."""
    bs = max(1, batch_size)
    per_epoch = math.ceil(n / bs)
    honour = bool(cfg.data.path) and "train.steps" in cfg.explicit_keys
    total = cfg.train.steps if honour else per_epoch * epochs
    if honour:
        print_fn(f"{cfg.algo}: train.steps={total} steps of {bs} over {n} {what} ({total / max(per_epoch, 1):.1f} "
                 f"passes; {epochs_key} is not used when train.steps is set)")
    else:
        print_fn(f"{cfg.algo}: {total} steps = {epochs_key}={epochs} x {per_epoch} batches of {bs} over {n} {what}"
                 + ("; set train.steps to choose the number of steps" if cfg.data.path else ""))
    passes = math.ceil(total / per_epoch) if n else 0
    steps = minibatches(n, bs, passes, seed=cfg.seed)[:total]  # the update path's schedule (algos.batching)
    return [(k + 1, k // per_epoch + 1, idx) for k, idx in enumerate(steps)]


def offline_loop(run: Run, plan: list[tuple[int, int, list[int]]], label: str, progress: bool, scheduler: Any,
                 step_fn: Any) -> None:
    """An offline trainer's loop over its `plan` (offline_schedule): `step_fn(item indices) ->
    metrics` per step, one metrics line each with its epoch, learning rate and seconds."""
    with progress_bar(len(plan), progress) as bar:
        tid = bar.add_task(label, total=len(plan), loss=0.0)
        for step, epoch, idx in plan:
            timer = Timer()
            m = step_fn(idx)
            run.log({"step": step, "epoch": epoch, **m, "lr": scheduler.get_last_lr()[0], "step_s": round(timer(), 3)},
                    timer())
            bar.update(tid, advance=1, loss=m["loss"])


class Timer:
    def __init__(self):
        self.t0 = time.time()

    def __call__(self) -> float:
        return time.time() - self.t0
