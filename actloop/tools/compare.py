"""`actloop compare`: the trainers on one task and one budget, over several seeds, with tests of
which differences are significant.

Every (algorithm, seed) runs as its own child process, `python -m actloop train algo=...
seed=S run_name=<algo>-s<S>`, with the same steps, prompts per step, group size and held-out set
for every algorithm of a seed, so that

  * peak memory is that run's own: the largest per-phase peak RSS it measured (summary.json
    `peak_mem_mb`) or the child's `ru_maxrss` from `os.wait4` on that child (per child, not the
    maximum over all children that `getrusage(RUSAGE_CHILDREN)` would give), whichever is larger
    (`peak_memory`), also when `--parallel` runs several at once;
  * one run that fails (not wired yet, out of memory, a bug) becomes a row with its error, and
    the comparison goes on: the other seeds of that algorithm still aggregate.

Greedy held-out success before training depends only on the model and the held-out rows, which
the seed chooses (the same for every algorithm of a seed): the first child of each seed measures
it, the others run with `train.eval_before=false`.

Then it reads each run's metrics.jsonl, summary.json and eval_after.jsonl (per-problem outcomes),
aggregates mean and standard deviation over seeds per algorithm, tests every pair of algorithms
(McNemar's exact test on the pooled per-problem outcomes, Welch's t-test on the per-seed success
rates, Holm's correction over the pairs: `actloop.monitor.stats`), and writes OUTPUT_DIR/compare.md,
compare.json and compare.png. docs/compare.md says how to read them.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime
from itertools import combinations
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import typer

from actloop.algos.algorithms import compare_variants
from actloop.monitor.metrics import mean, std
from actloop.monitor.stats import holm, sign_test_p, welch_t_test

# What each name in --algos runs: the overrides that select it, from the one table of algorithms.
# `dpo` is online DPO (pairs from each step's rollout groups), the variant that spends the same
# rollout budget as GRPO and PPO; `dpo_offline` trains on fixed pairs; `dr_grpo` is GRPO without
# the std scaling and with a constant loss normaliser.
ALGORITHMS: dict[str, list[str]] = compare_variants()
TRAIN_CMD = (sys.executable, "-m", "actloop", "train")
ALPHA = 0.05  # the family-wise level of the pairwise tests


@dataclass
class AlgoResult:
    """One run: one algorithm, one seed. None = not measured (failed run, or no such metric)."""

    algo: str
    ok: bool
    seed: int = 0
    error: str | None = None
    run_dir: str | None = None
    wall_s: float | None = None
    peak_mem_mib: float | None = None
    run_peak_mem_mib: float | None = None  # the largest per-phase peak the run itself measured
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
    problems_after: dict[str, bool] = field(default_factory=dict)  # held-out problem -> greedy success


@dataclass(frozen=True)
class MeanStd:
    """Mean and sample standard deviation of n per-seed values (std 0 when n = 1)."""

    mean: float
    std: float
    n: int


def mean_std(xs: Sequence[float | None]) -> MeanStd | None:
    vals = [float(x) for x in xs if x is not None]
    return MeanStd(mean(vals), std(vals), len(vals)) if vals else None


@dataclass
class AlgoSummary:
    """One row of the table: an algorithm's runs over seeds, aggregated over the ones that finished."""

    algo: str
    seeds: list[int]
    ok_seeds: list[int]
    failed: list[str]  # "seed S: error", one per failed run
    steps: int
    success_after: MeanStd | None
    reward_gain: MeanStd | None
    seconds_per_step: MeanStd | None
    peak_mem_mib: MeanStd | None
    kl_std: MeanStd | None
    grad_norm_std: MeanStd | None
    grad_norm_mean: MeanStd | None


def aggregate(rows: list[AlgoResult]) -> list[AlgoSummary]:
    """Per algorithm (in order of first appearance), mean and std over the seeds that finished."""
    out = []
    for algo in dict.fromkeys(r.algo for r in rows):
        runs = [r for r in rows if r.algo == algo]
        ok = [r for r in runs if r.ok]

        def ms(attr: str) -> MeanStd | None:
            return mean_std([getattr(r, attr) for r in ok])

        out.append(AlgoSummary(
            algo, [r.seed for r in runs], [r.seed for r in ok], [f"seed {r.seed}: {r.error}" for r in runs if not r.ok],
            max((r.steps for r in ok), default=0), ms("success_after"), ms("reward_gain"), ms("seconds_per_step"),
            ms("peak_mem_mib"), ms("kl_std"), ms("grad_norm_std"), ms("grad_norm_mean")))
    return out


def success_before(rows: list[AlgoResult]) -> dict[int, float]:
    """seed -> greedy held-out success before training, from the run of that seed that measured it."""
    out: dict[int, float] = {}
    for r in rows:
        if r.ok and r.success_before is not None:
            out.setdefault(r.seed, r.success_before)
    return out


def pairwise_tests(rows: list[AlgoResult]) -> list[dict[str, Any]]:
    """Every pair (A, B) of algorithms with a finished run: the difference of mean held-out success
    (A - B); McNemar's exact test on the (seed, problem) pairs, over the seeds both finished, that
    one of the two solved and the other did not; Welch's t-test on the per-seed success rates;
    each test's p-value Holm-adjusted over the pairs."""
    ok = [r for r in rows if r.ok and r.success_after is not None]
    algos = list(dict.fromkeys(r.algo for r in ok))
    tests = []
    for a, b in combinations(algos, 2):
        ra, rb = ({r.seed: r for r in ok if r.algo == x} for x in (a, b))
        seeds = sorted(ra.keys() & rb.keys())
        a_only = b_only = n_pairs = 0
        for s in seeds:
            pa, pb = ra[s].problems_after, rb[s].problems_after
            for pid in pa.keys() & pb.keys():
                n_pairs += 1
                a_only += pa[pid] and not pb[pid]
                b_only += pb[pid] and not pa[pid]
        xs, ys = [r.success_after for r in ra.values()], [r.success_after for r in rb.values()]
        welch = welch_t_test(xs, ys)
        tests.append({"a": a, "b": b, "diff": mean(xs) - mean(ys), "seeds": seeds, "pairs": n_pairs,
                      "a_only": a_only, "b_only": b_only,
                      "mcnemar_p": sign_test_p(a_only, b_only) if n_pairs else None,
                      "welch_t": (welch or {}).get("t"), "welch_df": (welch or {}).get("df"),
                      "welch_p": (welch or {}).get("p")})
    for key in ("mcnemar", "welch"):
        for t, adj in zip(tests, holm([t[f"{key}_p"] for t in tests])):
            t[f"{key}_holm"] = adj
    return tests


def peak_rss_mib(ru_maxrss: int) -> float:
    """ru_maxrss is KiB on Linux, bytes on macOS."""
    return ru_maxrss / (1024 * 1024) if sys.platform == "darwin" else ru_maxrss / 1024


# Runs one command and reports its exit status and peak RSS (status, ru_maxrss) into argv[1]. On
# Linux a child's ru_maxrss also counts the address space it was forked from (the kernel carries
# that high-water mark across exec): forked from this process, which holds torch, every child's
# peak would be at least this process's RSS. Forked from this ~10 MiB launcher, it is the child's
# own. SIGTERM (the timeout) kills the child; Ctrl-C reaches the child directly (same group).
_LAUNCHER = r"""
import os, signal, sys
out, cmd = sys.argv[1], sys.argv[2:]
pid = os.fork()
if pid == 0:
    try:
        os.execvp(cmd[0], cmd)
    except OSError as e:
        print(f"cannot run {cmd[0]}: {e}", file=sys.stderr, flush=True)
    os._exit(127)
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGKILL))
_, status, usage = os.wait4(pid, 0)
with open(out, "w") as f:
    f.write(f"{status} {usage.ru_maxrss}")
"""


def run_child(cmd: list[str], log_path: Path, timeout_s: float | None = None, cwd: str | None = None
              ) -> tuple[int, float, float]:
    """Run one command with its output in `log_path`; return (exit code, wall seconds, peak RSS MiB
    of that child alone: `os.wait4` on its pid, in the launcher above). Safe to call from several
    threads at once: each waits for its own pid."""
    t0 = time.time()
    report = log_path.with_name(log_path.name + ".rusage")
    report.unlink(missing_ok=True)
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-S", "-c", _LAUNCHER, str(report), *cmd], stdout=log,
                                stderr=subprocess.STDOUT, cwd=cwd, stdin=subprocess.DEVNULL, env=_child_env())
        timer = threading.Timer(timeout_s, proc.terminate) if timeout_s else None
        if timer:
            timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            if timer:
                timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen.wait
    if report.exists():  # the launcher ran the child to its end: its status and its own peak
        status_text, maxrss = report.read_text().split()
        report.unlink()
        return os.waitstatus_to_exitcode(int(status_text)), time.time() - t0, peak_rss_mib(int(maxrss))
    return proc.returncode, time.time() - t0, peak_rss_mib(usage.ru_maxrss)  # the launcher itself died


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


def summarize_run(algo: str, run_dir: Path, window: int, seed: int = 0) -> AlgoResult:
    """A finished run directory -> its row (peak memory and wall time are filled by the caller)."""
    metrics = _read_jsonl(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    res = AlgoResult(algo=algo, ok=True, seed=seed, run_dir=str(run_dir),
                     seconds_per_step=summary.get("seconds_per_step"), steps=len(metrics))
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
    res.problems_after = {f"{p.get('source', '')}/{p['id']}": bool(p["correct"])
                          for p in _read_jsonl(run_dir / "eval_after.jsonl")}
    phases = summary.get("peak_mem_mb")
    res.run_peak_mem_mib = max(phases.values()) if isinstance(phases, dict) and phases else None
    return res


def peak_memory(row: AlgoResult, ru_maxrss_mib: float) -> float:
    """The run's peak RSS: the largest of its own per-phase peaks (summary.json `peak_mem_mb`) and
    the child's `ru_maxrss`. The trainer resets the kernel's high-water mark at each phase
    (/proc/self/clear_refs, `actloop.train.runtime.memory`), and Linux reports that reset mark as
    ru_maxrss at exit: alone it would be the last phase's peak, not the run's."""
    return round(max(ru_maxrss_mib, row.run_peak_mem_mib or 0.0), 1)


def _fmt(x: float | None, spec: str = ".3f", suffix: str = "") -> str:
    return "—" if x is None else f"{x:{spec}}{suffix}"


def _fmt_ms(x: MeanStd | None, spec: str = ".3f", pct: bool = False) -> str:
    """`mean ± std` (the value alone for one seed); percentages as `57.3% ± 2.1` (std in points)."""
    if x is None:
        return "—"
    if pct:
        return f"{x.mean:.1%}" + (f" ± {100 * x.std:.1f}" if x.n > 1 else "")
    return f"{x.mean:{spec}}" + (f" ± {x.std:{spec.lstrip('+')}}" if x.n > 1 else "")


def markdown_table(rows: list[AlgoResult]) -> str:
    """One line per algorithm: mean ± std over the seeds that finished, and which failed."""
    head = ["algo", "seeds ok", "held-out success after", "reward gain", "s / step", "peak mem (MiB)", "KL std",
            "grad-norm std (mean)", "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for a in aggregate(rows):
        gn = "—" if a.grad_norm_std is None else f"{_fmt_ms(a.grad_norm_std)} ({a.grad_norm_mean.mean:.2f})"
        if a.ok_seeds:
            status = f"ok, {a.steps} steps" + ("" if not a.failed else "; FAILED " + "; ".join(a.failed))
        else:
            status = "FAILED: " + "; ".join(a.failed)
        lines.append("| " + " | ".join([
            a.algo, f"{len(a.ok_seeds)}/{len(a.seeds)}", _fmt_ms(a.success_after, pct=True),
            _fmt_ms(a.reward_gain, "+.3f"), _fmt_ms(a.seconds_per_step, ".1f"), _fmt_ms(a.peak_mem_mib, ".0f"),
            _fmt_ms(a.kl_std, ".4f"), gn, status.replace("|", "\\|")]) + " |")
    return "\n".join(lines)


def runs_table(rows: list[AlgoResult]) -> str:
    """One line per run (algorithm, seed): the numbers the means are taken over."""
    head = ["algo", "seed", "peak mem (MiB)", "s / step", "reward first→last (gain)",
            "held-out success before→after", "KL std", "grad-norm std (mean)", "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for r in rows:
        if r.ok:
            reward = "—" if r.reward_gain is None else \
                f"{r.reward_first:.3f} → {r.reward_last:.3f} ({r.reward_gain:+.3f})"
            succ = f"{_fmt(r.success_before, '.1%')} → {_fmt(r.success_after, '.1%')}"
            gn = "—" if r.grad_norm_std is None else f"{r.grad_norm_std:.3f} ({r.grad_norm_mean:.2f})"
            status = f"ok, {r.steps} steps"
        else:
            reward = succ = gn = "—"
            status = "FAILED: " + (r.error or "").replace("|", "\\|")
        lines.append("| " + " | ".join([r.algo, str(r.seed), _fmt(r.peak_mem_mib, ".0f"),
                                         _fmt(r.seconds_per_step, ".1f"), reward, succ, _fmt(r.kl_std, ".4f"), gn,
                                         status]) + " |")
    return "\n".join(lines)


def _fmt_p(p: float | None) -> str:
    return "—" if p is None else ("< 0.001" if p < 0.001 else f"{p:.3f}")


def _p_clause(p: float) -> str:
    """`= 0.043` or `< 0.001`, for "(p ...)" in a sentence."""
    text = _fmt_p(p)
    return text if text.startswith("<") else f"= {text}"


def tests_table(tests: list[dict[str, Any]]) -> str:
    """The pairwise tests, then one line naming the pairs that differ at ALPHA after Holm."""
    if not tests:
        return "(no pair of algorithms with finished runs to test)"
    head = ["A vs B", "Δ success (A − B)", "A only / B only (of pairs)", "McNemar p (Holm)", "Welch t (df)",
            "Welch p (Holm)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for t in tests:
        welch = "—" if t["welch_t"] is None else f"{t['welch_t']:+.2f} ({t['welch_df']:.1f})"
        lines.append("| " + " | ".join([
            f"{t['a']} vs {t['b']}", f"{100 * t['diff']:+.1f} pts", f"{t['a_only']} / {t['b_only']} (of {t['pairs']})",
            f"{_fmt_p(t['mcnemar_p'])} ({_fmt_p(t['mcnemar_holm'])})", welch,
            f"{_fmt_p(t['welch_p'])} ({_fmt_p(t['welch_holm'])})"]) + " |")
    lines.append("")
    for key, name in (("mcnemar", "McNemar (per problem, pooled over seeds)"), ("welch", "Welch (per-seed rates)")):
        sig = [t for t in tests if t[f"{key}_holm"] is not None and t[f"{key}_holm"] < ALPHA]
        said = ", ".join(f"{t['a']} {'>' if t['diff'] > 0 else '<' if t['diff'] < 0 else '≠'} {t['b']} "
                         f"(p {_p_clause(t[f'{key}_holm'])})" for t in sig) or "none"
        lines.append(f"Significant at p < {ALPHA} after Holm's correction over {len(tests)} pairs, {name}: {said}.  ")
    return "\n".join(lines)


def plot(rows: list[AlgoResult], path: Path) -> bool:
    """Left: mean rollout reward per step for each algorithm, with a ±std band over seeds. Right:
    held-out success after training (mean, std error bars over seeds) and the before line.
    Returns False (and draws nothing) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    summaries = aggregate(rows)
    for a in summaries:
        curves = [r.rewards for r in rows if r.algo == a.algo and r.ok and r.rewards]
        if not curves:
            continue
        per_step = [[c[i] for c in curves if len(c) > i] for i in range(max(map(len, curves)))]
        m, s = [mean(v) for v in per_step], [std(v) for v in per_step]
        xs = range(1, len(m) + 1)
        (line,) = ax1.plot(xs, m, marker="o", markersize=3, label=f"{a.algo} (n={len(curves)})")
        ax1.fill_between(xs, [u - v for u, v in zip(m, s)], [u + v for u, v in zip(m, s)], color=line.get_color(),
                         alpha=0.15)
    ax1.set_xlabel("step")
    ax1.set_ylabel("mean rollout reward")
    ax1.set_title("training reward (mean ± std over seeds)")
    if ax1.lines:
        ax1.legend(fontsize=8)
    xs = list(range(len(summaries)))
    after = [a.success_after.mean if a.success_after else 0.0 for a in summaries]
    err = [a.success_after.std if a.success_after else 0.0 for a in summaries]
    ax2.bar(xs, after, yerr=err, capsize=4, width=0.6, label="after (mean ± std)")
    before = list(success_before(rows).values())
    if before:
        ax2.axhline(mean(before), color="gray", linestyle="--", label=f"before ({mean(before):.1%})")
    for x, a in zip(xs, summaries):
        if a.success_after:
            ax2.text(x, min(0.93, a.success_after.mean + a.success_after.std + 0.02),
                     f"{a.success_after.mean:.1%}\nn={a.success_after.n}", ha="center", fontsize=8)
        if not a.ok_seeds:
            ax2.text(x, 0.02, "failed", ha="center", color="red")
    ax2.set_xticks(xs)
    ax2.set_xticklabels([a.algo for a in summaries], rotation=20)
    ax2.set_ylim(0, 1)
    ax2.set_ylabel("greedy success")
    ax2.set_title("held-out success after training")
    ax2.legend(fontsize=8)
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


def _failure(code: int, wall: float, timeout_s: float | None, log: Path) -> str:
    if timeout_s and wall >= timeout_s:
        why = f"timed out after {timeout_s:.0f}s"
    elif code < 0:
        why = f"killed by signal {signal.Signals(-code).name}"
    else:
        why = f"exit code {code}"
    return f"{why}; last output: {_error_line(log)} (log: {log})"


@dataclass
class CompareResult:
    output_dir: Path
    rows: list[AlgoResult]  # one per (algorithm, seed), seed-major in the order of --seeds and --algos
    table: str  # the aggregated table, the tests and the per-run table, as in compare.md
    png: Path | None
    summaries: list[AlgoSummary] = field(default_factory=list)
    tests: list[dict[str, Any]] = field(default_factory=list)


def run_compare(algos: list[str], steps: int = 20, eval_size: int = 200, output_dir: str | Path | None = None,
                overrides: list[str] | tuple[str, ...] = (), prompts_per_step: int | None = None,
                group_size: int | None = None, seeds: Sequence[int] = (0,), threads: int = 0, window: int = 0,
                timeout_s: float | None = None, reuse: bool = False, parallel: int = 1,
                train_cmd: Sequence[str] = TRAIN_CMD, print_fn: Callable[..., None] = print) -> CompareResult:
    """Run each algorithm once per seed, each run in its own process, up to `parallel` at once, on
    the same budget; return the rows, the aggregates, the tests and the tables. reuse=True keeps
    the finished runs of an earlier call into the same output_dir (with the same settings: that is
    the caller's promise) and reruns only the (algorithm, seed) runs that failed or are new.
    `train_cmd` is the command the overrides are appended to (tests replace it with a fake)."""
    out = Path(output_dir or Path("runs") / f"compare-{datetime.now().strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    seeds = list(dict.fromkeys(seeds)) or [0]
    # the periodic evaluation (train.eval_every) is not read here: off, unless --set turns it on
    budget = [f"train.steps={steps}", f"data.eval_size={eval_size}", "train.eval_every=0"]
    if prompts_per_step is not None:
        budget.append(f"train.prompts_per_step={prompts_per_step}")
    if group_size is not None:
        budget.append(f"train.group_size={group_size}")
    if threads:
        budget.append(f"train.threads={threads}")
    common, per = _split_overrides(list(overrides), algos)
    window = window or max(1, steps // 3)

    done: dict[tuple[str, int], AlgoResult] = {}
    todo: list[tuple[str, int]] = []
    for seed in seeds:
        for algo in algos:
            name = f"{algo}-s{seed}"
            record = out / f"{name}.result.json"
            if algo not in ALGORITHMS:
                done[algo, seed] = AlgoResult(algo, ok=False, seed=seed,
                                              error=f"unknown algorithm (known: {', '.join(ALGORITHMS)})")
            elif reuse and record.exists() and json.loads(record.read_text()).get("ok"):
                row = summarize_run(algo, out / name, window, seed)
                kept = json.loads(record.read_text())
                row.wall_s, row.peak_mem_mib = kept["wall_s"], peak_memory(row, kept["peak_mem_mib"])
                done[algo, seed] = row
                print_fn(f"[{name}] reusing the finished run in {out / name}")
            else:
                todo.append((algo, seed))
    # before-training success is the same for every algorithm of a seed: measured by one run of it
    measured = {s for (_, s), r in done.items() if r.ok and r.success_before is not None}
    measures_before: set[tuple[str, int]] = set()
    for algo, seed in todo:
        if seed not in measured:
            measured.add(seed)
            measures_before.add((algo, seed))

    def launch(job: tuple[str, int]) -> AlgoResult:
        algo, seed = job
        name = f"{algo}-s{seed}"
        cmd = [*train_cmd, *ALGORITHMS[algo], *budget, f"seed={seed}",
               f"train.eval_before={'true' if job in measures_before else 'false'}", *common, *per[algo],
               f"output_dir={out}", f"run_name={name}", "--no-progress"]
        print_fn(f"[{name}] actloop train {' '.join(cmd[len(train_cmd):])}")
        log, run_dir = out / f"{name}.log", out / name
        if run_dir.exists():  # metrics.jsonl is appended to: start from a clean directory
            shutil.rmtree(run_dir)
        code, wall, peak = run_child(cmd, log, timeout_s)
        if code == 0 and (run_dir / "summary.json").exists():
            try:
                row = summarize_run(algo, run_dir, window, seed)
            except Exception as e:  # a run that finished but wrote something unreadable
                row = AlgoResult(algo, ok=False, seed=seed, error=f"cannot read results: {e}", run_dir=str(run_dir))
        else:
            row = AlgoResult(algo, ok=False, seed=seed, error=_failure(code, wall, timeout_s, log),
                             run_dir=str(run_dir))
        row.wall_s, row.peak_mem_mib = round(wall, 1), peak_memory(row, peak)
        (out / f"{name}.result.json").write_text(
            json.dumps({"ok": row.ok, "wall_s": row.wall_s, "peak_mem_mib": row.peak_mem_mib}))
        print_fn(f"[{name}] {'ok' if row.ok else 'FAILED'} in {wall:.0f}s, peak memory {peak:.0f} MiB"
                 + ("" if row.ok else f": {row.error}"))
        return row

    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        for job, row in zip(todo, pool.map(launch, todo)):
            done[job] = row
    rows = [done[algo, seed] for seed in seeds for algo in algos]

    summaries, tests = aggregate(rows), pairwise_tests(rows)
    png = out / "compare.png"
    if not plot(rows, png):
        png = None
        print_fn("matplotlib is not installed: no compare.png (pip install matplotlib)")
    settings = (f"steps={steps}, eval_size={eval_size}, seeds={','.join(map(str, seeds))}, reward window k={window}"
                + (f", prompts_per_step={prompts_per_step}" if prompts_per_step else "")
                + (f", group_size={group_size}" if group_size else "")
                + (f", threads={threads}" if threads else "")
                + (f", overrides: {' '.join(overrides)}" if overrides else ""))
    before = success_before(rows)
    per_seed = ", ".join(f"seed {s}: {before[s]:.1%}" for s in sorted(before))
    notes = [f"Held-out greedy success before training: {_fmt_ms(mean_std(list(before.values())), pct=True)} "
             f"({per_seed}). The seed chooses the held-out rows; every algorithm of a seed starts from the same "
             "model on the same rows, so it is measured once per seed, by that seed's first run."
             if before else "Held-out greedy success before training: not measured."]
    if parallel > 1:
        notes.append(f"Up to {parallel} runs at once: each s / step is measured under its neighbours' load; "
                     "peak memory is still each run's own.")
    notes.append("Cells: mean ± std over the seeds that finished (n = the `seeds ok` column).")
    table = "\n".join([
        markdown_table(rows), "", "\n".join(f"* {n}" for n in notes), "",
        "Pairwise tests of held-out success after training:", "", tests_table(tests), "",
        "Per run:", "", runs_table(rows)])
    (out / "compare.md").write_text(f"{settings}\n\n{table}\n")
    (out / "compare.json").write_text(json.dumps({
        "settings": settings, "seeds": seeds, "parallel": parallel, "success_before": before,
        "rows": [asdict(r) for r in rows], "aggregated": [asdict(a) for a in summaries], "tests": tests}, indent=2))
    return CompareResult(out, rows, table, png, summaries, tests)


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"comma-separated integers, e.g. 0,1,2; got `{text}`") from None


def compare(
    algos: str = typer.Option("grpo,ppo,dpo", "--algos", help=f"Comma-separated, from: {', '.join(ALGORITHMS)}."),
    steps: int = typer.Option(20, "--steps", help="Training steps, the same for every algorithm."),
    eval_size: int = typer.Option(200, "--eval-size", help="Held-out problems evaluated greedily before (once per "
                                  "seed) and after (every run)."),
    seeds: str = typer.Option("0", "--seeds", help="Comma-separated seeds: every algorithm runs once per seed "
                              "(run directories <algo>-s<seed>); the table shows mean ± std over them and the "
                              "tests need >= 2 (3 or more to rank)."),
    parallel: int = typer.Option(1, "--parallel", help="Runs at once (each its own process; with --threads 1, "
                                 "one per free core). s / step is then measured under the neighbours' load."),
    output_dir: Optional[str] = typer.Option(None, "--output-dir", help="Where runs and the table go "
                                             "(default runs/compare-<timestamp>)."),
    prompts_per_step: Optional[int] = typer.Option(None, "--prompts-per-step", help="Default: the config's."),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="Default: the config's."),
    threads: int = typer.Option(0, "--threads", help="torch threads per run (0 = torch's default; 1 is much "
                                "faster on a CPU other jobs are using)."),
    window: int = typer.Option(0, "--window", help="k for the reward gain: mean of the last k steps minus the "
                               "first k (0 = steps // 3)."),
    timeout: float = typer.Option(0, "--timeout", help="Seconds before one run is killed (0 = none)."),
    reuse: bool = typer.Option(False, "--reuse", help="In an existing --output-dir, keep the (algorithm, seed) "
                               "runs that finished and rerun only the failed or new ones (same settings assumed)."),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="key=value for every run, or algo:key=value for "
                                             "one (repeatable), e.g. --set train.beta=0.04 --set dpo:dpo.beta=0.2."),
) -> None:
    """Compare algorithms (default PPO, DPO, GRPO) on the calculator task at the same budget, each run
    in its own process, over one or more seeds: peak memory, seconds per step, reward gain, held-out
    success (mean ± std over seeds) and which differences are significant."""
    names = [a.strip() for a in algos.split(",") if a.strip()]
    res = run_compare(names, steps=steps, eval_size=eval_size, output_dir=output_dir, overrides=list(set_ or []),
                      prompts_per_step=prompts_per_step, group_size=group_size, seeds=_ints(seeds), threads=threads,
                      window=window, timeout_s=timeout or None, reuse=reuse, parallel=parallel)
    print()
    print(res.table)
    print()
    print(f"table: {res.output_dir / 'compare.md'}" + (f", plot: {res.png}" if res.png else ""))
    if not any(r.ok for r in res.rows):
        raise typer.Exit(1)
