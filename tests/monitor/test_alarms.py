"""Each alarm on synthetic histories: it fires when trouble starts, stays quiet while it lasts,
re-arms after the condition clears, and never fires on a healthy run."""

from __future__ import annotations

import pytest

from actloop.config import MonitorConfig
from actloop.monitor.alarms import DETECTORS, next_state, step_alarms


def replay(records, cfg=None):
    """Feed records one step at a time, as the Monitor does -> [(step, alarm name)]."""
    cfg = cfg or MonitorConfig()
    history, states, out = [], {}, []
    for r in records:
        history.append(r)
        fired, states = step_alarms(history, cfg, states)
        out += [(a.step, a.name) for a in fired]
    return out


def healthy(step: int, **kw) -> dict:
    """A healthy step: slowly rising reward, steady entropy/KL/length, some signal in each group."""
    r = {"step": step, "reward_mean": 0.3 + 0.01 * step, "entropy": 1.0 - 0.01 * step, "kl": 0.01 + 0.001 * step,
         "grad_norm": 1.0 + 0.1 * (step % 3), "response_tokens_per_episode": 30 + step % 4, "truncated_rate": 0.05,
         "zero_variance_groups": 0.25, "hack_flag_rate": 0.02 * (step % 2)}
    if step % 5 == 0:
        r["eval_success"] = 0.4 + 0.01 * step
    r.update(kw)
    return r


def run(n: int, override=lambda s: {}):
    return [healthy(s, **override(s)) for s in range(1, n + 1)]


def test_healthy_run_raises_no_alarm():
    assert replay(run(60)) == []


def test_hysteresis_state_machine():
    st, fire = next_state(None, True, rearm_steps=2)
    assert fire and st == {"active": True, "clear": 0}
    st, fire = next_state(st, True, 2)
    assert not fire                                  # still in trouble: quiet
    st, fire = next_state(st, False, 2)
    assert not fire and st == {"active": True, "clear": 1}   # one clear step is not enough
    st, fire = next_state(st, None, 2)
    assert st == {"active": True, "clear": 1}        # no judgement: no change
    st, fire = next_state(st, True, 2)
    assert not fire and st["clear"] == 0             # trouble again before re-arming: still quiet
    st, _ = next_state(st, False, 2)
    st, _ = next_state(st, False, 2)
    assert st == {"active": False, "clear": 0}       # re-armed
    assert next_state(st, True, 2)[1]


# Each case: (alarm, override(step) making steps 20-24 and 40-44 troubled). Expected: fires at
# 20 (or when the detector's window first sees it), not again during the episode, again at 40.
CASES = {
    "entropy_collapse": lambda s: {"entropy": 0.05} if 20 <= s < 25 or 40 <= s < 45 else {},
    "kl_blowup": lambda s: {"kl": 3.0} if 20 <= s < 25 or 40 <= s < 45 else {},
    "grad_norm_spike": lambda s: {"grad_norm": 40.0} if s in (20, 40) else {},
    "length_blowup": lambda s: {"response_tokens_per_episode": 200} if 20 <= s < 25 or 40 <= s < 45 else {},
    "zero_variance_groups": lambda s: {"zero_variance_groups": 1.0} if 20 <= s < 30 or 40 <= s < 50 else {},
    "hack_flag_rise": lambda s: {"hack_flag_rate": 0.5} if 20 <= s < 30 or 40 <= s < 50 else {},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_alarm_fires_once_per_episode_and_rearms(name):
    fired = replay(run(60, CASES[name]))
    assert {n for _, n in fired} == {name}, fired
    steps = [s for s, _ in fired]
    assert len(steps) == 2, fired                   # once per episode of trouble, two episodes
    assert 20 <= steps[0] < 30 and 40 <= steps[1] < 50


def test_grad_spike_is_relative_to_recent_median():
    # grad norms that grow steadily (x1.2 a step) never spike against their own recent median
    assert replay([healthy(s, grad_norm=1.2 ** s) for s in range(1, 30)]) == []
    fired = replay([healthy(s, grad_norm=10.0 if s == 8 else 1.0) for s in range(1, 12)])
    assert fired == [(8, "grad_norm_spike")]


def test_truncation_triggers_length_alarm_before_the_baseline_exists():
    fired = replay([healthy(s, truncated_rate=0.9 if s == 2 else 0.0) for s in range(1, 6)])
    assert fired == [(2, "length_blowup")]


def test_reward_hacking_signature():
    # training reward climbs from step 10; held-out success (every 5 steps) falls from step 10
    def hacked(s):
        d = {"reward_mean": 0.3 + (0.05 * (s - 10) if s > 10 else 0.0)}
        if s % 5 == 0:
            d["eval_success"] = 0.5 - (0.03 * (s - 10) if s > 10 else 0.0)
        return d

    fired = replay(run(40, hacked))
    assert [n for _, n in fired] == ["reward_hacking"]
    # step 15: held-out 0.50 (step 5) -> 0.35, training reward (5-step means) 0.30 -> 0.45
    assert fired[0][0] == 15


def test_reward_hacking_needs_both_trends():
    # held-out success falls while training reward is flat: a regression, not hacking
    flat = run(40, lambda s: {"reward_mean": 0.5, **({"eval_success": 0.8 - 0.02 * s} if s % 5 == 0 else {})})
    assert replay(flat) == []
    # reward and held-out both rise: learning
    both = run(40, lambda s: {"reward_mean": 0.02 * s, **({"eval_success": 0.02 * s} if s % 5 == 0 else {})})
    assert replay(both) == []


def test_judge_agreement_counts_as_a_heldout_signal():
    recs = run(30, lambda s: {"reward_mean": 0.05 * s, **({"judge_agreement": 1.0 - 0.04 * s} if s % 5 == 0 else {})})
    for r in recs:
        r.pop("eval_success", None)
    assert [n for _, n in replay(recs)] == ["reward_hacking"]


def test_missing_keys_and_tiny_runs_do_not_crash_or_fire():
    assert replay([{"step": 1}, {"step": 2, "entropy": "nan"}, {"step": 3, "kl": "nan"}]) == []  # strings: no number
    for det in DETECTORS.values():
        assert det([], MonitorConfig()) is None
    assert replay(run(2)) == []


def test_thresholds_come_from_config():
    recs = run(10, lambda s: {"kl": 0.3} if s == 5 else {})
    assert replay(recs) == []
    assert replay(recs, MonitorConfig(kl_max=0.2)) == [(5, "kl_blowup")]


def test_steps_that_trained_nothing_do_not_count_as_entropy_collapse(cfg, tmp_path):
    # the update reports entropy 0.0 when every group had zero advantage (nothing trained)
    from actloop.monitor.monitor import Monitor

    from .conftest import make_batch, record

    mon = Monitor(cfg, tmp_path, print_fn=lambda _: None)
    fired = []
    for s in range(1, 15):
        idle = s in (2, 9)
        rec = record(s, entropy=0.0 if idle else 1.0, grad_norm=0.0 if idle else 1.0,
                     trained_trajectories=0 if idle else 4)
        fired += mon.log_step(rec, make_batch([0.0, 1.0]))
    assert fired == []
    assert [h.get("entropy") for h in mon.history[:3]] == [1.0, None, 1.0]


def test_non_finite_kl_or_grad_norm_is_a_blowup(cfg, tmp_path):
    # an overflowing update logs kl=inf and grad_norm=nan: the worst spike there is, not a gap
    from actloop.monitor.monitor import Monitor

    from .conftest import make_batch, record

    recs = run(8, lambda s: {"kl": float("inf"), "grad_norm": float("nan")} if s == 7 else {})
    assert replay(recs) == [(7, "kl_blowup"), (7, "grad_norm_spike")]
    said = []
    mon = Monitor(cfg, tmp_path, print_fn=said.append)
    fired = []
    for s in range(1, 9):
        bad = {"kl": float("inf"), "grad_norm": float("nan")} if s == 7 else {}
        fired += [(a.step, a.name) for a in mon.log_step(record(s, **bad), make_batch([0.0, 1.0]))]
    assert fired == [(7, "kl_blowup"), (7, "grad_norm_spike")]
    assert any("KL inf" in m for m in said) and any("grad_norm nan" in m for m in said)


def test_zero_variance_alarm_sees_groups_dynamic_sampling_dropped(cfg, tmp_path):
    # with train.dynamic_sampling the kept groups all have signal (zero_variance_groups = 0): the
    # all-equal groups are the dropped ones, 10 of 12 rolled out here, at every step
    from actloop.monitor.monitor import Monitor

    from .conftest import make_batch, record

    mon = Monitor(cfg, tmp_path, print_fn=lambda _: None)  # group_size 2: the batch below is 2 groups
    fired = []
    for s in range(1, 8):
        rec = record(s, zero_variance_groups=0.0, dropped_groups=10)
        fired += [(a.step, a.name) for a in mon.log_step(rec, make_batch([0.0, 1.0, 0.0, 1.0]))]
    assert fired == [(5, "zero_variance_groups")]
    assert mon.history[-1]["zero_variance_groups"] == 10 / 12
    # without dropped groups the step's own value stands
    quiet = Monitor(cfg, tmp_path / "b", print_fn=lambda _: None)
    assert not any(quiet.log_step(record(s, zero_variance_groups=0.0, dropped_groups=0), make_batch([0.0, 1.0]))
                   for s in range(1, 8))
