"""Differential testing (issue 19): reference solutions graded against themselves, and the cost.

    python benchmarks/differential_selfcheck.py mbpp [--limit N]       # every MBPP reference
    python benchmarks/differential_selfcheck.py humaneval [--limit N]  # every HumanEval canonical solution
    python benchmarks/differential_selfcheck.py cost [--limit N]       # ms per MBPP completion, before/after

`mbpp` / `humaneval` grade each row's reference with the row's own reference as the oracle:
every one must score 1.0 with no flag; each exception is printed with why, and rows where
differential testing does not apply are counted by reason. `cost` grades the reference of the
first N MBPP rows with differential testing off and on (the oracle built first, as a group of
completions for one prompt shares it) and prints the median milliseconds of each.
Single worker; run it niced on a shared machine.
"""

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from actloop.rewards.code import CodeGrader, tests_from_row  # noqa: E402
from actloop.rewards.differential import DiffSettings  # noqa: E402
from actloop.tasks.registry import grade_rows, resolve  # noqa: E402


def grader(task: str, mode: str = "multiply") -> CodeGrader:
    """The task's own code grader (its reference wired as on main), with differential `mode`."""
    (g,) = [t.func for t in resolve(task).terms() if isinstance(t.func, CodeGrader)]
    g.differential = DiffSettings(mode=mode)
    return g


def load_rows(task: str) -> list:
    return grade_rows(resolve(task))


def selfcheck(task: str, limit: int | None) -> int:
    rows = load_rows(task)[:limit]
    g, gold_of = grader(task), resolve(task).gold
    bad, skipped, kept, t0 = [], Counter(), [], time.monotonic()
    for i, row in enumerate(rows):
        rid = row.get("task_id", i)
        out = g.grade(gold_of(row), row)
        d = out.info.get("differential", {})
        if "skipped" in d:
            skipped[d["skipped"].split(" of ")[0].split(" (")[0][:60]] += 1
        else:
            kept.append(d.get("total", 0))
        if out.score != 1.0 or out.flags:
            bad.append((rid, out.score, [f"{f}: {f.evidence}" for f in out.flags], d))
            print(f"EXCEPTION {task} {rid}: score {out.score} flags {bad[-1][2]} differential {d}", flush=True)
        if (i + 1) % 100 == 0:
            print(f"  {i + 1}/{len(rows)} ({time.monotonic() - t0:.0f}s)", flush=True)
    print(f"{task}: {len(rows) - len(bad)}/{len(rows)} reference solutions score 1.0 with no flag; "
          f"differential applied to {len(kept)} rows (median {statistics.median(kept) if kept else 0} kept inputs, "
          f"{sum(kept)} in all), skipped on {sum(skipped.values())}: {dict(skipped)}; {time.monotonic() - t0:.0f}s")
    return len(bad)


def cost(limit: int) -> None:
    rows = load_rows("mbpp")[:limit]
    before, after, gold_of = grader("mbpp", "off"), grader("mbpp"), resolve("mbpp").gold
    t_before, t_after, t_oracle = [], [], []
    for row in rows:
        comp = gold_of(row)
        t = time.perf_counter()
        before.grade(comp, row)
        t_before.append(time.perf_counter() - t)
        tests, setup = tests_from_row(row)
        t = time.perf_counter()
        after.oracle(row, tests, setup)  # the reference's run, once per prompt (cached)
        t_oracle.append(time.perf_counter() - t)
        t = time.perf_counter()
        after.grade(comp, row)
        t_after.append(time.perf_counter() - t)
    ms = lambda xs: f"{1000 * statistics.median(xs):.0f} ms"  # noqa: E731
    print(f"MBPP, first {len(rows)} rows, one completion each (the reference), single worker, measured under load:\n"
          f"  before (tests only):                      median {ms(t_before)}\n"
          f"  after (tests + generated inputs, 1 run): median {ms(t_after)}\n"
          f"  reference oracle, once per prompt:        median {ms(t_oracle)}\n"
          f"  per completion in a group of 8 (after + oracle/8): median "
          f"{1000 * statistics.median([a + o / 8 for a, o in zip(t_after, t_oracle)]):.0f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("mbpp", "humaneval", "cost"))
    ap.add_argument("--limit", type=int, default=None)
    a = ap.parse_args()
    if a.what == "cost":
        cost(a.limit or 50)
        return
    sys.exit(1 if selfcheck(a.what, a.limit) else 0)


if __name__ == "__main__":
    main()
