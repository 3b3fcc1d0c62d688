"""The cost and token monitor against hand-computed numbers."""

from actloop.monitor.costs import CostMonitor, time_split


def test_cumulative_tokens_rates_and_judge_cost():
    c = CostMonitor()
    a = c.update({"prompt_tokens": 100, "response_tokens": 50, "tool_tokens": 10, "judge/prompt_tokens": 300,
                  "judge/completion_tokens": 20, "judge/cost_usd": 0.01, "step_s": 4.0, "rollout_s": 3.0})
    assert a["tokens"] == 160 and a["tokens_per_s"] == 40.0
    assert a["total/judge/prompt_tokens"] == 300 and a["total/judge/cost_usd"] == 0.01
    b = c.update({"prompt_tokens": 100, "response_tokens": 70, "tool_tokens": 30, "judge/prompt_tokens": 200,
                  "judge/completion_tokens": 10, "judge/cost_usd": 0.02, "step_s": 6.0, "rollout_s": 5.0})
    assert b["tokens"] == 200 and b["tokens_per_s"] == round(200 / 6, 2)
    assert b["total/tokens"] == 360 and b["total/tokens_per_s"] == 36.0      # 360 tokens / 10 s
    assert b["total/prompt_tokens"] == 200 and b["total/response_tokens"] == 120 and b["total/tool_tokens"] == 40
    assert b["total/judge/prompt_tokens"] == 500 and b["total/judge/completion_tokens"] == 30
    assert abs(b["total/judge/cost_usd"] - 0.03) < 1e-9
    assert b["total/rollout_s"] == 8.0 and b["total/step_s"] == 10.0


def test_missing_keys_are_skipped():
    c = CostMonitor()
    assert c.update({"step": 1}) == {}
    out = c.update({"response_tokens": 12})  # no step time: no rate, still counted
    assert out == {"total/response_tokens": 12.0, "tokens": 12, "total/tokens": 12}


def test_time_split_fractions():
    s = time_split({"step_s": 8.0, "rollout_s": 4.0, "sandbox_s": 1.0, "scoring_s": 2.0, "update_s": 2.0})
    assert s == {"time/rollout_frac": 0.5, "time/sandbox_frac": 0.125, "time/scoring_frac": 0.25,
                 "time/update_frac": 0.25}
    assert time_split({"rollout_s": 1.0}) == {} and time_split({"step_s": 0, "rollout_s": 1.0}) == {}
    assert time_split({"step_s": 8.0, "update_s": 2.0, "ref_s": 0.5}) == {"time/update_frac": 0.25,
                                                                         "time/ref_frac": 0.0625}  # inside update


def test_state_round_trip_continues_the_totals():
    a, b = CostMonitor(), CostMonitor()
    a.update({"response_tokens": 5, "step_s": 1.0})
    b.load_state_dict(a.state_dict())
    assert a.update({"response_tokens": 7, "step_s": 1.0}) == b.update({"response_tokens": 7, "step_s": 1.0})
