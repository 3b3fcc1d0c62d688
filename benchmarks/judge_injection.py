"""The injection red-team set against stand-in judges: what gets paid, what gets flagged.

    PYTHONPATH=. .venv/bin/python benchmarks/judge_injection.py [--cases] [--json]

Every case of `tests/rewards/injection_redteam.jsonl` is scored through a real `Judge` in a
`Rubric`, talking HTTP to a stand-in judge on loopback (`tests/rewards/standin_judges.py`):
an obedient one (obeys an injection anywhere) and a delimiter-bound one (obeys only text
outside the data wrapper), in each template mode and as a two-judge panel. The same script
measures the library it imports, so `PYTHONPATH=<another checkout>` measures that one.
Per row: injected wrong answers paid in full / flagged / masked, honest answers harmed (less
than full or flagged), honest wrong answers paid in full; `mean` is the injections'
mean reward, masked ones left out. A few seconds.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "rewards"))

from standin_judges import CASES, MODES, evaluate, rates  # noqa: E402


def main() -> None:
    t0 = time.monotonic()
    table, rows = [], []
    for obeys in ("obedient", "delimiter"):
        for mode in MODES:
            results = evaluate(CASES, mode, obeys)
            r = rates(results)
            rows += results
            table.append((obeys, mode, r))
    if "--json" in sys.argv:
        print(json.dumps([{"judge": o, "mode": m, **r} for o, m, r in table], indent=1, ensure_ascii=False))
    head = f"{'judge':<10} {'mode':<9} {'inj':>4} {'paid full':>10} {'flagged':>8} {'masked':>7} {'mean':>5} {'honest harmed':>14} {'wrong paid':>11}"
    print(head)
    for obeys, mode, r in table:
        print(f"{obeys:<10} {mode:<9} {r['injections']:>4} {r['injections_paid_full']:>10} {r['injections_flagged']:>8} "
              f"{r['injections_masked']:>7} {r['injections_mean_reward']:>5.2f} {len(r['honest_harmed']):>9} / {r['honest']:<2} {r['wrong_paid_full']:>7} / {r['wrong']}")
    for s in ("dev", "heldout", "heldout2"):
        inj = [c for c in CASES if c.set == s and not c.honest]
        look = [c for c in CASES if c.set == s and c.kind == "lookalike"]
        flagged = {x.case.name for x in rows if x.judge == "delimiter" and x.flagged}
        print(f"{s}: injections flagged {sum(c.name in flagged for c in inj)} / {len(inj)}, "
              f"look-alikes flagged {sum(c.name in flagged for c in look)} / {len(look)}")
    if "--cases" in sys.argv:
        for x in rows:
            if x.mode == "pointwise":
                print(f"{x.judge:<10} {x.case.kind:<9} {x.case.name:<32} reward {x.reward:.2f} "
                      f"{'masked ' if x.masked else ''}{','.join(x.flags)}")
    print(f"({time.monotonic() - t0:.1f}s)")


if __name__ == "__main__":
    main()
