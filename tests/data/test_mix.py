"""Weighted mixing: parsing `data.mix`, exact shares, determinism under the seed, routing rows to
their source's environment and rubric, and metrics per source."""

import json
from collections import Counter

import pytest

from actloop.config import ConfigError, load_config
from actloop.data.mix import MixedEnv, MixedRubric, allocate, mix_rows, parse_mix, per_source_metrics
from actloop.tasks import build_task
from actloop.tasks.calculator import CalculatorEnv
from actloop.rewards.rubric import RewardTerm, Rubric, text_trajectory
from actloop.types import Scored


def test_parse_mix_forms_and_errors():
    want = {"gsm8k": 0.7, "mbpp": 0.3}
    assert parse_mix(["gsm8k:0.7", "mbpp:0.3"]) == want == parse_mix("gsm8k:0.7,mbpp:0.3") == parse_mix(want)
    assert parse_mix(["openai/gsm8k:main:2"]) == {"openai/gsm8k:main": 2.0}  # the weight is after the last colon
    assert parse_mix([]) == {}
    for bad, msg in [(["gsm8k"], "name:weight"), (["gsm8k:x"], "must be a number"), (["gsm8k:0"], "must be > 0"),
                     (["gsm8k:1", "gsm8k:2"], "twice"), (["a:nan"], "must be > 0")]:
        with pytest.raises(ConfigError, match=msg):
            parse_mix(bad)


def test_allocate_is_exact():
    assert allocate(10, {"a": 0.7, "b": 0.2, "c": 0.1}) == {"a": 7, "b": 2, "c": 1}
    assert allocate(10, {"a": 1, "b": 1, "c": 1}) == {"a": 4, "b": 3, "c": 3}
    assert sum(allocate(997, {"a": 0.31, "b": 0.5, "c": 0.19}).values()) == 997
    assert allocate(3, {"a": 100, "b": 1}, min_each=1) == {"a": 3, "b": 1}


def test_mix_rows_shares_determinism_and_cycling():
    pools = {"a": [{"i": i, "source": "a"} for i in range(100)], "b": [{"i": i, "source": "b"} for i in range(3)]}
    rows = mix_rows(pools, {"a": 3, "b": 1}, 40, seed=0)
    assert Counter(r["source"] for r in rows) == {"a": 30, "b": 10}
    assert rows == mix_rows(pools, {"a": 3, "b": 1}, 40, seed=0) != mix_rows(pools, {"a": 3, "b": 1}, 40, seed=1)
    b = Counter(r["i"] for r in rows if r["source"] == "b")
    assert sorted(b.values()) == [3, 3, 4]  # whole passes over a short source before any row repeats again
    assert len({r["i"] for r in rows if r["source"] == "a"}) == 30  # no repeats while the pool lasts
    with pytest.raises(ConfigError, match="no rows"):
        mix_rows({"a": []}, {"a": 1}, 5, 0)


def test_build_task_with_a_mixture_is_seeded_and_tagged():
    over = ["data.mix=[countdown:3,instructions:1,calculator:1]", "data.train_size=50", "data.eval_size=10"]
    t = build_task(load_config(None, over))
    assert t.name == "mix" and Counter(r["source"] for r in t.train_rows) == {"countdown": 30, "instructions": 10,
                                                                              "calculator": 10}
    assert Counter(r["source"] for r in t.eval_rows) == {"countdown": 6, "instructions": 2, "calculator": 2}
    again = build_task(load_config(None, over))
    assert again.train_rows == t.train_rows and again.eval_rows == t.eval_rows
    assert build_task(load_config(None, over + ["seed=1"])).train_rows != t.train_rows
    env = t.make_env()
    msgs, tools = env.reset(next(r for r in t.train_rows if r["source"] == "calculator"))
    assert isinstance(env.env, CalculatorEnv) and tools
    msgs, tools = env.reset(next(r for r in t.train_rows if r["source"] == "countdown"))
    assert "<answer>" in msgs[0].content and tools == []


def test_mixture_config_round_trips_through_yaml(tmp_path):
    cfg = load_config(None, ["data.mix=gsm8k:0.7,mbpp:0.3"])
    p = tmp_path / "c.yaml"
    p.write_text(cfg.to_yaml())
    assert load_config(p).data.mix == ["gsm8k:0.7", "mbpp:0.3"]


def test_mixed_rubric_scores_each_row_with_its_own_rubric_in_order():
    def one(prompts, completions, **kw):
        return [1.0] * len(completions)

    def boom(prompts, completions, **kw):
        raise RuntimeError("grader down")

    rubric = MixedRubric(terms=[], parts={"a": Rubric([RewardTerm("one", one)]), "b": Rubric([RewardTerm("boom", boom)])})
    trajs = [text_trajectory(str(i), {"source": "ab"[i % 2]}) for i in range(4)]
    details = []
    scored = rubric.score(trajs, details=details)
    assert [s.trajectory for s in scored] == trajs
    assert [(s.reward, s.masked) for s in scored] == [(1.0, False), (0.0, True)] * 2
    assert rubric.errors and rubric.errors[0].startswith("[b] reward `boom` raised RuntimeError: grader down (")
    assert rubric.flag_counts["reward_error"] == 2
    assert len(details) == 4
    with pytest.raises(KeyError, match="not in the mixture"):
        rubric.score([text_trajectory("x", {"source": "c"})])


def test_mixed_env_refuses_unknown_sources():
    env = MixedEnv({"calculator": CalculatorEnv})
    with pytest.raises(KeyError, match="'gsm8k' is not in the mixture"):
        env.reset({"source": "gsm8k", "question": "q"})


def test_custom_files_in_a_mixture(tmp_path):
    rows = tmp_path / "mine.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"say {i}", "want": str(i)}) + "\n" for i in range(20)))
    over = [f"data.mix=[{rows}:1,countdown:1]", "data.train_size=10", "data.eval_size=4"]
    with pytest.raises(ConfigError, match="reward.funcs"):
        build_task(load_config(None, over))
    reward = tmp_path / "r.py"
    reward.write_text("def echo(prompts, completions, want, **kw):\n    return [float(c == w) for c, w in zip(completions, want)]\n")
    t = build_task(load_config(None, over + [f"reward.funcs=[{reward}:echo]"]))
    assert Counter(r["source"] for r in t.train_rows) == {"mine": 5, "countdown": 5}
    mine = next(r for r in t.eval_rows if r["source"] == "mine")
    (s,) = t.rubric.score([text_trajectory(mine["want"], mine)])
    assert s.reward == 1.0


def test_per_source_metrics():
    def sc(src, reward, success):
        return Scored(text_trajectory("x", {"source": src}), reward, {}, success=success)

    m = per_source_metrics([sc("a", 1.0, True), sc("a", 0.0, False), sc("b", 0.5, False)])
    assert m["source/a/n"] == 2 and m["source/a/reward_mean"] == 0.5 and m["source/a/success"] == 0.5
    assert m["source/a/reward_std"] == pytest.approx(0.7071, abs=1e-4) and m["source/b/reward_std"] == 0.0
    assert set(m) == {f"source/{s}/{k}" for s in "ab" for k in ("n", "reward_mean", "reward_std", "success",
                                                                 "tool_calls_per_episode", "truncated_rate", "masked")}
    assert per_source_metrics([Scored(text_trajectory("x", {}), 1.0, {})])["source/default/n"] == 1


def test_periodic_eval_line_carries_each_source():
    """metrics.jsonl at a periodic evaluation: overall success and reward, and each mix source's."""
    from actloop.train.runtime.run import eval_metrics

    res = {"success": 0.5, "reward": 0.625, "seconds": 12.3456,
           "per_source": {"calculator": {"n": 2, "success": 1.0, "reward": 1.0},
                          "instructions": {"n": 2, "success": 0.0, "reward": 0.25}}}
    assert eval_metrics(res) == {"eval_success": 0.5, "eval_reward": 0.625, "eval_s": 12.346,
                                 "eval/calculator/success": 1.0, "eval/calculator/reward": 1.0,
                                 "eval/instructions/success": 0.0, "eval/instructions/reward": 0.25}
    assert eval_metrics({"success": 0.1, "reward": 0.2, "seconds": 1}) == {"eval_success": 0.1, "eval_reward": 0.2,
                                                                          "eval_s": 1}
