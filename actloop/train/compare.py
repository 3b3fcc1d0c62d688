"""`actloop compare`: PPO, DPO and GRPO (or any of the trainers) on one task and one budget.

Every algorithm runs as its own child process, `python -m actloop train algo=... run_name=...`,
with the same steps, prompts per step, group size, seed and held-out set, so that

  * peak memory is that algorithm's own: the child's peak resident set size (`ru_maxrss` from
    `os.wait4` on that child — per child, not the maximum over all children that
    `getrusage(RUSAGE_CHILDREN)` would give);
  * one algorithm that fails (not wired yet, out of memory, a bug) becomes a row with its error,
    and the comparison goes on.

Then it reads each run's metrics.jsonl and summary.json, prints a markdown table, and writes
OUTPUT_DIR/compare.md, compare.json and compare.png (reward curves per algorithm and held-out
success before/after). docs/compare.md says how to read it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

import typer

from actloop.algos.algorithms import compare_variants
from actloop.monitor.metrics import mean, std

# What each name in --algos runs: the overrides that select it, from the one table of algorithms.
# `dpo` is online DPO (pairs from each step's rollout groups), the variant that spends the same
# rollout budget as GRPO and PPO; `dpo_offline` trains on fixed pairs.
ALGORITHMS: dict[str, list[str]] = compare_variants()


@dataclass
class AlgoResult:
    """One row of the comparison. None = not measured (failed run, or no such metric)."""

    algo: str
    ok: bool
    error: str | None = None
    run_dir: str | None = None
    wall_s: float | None = None
    peak_mem_mib: float | None = None
    seconds_per_step: float | None = None
    steps: int = 0
    reward_first: float | None = None
    reward_last: float | None = None
    reward_gain: float | None = None
    success_before: float | None = None
    success_after: float | None = None
    kl_std: float | None = None
    kl_last: float | None = None
    grad_norm_std: float | None = None
    grad_norm_mean: float | None = None
    rewards: list[float] = field(default_factory=list)


def peak_rss_mib(ru_maxrss: int) -> float:
    """ru_maxrss is KiB on Linux, bytes on macOS."""
    return ru_maxrss / (1024 * 1024) if sys.platform == "darwin" else ru_maxrss / 1024


def run_child(cmd: list[str], log_path: Path, timeout_s: float | None = None, cwd: str | None = None
              ) -> tuple[int, float, float]:
    """Run one command with its output in `log_path`; return (exit code, wall seconds, peak RSS MiB
    of that child alone)."""
    t0 = time.time()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, stdin=subprocess.DEVNULL,
                                env=_child_env())
        timer = threading.Timer(timeout_s, proc.kill) if timeout_s else None
        if timer:
            timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            if timer:
                timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen.wait
    return proc.returncode, time.time() - t0, peak_rss_mib(usage.ru_maxrss)


def _child_env() -> dict[str, str]:
    """The child imports this very actloop, installed or not."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


def _error_line(log_path: Path) -> str:
    lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    interesting = [ln for ln in lines if "error" in ln.lower() or "exception" in ln.lower()]
    return (interesting or lines or ["(no output)"])[-1][:300]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _finite(xs) -> list[float]:
    return [float(x) for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]


def summarize_run(algo: str, run_dir: Path, window: int) -> AlgoResult:
    """A finished run directory -> its row (peak memory and wall time are filled by the caller)."""
    metrics = _read_jsonl(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    res = AlgoResult(algo=algo, ok=True, run_dir=str(run_dir), seconds_per_step=summary.get("seconds_per_step"),
                     steps=len(metrics))
    rewards = _finite(r.get("reward_mean") for r in metrics)
    if rewards:
        k = max(1, min(window, len(rewards)))
        res.rewards = rewards
        res.reward_first, res.reward_last = mean(rewards[:k]), mean(rewards[-k:])
        res.reward_gain = res.reward_last - res.reward_first
    kl = _finite(r.get("kl") for r in metrics)
    if kl and any(v != 0 for v in kl):  # GRPO with train.beta=0 computes no KL: not measured
        res.kl_std, res.kl_last = std(kl), kl[-1]
    gn = _finite(r.get("grad_norm") for r in metrics)
    if gn:
        res.grad_norm_std, res.grad_norm_mean = std(gn), mean(gn)
    for key, attr in (("eval_before", "success_before"), ("eval_after", "success_after")):
        if isinstance(summary.get(key), dict):
            setattr(res, attr, summary[key].get("success"))
    return res


def _fmt(x: float | None, spec: str = ".3f", suffix: str = "") -> str:
    return "—" if x is None else f"{x:{spec}}{suffix}"


def markdown_table(rows: list[AlgoResult]) -> str:
    head = ["algo", "peak mem (MiB)", "s / step", "reward first→last (gain)", "held-out success before→after",
            "KL std", "grad-norm std (mean)", "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for r in rows:
        if r.ok:
            reward = "—" if r.reward_gain is None else \
                f"{r.reward_first:.3f} → {r.reward_last:.3f} ({r.reward_gain:+.3f})"
            succ = "—" if r.success_before is None and r.success_after is None else \
                f"{_fmt(r.success_before, '.1%')} → {_fmt(r.success_after, '.1%')}"
            gn = "—" if r.grad_norm_std is None else f"{r.grad_norm_std:.3f} ({r.grad_norm_mean:.2f})"
            status = f"ok, {r.steps} steps"
        else:
            reward = succ = gn = "—"
            status = "FAILED: " + (r.error or "").replace("|", "\\|")
        lines.append("| " + " | ".join([r.algo, _fmt(r.peak_mem_mib, ".0f"), _fmt(r.seconds_per_step, ".1f"), reward,
                                         succ, _fmt(r.kl_std, ".4f"), gn, status]) + " |")
    return "\n".join(lines)


def plot(rows: list[AlgoResult], path: Path) -> bool:
    """Reward per step for each algorithm, and held-out success before/after as bars. Returns
    False (and draws nothing) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in rows:
        if r.rewards:
            ax1.plot(range(1, len(r.rewards) + 1), r.rewards, marker="o", label=r.algo)
    ax1.set_xlabel("step")
    ax1.set_ylabel("mean rollout reward")
    ax1.set_title("training reward")
    if any(r.rewards for r in rows):
        ax1.legend()
    names = [r.algo for r in rows]
    xs = list(range(len(rows)))
    before = [r.success_before or 0.0 for r in rows]
    after = [r.success_after or 0.0 for r in rows]
    ax2.bar([x - 0.2 for x in xs], before, width=0.4, label="before")
    ax2.bar([x + 0.2 for x in xs], after, width=0.4, label="after")
    for x, r in zip(xs, rows):
        if not r.ok:
            ax2.text(x, 0.02, "failed", ha="center", color="red")
    ax2.set_xticks(xs)
    ax2.set_xticklabels(names)
    ax2.set_ylim(0, 1)
    ax2.set_ylabel("greedy success")
    ax2.set_title("held-out success")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _split_overrides(overrides: list[str], algos: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """`key=value` applies to every algorithm; `algo:key=value` to that one only."""
    common: list[str] = []
    per: dict[str, list[str]] = {a: [] for a in algos}
    for o in overrides:
        head, _, rest = o.partition(":")
        if rest and "=" in rest and "=" not in head and head in per:
            per[head].append(rest)
        else:
            common.append(o)
    return common, per


@dataclass
class CompareResult:
    output_dir: Path
    rows: list[AlgoResult]
    table: str
    png: Path | None


def run_compare(algos: list[str], steps: int = 6, eval_size: int = 30, output_dir: str | Path | None = None,
                overrides: list[str] | tuple[str, ...] = (), prompts_per_step: int | None = None,
                group_size: int | None = None, seed: int = 0, threads: int = 0, window: int = 0,
                timeout_s: float | None = None, reuse: bool = False, print_fn=print) -> CompareResult:
    """Run each algorithm in its own process on the same budget; return the rows and the table.
    reuse=True keeps the finished runs of an earlier call into the same output_dir (with the same
    settings: that is the caller's promise) and reruns only the ones that failed or are new."""
    out = Path(output_dir or Path("runs") / f"compare-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    budget = [f"train.steps={steps}", f"data.eval_size={eval_size}", f"seed={seed}"]
    if prompts_per_step is not None:
        budget.append(f"train.prompts_per_step={prompts_per_step}")
    if group_size is not None:
        budget.append(f"train.group_size={group_size}")
    if threads:
        budget.append(f"train.threads={threads}")
    common, per = _split_overrides(list(overrides), algos)
    window = window or max(1, steps // 3)
    rows: list[AlgoResult] = []
    for algo in algos:
        if algo not in ALGORITHMS:
            rows.append(AlgoResult(algo, ok=False, error=f"unknown algorithm (known: {', '.join(ALGORITHMS)})"))
            continue
        cmd = [sys.executable, "-m", "actloop", "train", *ALGORITHMS[algo], *budget, *common, *per[algo],
               f"output_dir={out}", f"run_name={algo}", "--no-progress"]
        print_fn(f"[{algo}] {' '.join(cmd[2:])}")
        log, record = out / f"{algo}.log", out / f"{algo}.result.json"
        run_dir = out / algo
        if reuse and record.exists() and json.loads(record.read_text()).get("ok"):
            row = summarize_run(algo, run_dir, window)
            kept = json.loads(record.read_text())
            row.wall_s, row.peak_mem_mib = kept["wall_s"], kept["peak_mem_mib"]
            rows.append(row)
            print_fn(f"[{algo}] reusing the finished run in {run_dir}")
            continue
        if run_dir.exists():  # metrics.jsonl is appended to: start from a clean directory
            shutil.rmtree(run_dir)
        code, wall, peak = run_child(cmd, log, timeout_s)
        if code == 0 and (run_dir / "summary.json").exists():
            try:
                row = summarize_run(algo, run_dir, window)
            except Exception as e:  # a run that finished but wrote something unreadable
                row = AlgoResult(algo, ok=False, error=f"cannot read results: {e}", run_dir=str(run_dir))
        else:
            if timeout_s and wall >= timeout_s:
                why = f"timed out after {timeout_s:.0f}s"
            elif code < 0:
                why = f"killed by signal {signal.Signals(-code).name}"
            else:
                why = f"exit code {code}"
            row = AlgoResult(algo, ok=False, error=f"{why}; last output: {_error_line(log)} (log: {log})",
                             run_dir=str(run_dir))
        row.wall_s, row.peak_mem_mib = round(wall, 1), round(peak, 1)
        record.write_text(json.dumps({"ok": row.ok, "wall_s": row.wall_s, "peak_mem_mib": row.peak_mem_mib}))
        rows.append(row)
        print_fn(f"[{algo}] {'ok' if row.ok else 'FAILED'} in {wall:.0f}s, peak memory {peak:.0f} MiB"
                 + ("" if row.ok else f": {row.error}"))
    table = markdown_table(rows)
    png = out / "compare.png"
    if not plot(rows, png):
        png = None
        print_fn("matplotlib is not installed: no compare.png (pip install matplotlib)")
    header = (f"steps={steps}, eval_size={eval_size}, seed={seed}, reward window k={window}"
              + (f", prompts_per_step={prompts_per_step}" if prompts_per_step else "")
              + (f", group_size={group_size}" if group_size else "")
              + (f", overrides: {' '.join(overrides)}" if overrides else ""))
    (out / "compare.md").write_text(f"{header}\n\n{table}\n")
    (out / "compare.json").write_text(json.dumps({"settings": header, "rows": [asdict(r) for r in rows]}, indent=2))
    return CompareResult(out, rows, table, png)


def compare(
    algos: str = typer.Option("grpo,ppo,dpo", "--algos", help=f"Comma-separated, from: {', '.join(ALGORITHMS)}."),
    steps: int = typer.Option(6, "--steps", help="Training steps, the same for every algorithm."),
    eval_size: int = typer.Option(30, "--eval-size", help="Held-out problems evaluated greedily before and after."),
    output_dir: Optional[str] = typer.Option(None, "--output-dir", help="Where runs and the table go "
                                             "(default runs/compare-<timestamp>)."),
    prompts_per_step: Optional[int] = typer.Option(None, "--prompts-per-step", help="Default: the config's."),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="Default: the config's."),
    seed: int = typer.Option(0, "--seed"),
    threads: int = typer.Option(0, "--threads", help="torch threads per run (0 = torch's default; 1 is much "
                                "faster on a CPU other jobs are using)."),
    window: int = typer.Option(0, "--window", help="k for the reward gain: mean of the last k steps minus the "
                               "first k (0 = steps // 3)."),
    timeout: float = typer.Option(0, "--timeout", help="Seconds before one algorithm's run is killed (0 = none)."),
    reuse: bool = typer.Option(False, "--reuse", help="In an existing --output-dir, keep the runs that finished "
                               "and rerun only the failed or new algorithms (same settings assumed)."),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="key=value for every run, or algo:key=value for "
                                             "one (repeatable), e.g. --set train.beta=0.04 --set dpo:dpo.beta=0.2."),
) -> None:
    """Compare algorithms (default PPO, DPO, GRPO) on the calculator task at the same budget, each in
    its own process: peak memory, seconds per step, reward gain, held-out success, stability."""
    names = [a.strip() for a in algos.split(",") if a.strip()]
    res = run_compare(names, steps=steps, eval_size=eval_size, output_dir=output_dir, overrides=list(set_ or []),
                      prompts_per_step=prompts_per_step, group_size=group_size, seed=seed, threads=threads,
                      window=window, timeout_s=timeout or None, reuse=reuse)
    print()
    print(res.table)
    print()
    print(f"table: {res.output_dir / 'compare.md'}" + (f", plot: {res.png}" if res.png else ""))
    if not any(r.ok for r in res.rows):
        raise typer.Exit(1)
