"""Process-wide sandbox time: every sandbox run and Python-session cell adds its wall-clock
duration here, so a trainer can report the seconds one step spent in sandboxes (`sandbox_s`)
as the difference of two readings. Runs overlap when graders use threads, so the total can
exceed the step's own wall time."""

from __future__ import annotations

import threading

_lock = threading.Lock()
_totals = {"seconds": 0.0, "runs": 0, "timeouts": 0}


def record(seconds: float, timed_out: bool = False) -> None:
    with _lock:
        _totals["seconds"] += seconds
        _totals["runs"] += 1
        _totals["timeouts"] += int(timed_out)


def totals() -> dict[str, float]:
    """{"seconds", "runs", "timeouts"} since the process started."""
    with _lock:
        return dict(_totals)
