"""One training run's bookkeeping, for every trainer: the online RL loop (`actloop.train.rl.loop`),
DPO and SFT. A trainer owns its loop and what a step computes; `Run` records around it:

    the run directory (new, or `resume=RUN_DIR` and its newest checkpoint)
    timing and peak memory per phase        `with run.phase("rollout"): ...`
    totals and summary.json                 step seconds, tokens, failures, checkpoint seconds
    metrics.jsonl                           the monitor (RL: samples, alarms, costs) or a plain sink (offline)
    the failure guard and failures.jsonl    a run stops past `failures.*` thresholds
    held-out evaluation                     eval_before, every train.eval_every steps, eval_after
    signals                                 Ctrl-C / SIGTERM finish the step, checkpoint, exit
    checkpoints                             every checkpoint.every steps, on a stop, at the end
    the end                                 final/, summary.json, why a run stopped

Nothing here trains: what a step does is in the trainer's own step function (`rl_step`, `dpo_step`,
`sft_step`), readable without this file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from actloop.config import Config, ConfigError, load_config
from actloop.data.mix import per_source_metrics
from actloop.models import Models
from actloop.monitor.metrics import JsonlSink, mean, std
from actloop.monitor.monitor import Monitor
from actloop.rewards.judge import judge_usage
from actloop.sandbox import clock as sandbox_clock
from actloop.tasks import LoadedTask
from actloop.train.runtime import checkpoint, rundir
from actloop.train.runtime.distributed import Dist
from actloop.train.runtime.evaluate import component_means, eval_line, evaluate
from actloop.train.runtime.failures import (FailureGuard, FailureLog, RunAborted, classify, count_kinds, failure_metrics,
                                    masked_line, tool_line)
from actloop.train.runtime.interrupt import GracefulStop
from actloop.train.runtime.memory import PhasePeaks, frozen_gc, set_mmap_threshold
from actloop.train.numerics.optim import drop_state
from actloop.types import Scored


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any]


@dataclass
class StepResult:
    """What one online step hands the bookkeeping (`rl_step`'s result)."""

    scored: list[Scored]  # the batch trained on
    seen: list[Scored]  # every scored trajectory of the step, dropped groups included (their failures count)
    dropped: int  # groups dropped by dynamic sampling
    scoring_s: float  # seconds of the rollout phase spent scoring
    update: dict[str, Any]  # the update's metrics
    extra: dict[str, Any] = field(default_factory=dict)  # the producer's staleness and waits (rollout.max_staleness)


def setup_process(cfg: Config) -> None:
    """What every trainer sets first: seeds, torch threads, glibc's mmap threshold."""
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    set_mmap_threshold(cfg.train.mmap_threshold_mb)


def make_run_dir(cfg: Config) -> Path:
    """A new run directory, locked for this process (`actloop.train.runtime.rundir`): a name already used
    is refused unless `cfg.overwrite`, and one another live run holds is always refused."""
    name = cfg.run_name or datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = rundir.prepare_new(Path(cfg.output_dir) / name, cfg.overwrite)
    (run_dir / "config.yaml").write_text(dataclasses.replace(cfg, overwrite=False).to_yaml())
    return run_dir


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


def write_problems(run_dir: Path, label: str, res: dict[str, Any]) -> dict[str, Any]:
    """Move a held-out evaluation's per-problem records (`evaluate(..., keep_problems=True)`) to
    RUN_DIR/<label>.jsonl, one line a problem (id, source, correct, samples, rewards), and return
    the rest for summary.json: `actloop compare` pairs the problems across runs for its tests."""
    problems = res.pop("problems", [])
    (run_dir / f"{label}.jsonl").write_text("".join(json.dumps(p) + "\n" for p in problems))
    return res


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
        "turns_per_episode": mean(len(t.turns) for t in trajs),  # assistant turns (environment steps)
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


def progress_bar(total: int, enabled: bool, label: str = "step",
                 fields: tuple[str, ...] = ("loss {task.fields[loss]:.4f}",)):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn(f"[bold]{label}"), MofNCompleteColumn(), BarColumn(),
                    *(TextColumn(f) for f in fields), TimeElapsedColumn(), TimeRemainingColumn(),
                    disable=not enabled)


_OPEN: list[Run] = []  # this process's runs whose engine is not closed yet (close_runs)


def close_runs() -> None:
    """Close every run of this process (`Run.close`): `train` does on its way out, also on an error."""
    for run in list(_OPEN):
        run.close()


class Run:
    """One run's bookkeeping (the module docstring lists it). `task` is the task the run trains
    or evaluates on; the trainer sets `models`, `renderer` and `engine` once it has loaded them."""

    def __init__(self, cfg: Config, task: LoadedTask, print_fn=print, dist: Dist | None = None):
        self.cfg, self.task, self.dist = cfg, task, dist if dist is not None else Dist()
        self.print = print_fn
        run_dir, ckpt = open_run(cfg, print_fn) if self.dist.is_main else (self.dist.scratch_dir(), None)
        self.run_dir: Path = run_dir
        self.ckpt_dir = self.dist.broadcast_object(run_dir)  # sharded checkpoints: every rank writes into rank 0's
        self.ckpt: checkpoint.Checkpoint | None = self.dist.broadcast_object(ckpt)  # the one a resume starts from
        if self.ckpt is not None and self.ckpt.sharded != self.dist.active:
            raise ConfigError(f"cannot resume {self.ckpt.path}: it was written " + (
                "under torchrun (sharded); resume it under torchrun with as many processes" if self.ckpt.sharded else
                "by one process; resume it without torchrun"))
        print_fn(f"run directory: {run_dir}")
        for note in task.info.get("notes", []):  # e.g. how many custom rows are held out for evaluation
            print_fn(note)
        self.models: Models | None = None
        self.renderer: Any = None
        self.engine: Any = None
        _OPEN.append(self)  # from here on it has an engine slot: close_runs closes what the trainer puts there
        self.sync_before_eval = False  # offline trainers: the engine gets the weights only to evaluate
        self.summary: dict[str, Any] = {"task": task.name, "model": cfg.model}
        # what the summary is computed from, kept across a resume
        self.totals: dict[str, Any] = {"step_seconds": [], "gen_tokens": 0, "gen_seconds": 0.0, "failures": {},
                                       "reward_errors": 0, "checkpoint_seconds": 0.0, "unmasked_steps": 0}
        self.trained_tokens = 0  # loss tokens of the offline trainers' batches (their throughput figure)
        self.peaks = PhasePeaks(trim=cfg.train.malloc_trim)  # peak RSS per phase: metrics peak_mem_mb/<phase>
        self.guard = FailureGuard(cfg.failures)
        self.online = False  # the RL loop's logs (monitor, failures.jsonl), set by open_logs
        self.monitor: Monitor | None = None
        self.sink: JsonlSink | None = None
        self.failure_log: FailureLog | None = None
        self.stateful: dict[str, Any] = {}  # components whose state_dict() rides in the checkpoint's `extra`
        self.state: dict[str, Any] | None = None  # the resumed checkpoint's state, until the loop starts
        self.start, self.last = 1, 0
        self.stop: GracefulStop | None = None
        self.stop_msg: str | None = None  # why the run stops (failure guard, disk full)
        self.requested: str | None = None  # the signal that asked it to stop
        self._clock: dict[str, float] = {}

    # ---------------------------------------------------------------------------- timing

    @contextlib.contextmanager
    def timed(self, name: str):
        """Seconds of a part of the step: `self.seconds(name)` once it ended."""
        t = time.time()
        try:
            yield
        finally:
            self._clock[name], self._clock[name + ":end"] = time.time() - t, time.time()

    @contextlib.contextmanager
    def phase(self, name: str):
        """A phase of the step: its seconds and its peak memory (peak_mem_mb/<name>)."""
        with self.peaks(name), self.timed(name):
            yield

    def seconds(self, name: str) -> float:
        return self._clock[name]

    # ------------------------------------------------------------------ metrics, evaluation

    def open_logs(self, online: bool, stateful: dict[str, Any] | None = None) -> None:
        """metrics.jsonl: through the monitor (samples, alarms, costs, TensorBoard/W&B) and with
        failures.jsonl for the RL loop; a plain sink for the offline trainers. A resumed run's
        `stateful` components (the monitor's and the producer's state) continue from the checkpoint."""
        self.online = online
        if not online:
            self.sink = JsonlSink(self.run_dir / "metrics.jsonl")
            return
        self.monitor = Monitor(self.dist.main_only(self.cfg), self.run_dir, self.print)
        self.failure_log = FailureLog(self.run_dir / "failures.jsonl")
        self.stateful = {"monitor": self.monitor, **(stateful or {})}
        if self.state is not None:
            for name, obj in self.stateful.items():
                if name in self.state.get("extra", {}) and hasattr(obj, "load_state_dict"):
                    obj.load_state_dict(self.state["extra"][name])

    def log(self, record: dict[str, Any], seconds: float) -> None:
        """An offline step's line in metrics.jsonl."""
        self.sink.log(record)
        self.totals["step_seconds"].append(seconds)
        self.last = int(record["step"])
        self.trained_tokens += int(record.get("tokens", 0))

    def evaluate(self, label: str, rows: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
        """Greedy success on the held-out rows (`rows`: a periodic evaluation's share, not written
        to RUN_DIR/<label>.jsonl). eval_before / eval_after only when enabled."""
        enabled = {"eval_before": self.cfg.train.eval_before, "eval_after": self.cfg.train.eval_after}.get(label, True)
        if not enabled or not self.task.eval_rows:
            return None
        if not self.dist.is_main:  # rank 0 evaluates; the others wait for it at the next collective
            return None
        if self.sync_before_eval:
            self.engine.sync_weights(self.models.policy)
        r = self.cfg.rollout
        with self.peaks("eval"):
            res = evaluate(self.engine, self.renderer, self.task, rows if rows is not None else self.task.eval_rows,
                           r.max_new_tokens, r.max_turns, max_context=r.max_context, schedule=r.schedule,
                           max_batch=r.max_batch, keep_problems=rows is None)
        if rows is None:
            self.summary[label] = write_problems(self.run_dir, label, res)
        self.print(eval_line(label, res))
        return res

    # ------------------------------------------------------------------------- the RL loop

    def restore(self, learner: Any) -> int:
        """Resume: the learner's checkpointed state (optimizer, scheduler, sampler, ...), the run's
        totals, summary and failure guard; the jsonl files cut back to the checkpoint's step.
        Returns the first step to run."""
        ckpt, dist = self.ckpt, self.dist
        if ckpt is None:
            return self.start
        if dist.active:  # every rank: its shards of the policy and AdamW state, its own RNGs
            state = checkpoint.load_sharded(ckpt, dist, learner.models.policy, learner.optimizer)
            dist.sync_engine(learner.engine, learner.models.policy)
        else:
            state = ckpt.load_state()
            learner.optimizer.load_state_dict(state["optimizer"])
        learner.load_state_dict(state)
        self.guard.load_state_dict(state["failure_guard"])
        self.summary, self.totals = state["summary"], state["totals"]
        self.summary["steps"] = self.cfg.train.steps
        self.start, self.last = ckpt.step + 1, ckpt.step
        for name in ("metrics.jsonl", "failures.jsonl", "samples.jsonl", "alarms.jsonl", "groups.jsonl"):
            checkpoint.truncate_jsonl(self.run_dir / name, ckpt.step)  # a killed step may have left a line (or half)
        self.print(f"resuming from {ckpt.path} (step {ckpt.step} of {self.cfg.train.steps})")
        self.state = state
        return self.start

    @contextlib.contextmanager
    def loop(self, progress: bool, ahead: Any = None) -> Iterator[range]:
        """The steps still to run, inside what spans the loop: Ctrl-C/SIGTERM handling, the progress
        bar, a frozen GC, the producer that samples ahead (rollout.max_staleness)."""
        if self.state is not None:  # last: the generators continue exactly where the checkpoint left them
            checkpoint.set_rng_state(self.state["rng"])
            self.state = None
        steps = self.cfg.train.steps
        self.bar = progress_bar(steps, progress, fields=("reward {task.fields[reward]:.3f}",
                                                         "success {task.fields[success]:.1%}"))
        with (GracefulStop(self.print, self.cfg.checkpoint.on_interrupt) as self.stop, self.bar,
              frozen_gc(),  # setup's objects: no GC walks
              ahead or contextlib.nullcontext()):  # the producer samples from here to the loop's end
            self.bar_task = self.bar.add_task("train", total=steps, completed=self.start - 1, reward=0.0, success=0.0)
            yield range(self.start, steps + 1)

    def begin_step(self) -> None:
        """The counters a step's metrics are differences of."""
        self._t0, self._clock = time.time(), {}
        self._tok0, self._usage0 = self.engine.generated_tokens, _usage(self.task)
        self._errors0 = len(self.task.rubric.errors)

    def end_step(self, step: int, out: StepResult, learner: Any) -> bool:
        """Metrics, failures, the periodic evaluation, signals and the checkpoint of a finished
        step. True: the run stops here (failure guard, disk full, a signal)."""
        cfg, dist, totals, task = self.cfg, self.dist, self.totals, self.task
        t0, t3 = self._t0, time.time()
        t2 = self._clock["rollout:end"]
        t1 = t2 - out.scoring_s  # rollout time excludes scoring
        failures = classify(step, out.seen, task.rubric.errors[self._errors0:])
        totals["reward_errors"] += len(task.rubric.errors) - self._errors0
        new_tokens = self.engine.generated_tokens - self._tok0
        totals["gen_tokens"] += new_tokens
        totals["gen_seconds"] += t1 - t0
        record = step_metrics(step, dist.gather_lists(out.scored), cfg.train.group_size)  # all ranks' groups
        record.update(out.update)
        record["dropped_groups"] = out.dropped
        record.update(out.extra)  # staleness, waits (rollout.max_staleness)
        record.update(failure_metrics(failures, len(out.seen), cfg.failures))
        record.update(usage_delta(self._usage0, _usage(task)))
        record.update(
            lr=learner.scheduler.get_last_lr()[0],
            rollout_s=round(t1 - t0, 3),
            scoring_s=round(t2 - t1, 3),
            update_s=round(t3 - t2, 3),
            sync_s=round(self.seconds("sync"), 3),  # new weights into the engine (part of update_s)
            step_s=round(t3 - t0, 3),
            gen_tokens_per_s=round(new_tokens / max(t1 - t0, 1e-9), 1),
        )
        if cfg.train.eval_every and step % cfg.train.eval_every == 0:
            # greedy (no random numbers drawn), so a resumed run stays identical
            res = self.evaluate(f"eval at step {step}", task.eval_rows[: cfg.train.eval_every_rows or None])
            if res is not None:
                record.update(eval_metrics(res))
        record.update(self.peaks.step_metrics())  # this step's phases (a checkpoint's lands in the next step)
        self.monitor.log_step(record, out.scored)
        self.failure_log.write(failures)
        for f in failures:
            totals["failures"][f.kind] = totals["failures"].get(f.kind, 0) + 1
        for line in (masked_line(step, failures, len(out.seen), self.failure_log.path),
                     tool_line(step, failures, len(out.seen), self.failure_log.path)):
            if line is not None:
                self.print(line)
        if any(not s.masked for s in out.scored):  # a step that had something to train on (ties included)
            totals["unmasked_steps"] = totals.get("unmasked_steps", 1) + 1  # missing: an older checkpoint
        self.stop_msg = dist.first(self.guard.check(step, failures, len(out.seen), self.run_dir))  # all stop together
        totals["step_seconds"].append(t3 - t0)
        self.last = step
        self.bar.update(self.bar_task, advance=1, reward=record["reward_mean"], success=record["success"])
        # read once: a signal landing after this read is handled at the next step's end (never a
        # stop without a checkpoint); every rank stops at the same step (torchrun signals each rank)
        self.requested = dist.first(self.stop.requested)
        every = cfg.checkpoint.every
        if ((every and step % every == 0) or self.stop_msg or self.requested
                or (step == cfg.train.steps and cfg.checkpoint.at_end)):
            full = self.save_checkpoint(step, learner)  # a disk full stops the run here
            if full:
                self.stop_msg = full
            else:
                totals["checkpoint_step"] = step
        return bool(self.stop_msg or self.requested)

    def save_checkpoint(self, step: int, learner: Any) -> str | None:
        """Write checkpoint `step`: the learner's state and the run's; None, or why it could not be
        written (the run then stops: the previous checkpoint is intact)."""
        t = time.time()
        state = {
            **learner.state_dict(), "rng": checkpoint.rng_state(), "summary": self.summary, "totals": self.totals,
            "failure_guard": self.guard.state_dict(),
            "extra": {n: o.state_dict() for n, o in self.stateful.items() if hasattr(o, "state_dict")},
        }
        policy, optimizer, keep = learner.models.policy, learner.optimizer, self.cfg.checkpoint.keep
        try:
            with self.peaks("checkpoint"):
                if self.dist.active:  # sharded policy and AdamW state: torch.distributed.checkpoint, every rank
                    checkpoint.save_sharded(self.ckpt_dir, step, self.dist, policy, optimizer, state, keep=keep)
                else:
                    checkpoint.save(self.run_dir, step, policy, {"optimizer": optimizer.state_dict(), **state},
                                    keep=keep)
        except checkpoint.CheckpointError as e:
            return str(e)
        self.totals["checkpoint_seconds"] += time.time() - t
        return None

    # ------------------------------------------------------------------------------ the end

    def close(self) -> None:
        """The engine goes with the run: its decode thread, its vLLM engine or Ray actors, and the
        model copy they hold. Without it a process that trains again (a notebook, a sweep, the test
        suite) kept every finished run's engine and model: five SmolLM2 copies after one test module."""
        if self in _OPEN:
            _OPEN.remove(self)
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()

    def finish(self, optimizer: torch.optim.Optimizer | None,
               save_model: Callable[[Path], None] | None = None) -> RunResult:
        """Close the logs, write summary.json, evaluate (eval_after) and save final/ (`save_model`
        writes the model into a directory; installed as RUN_DIR/final once complete). A run stopped
        by the failure guard or a full disk raises RunAborted once its summary is written."""
        cfg, dist, summary, totals = self.cfg, self.dist, self.summary, self.totals
        for log in (self.monitor, self.sink, self.failure_log):
            if log is not None:
                log.close()
        if self.monitor is not None:
            summary["monitor"] = self.monitor.summary()
        summary["seconds_per_step"] = round(mean(totals["step_seconds"]), 2)
        if self.online:
            summary["generated_tokens_per_s"] = (round(totals["gen_tokens"] / totals["gen_seconds"], 1)
                                                 if totals["gen_seconds"] else 0.0)
            summary["failures"] = dict(totals["failures"])
            summary["checkpoint_seconds"] = round(totals["checkpoint_seconds"], 2)
            summary["peak_mem_mb"] = dict(self.peaks.run)  # this process's peak RSS per phase (MiB)
            if totals["reward_errors"]:
                summary["reward_errors"] = totals["reward_errors"]
            self._check_trained()
        if self.trained_tokens:  # offline: no generation to report, the data trained on instead
            summary["trained_tokens_per_s"] = round(self.trained_tokens / max(sum(totals["step_seconds"]), 1e-9), 1)
        last = self.last
        summary["steps"] = max(last, 0)  # completed (a stopped run: fewer than train.steps)
        if self.online and last < cfg.train.steps:
            summary["steps_planned"] = cfg.train.steps
        else:
            summary.pop("steps_planned", None)
        if self.stop_msg or self.requested:
            summary["stopped"] = {"step": last, "reason": self.stop_msg or self.requested}
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            if self.stop_msg:
                raise RunAborted(self.stop_msg)
            self.print(f"stopped after step {last} ({self.requested}); continue with `actloop train "
                       f"resume={self.run_dir}`")
            return RunResult(self.run_dir, summary)
        summary.pop("stopped", None)
        if self.online:
            self._say_how_it_ended()
        if optimizer is not None:
            drop_state(optimizer)  # no step follows (the at-end checkpoint is written): AdamW's moments go
        self.evaluate("eval_after")
        if cfg.train.save_final and save_model is not None:
            final, tmp = self.run_dir / "final", self.run_dir / f"final.tmp-{os.getpid()}"
            save_model(tmp)  # FSDP: gathered on every rank, written by rank 0
            if dist.is_main:
                checkpoint.install(tmp, final)  # an earlier final/ is deleted only once the new one is in place
            summary["final_dir"] = str(final)
        if self.online and not dist.active and (cfg.train.save_final or totals.get("checkpoint_step") == last):
            for path in checkpoint.drop_outrun(self.run_dir, last, cfg.checkpoint.every):  # what a stop wrote
                self.print(f"removed {path} (written when the run was stopped; the run has finished)")
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        run_dir = dist.broadcast_object(self.run_dir)  # every rank reports rank 0's run directory
        dist.close()
        return RunResult(run_dir, summary)

    def _check_trained(self) -> None:
        """failures.nothing_trained=error: a run none of whose steps trained anything stops with why."""
        totals, last = self.totals, self.last
        trained_somewhere = self.dist.first(True if totals.get("unmasked_steps", 1) else None)  # any rank, any step
        if (not self.stop_msg and not self.requested and last >= self.start and not trained_somewhere
                and self.cfg.failures.nothing_trained == "error"):
            kinds = count_kinds(totals["failures"])
            self.stop_msg = (f"no step trained anything: every trajectory of steps 1-{last} was masked ({kinds}). "
                             f"Tracebacks are in {self.run_dir / 'failures.jsonl'}; failures.nothing_trained=ignore "
                             "finishes anyway.")

    def _say_how_it_ended(self) -> None:
        cfg, last = self.cfg, self.last
        if self.start > cfg.train.steps:
            self.print(f"the run already reached step {cfg.train.steps}; extend it with train.steps=N")
        if last >= self.start and self.totals.get("checkpoint_step") != last and not self.dist.active:
            self.print(f"no checkpoint of the last step {last} (checkpoint.at_end=false)"
                       + ("; final/ holds the trained model" if cfg.train.save_final else "")
                       + "; to extend a run later with resume=, train it with checkpoint.at_end=true")
