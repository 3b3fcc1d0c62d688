"""Alarms: pure detectors over the metric history, and the hysteresis that makes each one fire
once per episode of trouble.

A detector is `detector(history, cfg) -> Check | None`: `history` is the list of per-step
records so far (dicts of numbers, oldest first), `cfg` the `monitor` config section. It
returns None when it cannot judge yet (too few steps, a key the run does not record) and a
`Check` saying whether the condition holds now. `step_alarms` turns checks into alarms: an
alarm fires when its condition starts to hold, stays quiet while it keeps holding, and re-arms
once the condition has been clear for `cfg.rearm_steps` steps in a row.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping, Sequence

History = Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class Check:
    active: bool
    value: float
    threshold: float
    message: str


@dataclass(frozen=True)
class Alarm:
    step: int
    name: str
    message: str
    value: float
    threshold: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return f"ALARM step {self.step} {self.name}: {self.message}"


def series(history: History, key: str) -> list[tuple[int, float]]:
    """(step, value) for the records that hold a finite number under `key`."""
    out = []
    for i, r in enumerate(history):
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out.append((int(r.get("step", i + 1)), float(v)))
    return out


# metrics of the policy update; a step whose groups all had zero advantage trains nothing and
# reports them as 0.0, which is not a measurement
UPDATE_KEYS = ("entropy", "kl", "grad_norm", "clip_frac", "loss")


def drop_idle_updates(record: Mapping[str, Any]) -> dict[str, Any]:
    """The record without UPDATE_KEYS when it says no trajectory was trained on."""
    if record.get("trained_trajectories") == 0:
        return {k: v for k, v in record.items() if k not in UPDATE_KEYS}
    return dict(record)


def _values(history: History, key: str) -> list[float]:
    return [v for _, v in series(history, key)]


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


# --- detectors ------------------------------------------------------------------------------


def entropy_collapse(history: History, cfg) -> Check | None:
    """Policy entropy below `entropy_collapse_ratio` x its baseline (mean of the first window)."""
    v = _values(history, "entropy")
    if len(v) <= cfg.window:
        return None
    base = _mean(v[: cfg.window])
    if base <= 0:
        return None
    thr = cfg.entropy_collapse_ratio * base
    return Check(v[-1] < thr, v[-1], thr, f"entropy {v[-1]:.4g} < {cfg.entropy_collapse_ratio:g} x baseline {base:.4g}")


def _latest(history: History, key: str) -> float | None:
    """The newest number under `key`, inf and nan included: an overflowing update logs them."""
    for r in reversed(history):
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def kl_blowup(history: History, cfg) -> Check | None:
    """KL to the reference above `kl_max`, or not a finite number."""
    last = _latest(history, "kl")
    if last is None:
        return None
    return Check(not math.isfinite(last) or last > cfg.kl_max, last, cfg.kl_max, f"KL {last:.4g} > {cfg.kl_max:g}")


def grad_norm_spike(history: History, cfg) -> Check | None:
    """grad_norm above `grad_spike_ratio` x the median of the previous window (3+ steps), or
    not a finite number (at any step)."""
    last = _latest(history, "grad_norm")
    if last is not None and not math.isfinite(last):
        return Check(True, last, math.inf, f"grad_norm {last:.4g}: the gradient overflowed")
    v = _values(history, "grad_norm")
    prev = v[-1 - cfg.window : -1]
    if len(prev) < min(3, cfg.window):
        return None
    med = statistics.median(prev)
    if med <= 0:
        return None
    thr = cfg.grad_spike_ratio * med
    return Check(v[-1] > thr, v[-1], thr, f"grad_norm {v[-1]:.4g} > {cfg.grad_spike_ratio:g} x recent median {med:.4g}")


def length_blowup(history: History, cfg) -> Check | None:
    """Response tokens per episode above `length_ratio` x baseline, or truncated rate above
    `truncated_max`."""
    trunc = _values(history, "truncated_rate")
    if trunc and trunc[-1] > cfg.truncated_max:
        return Check(True, trunc[-1], cfg.truncated_max,
                     f"{trunc[-1]:.0%} of episodes cut off at max_new_tokens (> {cfg.truncated_max:.0%})")
    v = _values(history, "response_tokens_per_episode")
    if len(v) <= cfg.window:
        return Check(False, trunc[-1], cfg.truncated_max, "") if trunc else None
    base = _mean(v[: cfg.window])
    if base <= 0:
        return None
    thr = cfg.length_ratio * base
    return Check(v[-1] > thr, v[-1], thr,
                 f"{v[-1]:.1f} response tokens per episode > {cfg.length_ratio:g} x baseline {base:.1f}")


def zero_variance_groups(history: History, cfg) -> Check | None:
    """Mean fraction of all-equal-reward groups over the last window above `zero_variance_max`."""
    v = _values(history, "zero_variance_groups")
    if len(v) < cfg.window:
        return None
    m = _mean(v[-cfg.window :])
    return Check(m > cfg.zero_variance_max, m, cfg.zero_variance_max,
                 f"{m:.0%} of groups had all-equal rewards over the last {cfg.window} steps (no learning signal)")


def hack_flag_rise(history: History, cfg) -> Check | None:
    """Hack-flag rate of the last window above the window before by `flag_rise`."""
    v = _values(history, "hack_flag_rate")
    w = cfg.window
    if len(v) < 2 * w:
        return None
    recent, before = _mean(v[-w:]), _mean(v[-2 * w : -w])
    rise = recent - before
    return Check(rise > cfg.flag_rise, rise, cfg.flag_rise,
                 f"hack-flag rate rose from {before:.1%} to {recent:.1%} over the last {2 * w} steps")


def reward_hacking(history: History, cfg) -> Check | None:
    """Training reward trending up while a held-out signal trends down: over the span between
    the last three held-out points (two when only two exist), the held-out value fell by at
    least `hack_heldout_drop` and the training reward (mean of the window ending at each
    end) rose by at least `hack_reward_rise`."""
    reward = series(history, "reward_mean")
    checks = []
    for key in cfg.heldout_keys:
        held = series(history, key)
        if len(held) < 2 or not reward:
            continue
        (s0, h0), (s1, h1) = held[-3:][0], held[-1]

        def window_mean(end_step: int) -> float | None:
            xs = [v for s, v in reward if s <= end_step][-cfg.window :]
            return _mean(xs) if xs else None

        r0, r1 = window_mean(s0), window_mean(s1)
        if r0 is None or r1 is None:
            continue
        drop, rise = h0 - h1, r1 - r0
        active = drop >= cfg.hack_heldout_drop and rise >= cfg.hack_reward_rise
        checks.append(Check(active, drop, cfg.hack_heldout_drop,
                            f"training reward rose {r0:.3f} -> {r1:.3f} while {key} fell {h0:.3f} -> {h1:.3f} "
                            f"(steps {s0}-{s1}): the signature of reward hacking"))
    if not checks:
        return None
    return next((c for c in checks if c.active), checks[0])


DETECTORS: dict[str, Callable[[History, Any], Check | None]] = {
    "entropy_collapse": entropy_collapse,
    "kl_blowup": kl_blowup,
    "grad_norm_spike": grad_norm_spike,
    "length_blowup": length_blowup,
    "zero_variance_groups": zero_variance_groups,
    "hack_flag_rise": hack_flag_rise,
    "reward_hacking": reward_hacking,
}


# --- hysteresis -----------------------------------------------------------------------------


def next_state(state: Mapping[str, Any] | None, active: bool | None, rearm_steps: int) -> tuple[dict[str, Any], bool]:
    """One alarm's state {"active": bool, "clear": steps clear so far} after one check ->
    (new state, whether the alarm fires now). `active=None` (no judgement) changes nothing."""
    st = {"active": False, "clear": 0, **(state or {})}
    if active is None:
        return st, False
    if active:
        fired = not st["active"]
        return {"active": True, "clear": 0}, fired
    if st["active"]:
        clear = st["clear"] + 1
        if clear >= rearm_steps:
            return {"active": False, "clear": 0}, False
        return {"active": True, "clear": clear}, False
    return st, False


def step_alarms(history: History, cfg, states: Mapping[str, Mapping[str, Any]],
                detectors: Mapping[str, Callable] = DETECTORS) -> tuple[list[Alarm], dict[str, dict[str, Any]]]:
    """Run every detector on `history` (whose last record is the current step) -> (alarms that
    fire now, new states). Pure: the caller keeps the states."""
    step = int(history[-1].get("step", len(history))) if history else 0
    fired, new_states = [], {k: dict(v) for k, v in states.items()}
    for name, det in detectors.items():
        check = det(history, cfg)
        new_states[name], fire = next_state(states.get(name), None if check is None else check.active, cfg.rearm_steps)
        if fire and check is not None:
            fired.append(Alarm(step, name, check.message, round(check.value, 6), round(check.threshold, 6)))
    return fired, new_states
