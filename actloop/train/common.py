"""What the DPO and SFT trainers share with each other (and mirror from the GRPO loop): seeding,
the run directory, the held-out evaluation task, the engine, optimizer, held-out greedy eval
before/after, the final checkpoint and summary.json with the same keys as a GRPO run."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from actloop.algos.batching import minibatches
from actloop.config import Config
from actloop.tasks import LoadedTask, build_task
from actloop.models import Models, load_models
from actloop.monitor.metrics import JsonlSink, mean
from actloop.rollout.factory import make_engine
from actloop.rollout.renderer import Renderer
from actloop.train.evaluate import eval_line, evaluate
from actloop.train.optim import adamw, drop_state
from actloop.train.trainer import RunResult, make_run_dir, setup_process, write_problems


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


class Run:
    """One training run's plumbing; the trainers own the loop in between."""

    def __init__(self, cfg: Config, print_fn=print, need_reference: bool = False, task: LoadedTask | None = None):
        setup_process(cfg)
        self.cfg, self.print = cfg, print_fn
        self.task: LoadedTask = task if task is not None else eval_task(cfg)  # checked before the run directory exists
        self.run_dir: Path = make_run_dir(cfg)
        print_fn(f"run directory: {self.run_dir}")
        for note in self.task.info.get("notes", []):
            print_fn(note)
        if task is None and (cfg.train.eval_before or cfg.train.eval_after) and self.task.eval_rows:
            print_fn(f"evaluating on {describe_eval(cfg, self.task)}")
        self.models: Models = load_models(cfg.model, lora=cfg.lora, need_reference=need_reference,
                                          attn_implementation=cfg.train.attn_implementation)
        self.renderer = Renderer.from_config(self.models.tokenizer, cfg)
        # the same engine as the GRPO loop (its own bf16 copy, LoRA merged in), so that
        # eval_before of every algorithm on one model is the same number
        self.engine = make_engine(cfg, self.models, self.renderer)
        self.sink = JsonlSink(self.run_dir / "metrics.jsonl")
        self.summary: dict[str, Any] = {"task": self.task.name, "model": cfg.model, "algo": cfg.algo}
        self.step_seconds: list[float] = []
        self.trained_tokens = 0  # loss tokens of the offline trainers' batches (their throughput figure)

    def optimizer(self) -> tuple[torch.optim.Optimizer, Any]:
        t = self.cfg.train
        params = [p for p in self.models.policy.parameters() if p.requires_grad]
        opt = adamw(params, t.lr, t.weight_decay, kind=t.optimizer)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / t.warmup_steps) if t.warmup_steps else 1.0)
        return opt, sched

    def clip_and_step(self, optimizer, scheduler) -> float:
        params = [p for p in self.models.policy.parameters() if p.requires_grad]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, self.cfg.train.max_grad_norm))
        optimizer.step()
        scheduler.step()
        return grad_norm

    def evaluate(self, label: str) -> None:
        enabled = self.cfg.train.eval_before if label == "eval_before" else self.cfg.train.eval_after
        if not enabled or not self.task.eval_rows:
            return
        self.engine.sync_weights(self.models.policy)
        res = evaluate(self.engine, self.renderer, self.task, self.task.eval_rows, self.cfg.rollout.max_new_tokens,
                       self.cfg.rollout.max_turns, max_context=self.cfg.rollout.max_context,
                       max_batch=self.cfg.rollout.max_batch, keep_problems=True)
        self.summary[label] = write_problems(self.run_dir, label, res)
        self.print(eval_line(label, res))

    def log(self, record: dict[str, Any], seconds: float) -> None:
        self.sink.log(record)
        self.step_seconds.append(seconds)
        self.trained_tokens += int(record.get("tokens", 0))

    def finish(self, optimizer: torch.optim.Optimizer | None = None) -> RunResult:
        """Summary, final evaluation, final/; `optimizer`'s state is dropped first (no step follows)."""
        if optimizer is not None:
            drop_state(optimizer)
        self.sink.close()
        self.summary["steps"] = len(self.step_seconds)
        self.summary["seconds_per_step"] = round(mean(self.step_seconds), 2)
        if self.trained_tokens:  # offline: no generation to report, the data trained on instead
            self.summary["trained_tokens_per_s"] = round(self.trained_tokens / max(sum(self.step_seconds), 1e-9), 1)
        self.evaluate("eval_after")
        if self.cfg.train.save_final:
            final = self.run_dir / "final"
            save_full_model(self.models, final)
            self.summary["final_dir"] = str(final)
        (self.run_dir / "summary.json").write_text(json.dumps(self.summary, indent=2))
        return RunResult(self.run_dir, self.summary)


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


def progress_bar(total: int, enabled: bool, label: str = "step"):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn(f"[bold]{label}"), MofNCompleteColumn(), BarColumn(),
                    TextColumn("loss {task.fields[loss]:.4f}"), TimeElapsedColumn(), TimeRemainingColumn(),
                    disable=not enabled)


class Timer:
    def __init__(self):
        self.t0 = time.time()

    def __call__(self) -> float:
        return time.time() - self.t0
