"""The cost and token monitor: cumulative token counts, judge tokens and cost, tokens per
second, and how each step's time splits between rollout, sandbox, scoring and update.

It reads the per-step keys the trainer records (any that are missing are skipped) and adds:

- `total/<key>` — the running sum of each key in `CUMULATIVE` (tokens, judge cost, seconds);
- `tokens` / `tokens_per_s` — prompt + response + tool tokens of the step, per second of the step;
- `total/tokens_per_s` — the same over the whole run so far;
- `time/<part>_frac` — `<part>_s / step_s` for each part in `TIME_PARTS`.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

TOKEN_KEYS = ("prompt_tokens", "response_tokens", "tool_tokens")
# the trainer logs the judges' accounting per step as judge/<key> (actloop.rewards.judge.judge_usage)
JUDGE_KEYS = ("judge/requests", "judge/failed", "judge/prompt_tokens", "judge/completion_tokens", "judge/cost_usd")
TIME_PARTS = ("rollout", "sandbox", "scoring", "update", "ref")  # ref: the reference pass, inside update
CUMULATIVE = (TOKEN_KEYS + JUDGE_KEYS + ("sandbox_runs", "sandbox_timeouts")
              + tuple(f"{p}_s" for p in TIME_PARTS) + ("step_s",))


def _num(v: Any) -> float | None:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


class CostMonitor:
    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    def update(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """The keys to add to this step's record; advances the running totals."""
        out: dict[str, Any] = {}
        for key in CUMULATIVE:
            v = _num(record.get(key))
            if v is not None:
                self.totals[key] = self.totals.get(key, 0.0) + v
                out[f"total/{key}"] = round(self.totals[key], 6)
        present = [_num(record.get(k)) for k in TOKEN_KEYS]
        if any(v is not None for v in present):
            tokens = sum(v for v in present if v is not None)
            self.totals["tokens"] = self.totals.get("tokens", 0.0) + tokens
            out["tokens"] = int(tokens)
            out["total/tokens"] = int(self.totals["tokens"])
            step_s = _num(record.get("step_s"))
            if step_s and step_s > 0:
                out["tokens_per_s"] = round(tokens / step_s, 2)
            if self.totals.get("step_s", 0.0) > 0:
                out["total/tokens_per_s"] = round(self.totals["tokens"] / self.totals["step_s"], 2)
        out.update(time_split(record))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"totals": dict(self.totals)}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        self.totals = {k: float(v) for k, v in d.get("totals", {}).items()}


def time_split(record: Mapping[str, Any]) -> dict[str, float]:
    """`time/<part>_frac` = seconds in that part / seconds of the step (parts the record lacks
    are left out; nothing when step_s is missing or 0)."""
    step_s = _num(record.get("step_s"))
    if not step_s or step_s <= 0:
        return {}
    out = {}
    for p in TIME_PARTS:
        v = _num(record.get(f"{p}_s"))
        if v is not None:
            out[f"time/{p}_frac"] = round(v / step_s, 4)
    return out
