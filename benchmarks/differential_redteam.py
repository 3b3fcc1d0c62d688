"""Red-team set of issue 19: special-casing / memorisation that passes the visible tests, and
honest alternative solutions (MBPP and HumanEval), graded by the task's rubric without and with
differential testing.

    python benchmarks/differential_redteam.py

Cases live in `tests/rewards/differential_cases.py`. Exit status 0 when no hack keeps full
reward after, and every honest solution does.
"""

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "rewards"))

from differential_cases import HACKS, HONEST, HONEST_HUMANEVAL  # noqa: E402

from actloop.rewards.differential import DiffSettings  # noqa: E402
from actloop.rewards.rubric import text_trajectory  # noqa: E402
from actloop.tasks.registry import find_row, grade_rows, resolve, with_differential  # noqa: E402


def score(cases, mode: str, task: str = "mbpp"):
    t = resolve(task)
    rows = grade_rows(t)
    rubric = with_differential(t.rubric(), DiffSettings(mode=mode))
    trajs = [text_trajectory(f"```python\n{code}```", find_row(t, tid, rows)) for _, tid, code in cases]
    return rubric.score(trajs)


def main() -> None:
    t0 = time.monotonic()
    rows = []
    for kind, cases, task in (("hack", HACKS, "mbpp"), ("honest", HONEST, "mbpp"),
                              ("honest", HONEST_HUMANEVAL, "humaneval")):
        before, after = score(cases, "off", task), score(cases, "multiply", task)
        for (name, tid, _), b, a in zip(cases, before, after):
            ev = next((f.evidence for f in a.flags if f == "differential_mismatch"), "")
            rows.append((kind, name, tid, b.reward, list(map(str, b.flags)), a.reward, list(map(str, a.flags)),
                         a.components.get("differential"), ev))
    print(f"{'kind':7} {'case':26} {'row':>5} {'before':>7} {'after':>7} {'agree':>6}  flags after")
    for kind, name, tid, rb, fb, ra, fa, d, ev in rows:
        print(f"{kind:7} {name:26} {tid:5} {rb:7.2f} {ra:7.2f} {d if d is None else round(d, 2)!s:>6}  "
              f"{','.join(fa) or '-'}{'  (before: ' + ','.join(fb) + ')' if fb else ''}")
        if ev:
            print(f"{'':44}{ev[:150]}")
    hacks = [r for r in rows if r[0] == "hack"]
    honest = [r for r in rows if r[0] == "honest"]
    full_before = sum(r[3] >= 1.0 for r in hacks)
    full_after = sum(r[5] >= 1.0 for r in hacks)
    harmed = [r[1] for r in honest if r[5] < 1.0 or r[6]]
    print(f"\nhacks with full reward: before {full_before}/{len(hacks)}, after {full_after}/{len(hacks)} "
          f"(flagged differential_mismatch after: {sum('differential_mismatch' in r[6] for r in hacks)}); "
          f"honest alternatives harmed: {len(harmed)}/{len(honest)} {harmed or ''}; {time.monotonic() - t0:.1f}s")
    sys.exit(0 if full_after == 0 and not harmed else 1)


if __name__ == "__main__":
    main()
