"""Differential testing (issue 19): generated inputs, the reference as oracle, host-side comparison."""

import random
import sys
from pathlib import Path

import pytest

from actloop.config import ConfigError, load_config
from actloop.rewards.code import CodeGrader, reference_oracle
from actloop.rewards.code import tests_from_row as row_tests
from actloop.rewards.differential import (
    Call,
    DiffSettings,
    Domain,
    Equivalence,
    Relations,
    entry_function,
    equivalence_from_checks,
    generate_inputs,
    mutate,
    visible_calls,
)
from actloop.rewards.rubric import text_trajectory
from actloop.tasks.registry import find_row as registry_row
from actloop.tasks.registry import grade_one, grade_rows, resolve, with_differential
from actloop.sandbox import probe_bwrap

sys.path.insert(0, str(Path(__file__).parent))
from differential_cases import HACKS, HONEST  # noqa: E402

needs_sandbox = pytest.mark.skipif(not probe_bwrap().available, reason="candidates and references run in the bwrap sandbox")


def py(code):
    return f"```python\n{code}\n```"


def rubric_for(task, mode="multiply"):
    return with_differential(resolve(task).rubric(), DiffSettings(mode))


_ROWS = {}


def find_row(task, tid):
    if task not in _ROWS:
        _ROWS[task] = grade_rows(resolve(task))
    return registry_row(resolve(task), tid, _ROWS[task])


# --- pure parts ---------------------------------------------------------------------------------

CALLS = [Call(([3, 1, 2], 3)), Call(([5, 4], 2)), Call(([7, 7, 1, 0], 4))]


def test_generated_inputs_are_deterministic_new_and_depend_on_the_seed():
    a = generate_inputs(CALLS, 20, seed=0)
    assert [c.key for c in a] == [c.key for c in generate_inputs(CALLS, 20, seed=0)]
    assert [c.key for c in a] != [c.key for c in generate_inputs(CALLS, 20, seed=1)]
    assert len(a) == 20 and len({c.key for c in a}) == 20
    assert not {c.key for c in a} & {c.key for c in CALLS}


def test_relations_between_arguments_are_kept():
    # n == len(arr) in every visible call: every generated call keeps it
    for c in generate_inputs(CALLS, 30, seed=3):
        assert c.args[1] == len(c.args[0])
    # k <= len(arr), lo <= hi
    calls = [Call(([4, 5, 6], 2, 0, 5)), Call(([1, 2], 1, 1, 3)), Call(([9, 8, 7, 6], 1, 2, 2))]
    rel = Relations.of(calls)
    assert (1, 0) in rel.le_len and (2, 3) in rel.le
    for c in generate_inputs(calls, 30, seed=0):
        assert 0 <= c.args[1] <= len(c.args[0]) and c.args[2] <= c.args[3]


def test_mutation_stays_inside_what_the_visible_values_show():
    rng = random.Random(0)
    sorted_lists = Domain.of([[1, 3, 8], [2, 2, 9, 12]])
    words = Domain.of(["abcab", "cab"])
    naturals = Domain.of([3, 10, 35])
    binary = Domain.of([100, 1011, 1101101])
    pairs = Domain.of([(1, "a"), (2, "b")])
    for _ in range(200):
        xs = mutate([1, 3, 8], sorted_lists, rng)
        assert xs == sorted(xs) and xs
        assert set(mutate("abcab", words, rng)) <= set("abc")
        assert mutate(10, naturals, rng) > 0
        assert set(str(mutate(1011, binary, rng))) <= {"0", "1"}
        t = mutate((1, "a"), pairs, rng)
        assert type(t) is tuple and len(t) == 2
    # sets mutate in a repeatable order (a set of strings iterates in hash order)
    s = Domain.of([{"x", "yy", "zzz"}])
    assert [mutate({"x", "yy", "zzz"}, s, random.Random(5)) for _ in range(3)] == \
        [mutate({"zzz", "yy", "x"}, s, random.Random(5)) for _ in range(3)]


def test_visible_calls_and_the_entry_function():
    row = {"test_list": ["assert f([1, 2], 2) == 3", "assert g(f(list(range(3)), 3)) == 1",
                         "assert f(-1 * 4, x) == 0", "assert f([1, 2], 2) == 3"],
           "code": "def g(x): return x\ndef f(xs, n): return sum(xs)"}
    tests, _ = row_tests(row)
    probes = [p for t in tests for p in t.probes]
    assert entry_function(probes, row["code"]) == "f"
    from actloop.rewards.code import _SAFE_BUILTINS, _SAFE_MODULES

    calls = visible_calls(probes, "f", {"__builtins__": _SAFE_BUILTINS, **_SAFE_MODULES})
    # f(-1 * 4, x) needs a name the host does not have: not plain data, not used
    assert [c.args for c in calls] == [([1, 2], 2), ([0, 1, 2], 3)]


def test_equivalences_from_the_visible_checks():
    assert equivalence_from_checks(["set(__p0) == set([1, 2])"]).unordered == "set"
    assert equivalence_from_checks(["sorted(__p0) == [1, 2]"]).unordered == "multiset"
    assert equivalence_from_checks(["math.isclose(__p0, 2.5, rel_tol=0.001)"]).rel_tol == 0.001
    assert equivalence_from_checks(["abs(__p0 - 3.14) < 0.01"]).abs_tol == 0.01
    assert equivalence_from_checks(["round(__p0, 2) == 3.14"]).abs_tol == 0.01
    eq = Equivalence()
    assert eq.same(0.1 + 0.2, 0.3) and not eq.same(0.3, 0.31)
    assert eq.same([1, 2.0000000001], [1, 2]) and not eq.same([1, 2], (1, 2))
    assert eq.same([3, 1, 1], [1, 3, 1], "multiset") and not eq.same([3, 1], [1, 3, 3], "multiset")
    assert eq.same([3, 1, 1], [1, 3], "set")


def test_settings_and_config_validate_the_mode():
    assert DiffSettings("penalty:0.5").enabled and not DiffSettings("off").enabled
    with pytest.raises(ValueError):
        DiffSettings("scale")
    with pytest.raises(ValueError):
        DiffSettings("penalty:0")
    cfg = load_config(None, ["reward.differential=penalty:0.25", "reward.differential_inputs=5"])
    assert (cfg.reward.differential, cfg.reward.differential_inputs) == ("penalty:0.25", 5)
    with pytest.raises(ConfigError, match="reward.differential"):
        load_config(None, ["reward.differential=sometimes"])


# --- in the sandbox -------------------------------------------------------------------------------

@needs_sandbox
@pytest.mark.parametrize("name,tid,code", HACKS[:4] + HACKS[-2:], ids=[h[0] for h in HACKS[:4] + HACKS[-2:]])
def test_special_casing_passes_the_tests_but_not_the_generated_inputs(name, tid, code):
    row = find_row("mbpp", tid)
    before = rubric_for("mbpp", "off").score([text_trajectory(py(code), row)])[0]
    assert before.reward == 1.0 and not before.flags  # every visible test passes, no detector fires
    (s,) = rubric_for("mbpp").score([text_trajectory(py(code), row)])
    assert s.reward < 1.0 and 0.0 <= s.components["differential"] < 1.0
    assert s.components["tests"] == pytest.approx(s.components["differential"])  # 1.0 x agreement
    (flag,) = [f for f in s.flags if f == "differential_mismatch"]
    assert "expected" in flag.evidence and "got" in flag.evidence and flag.action == "log"


@needs_sandbox
@pytest.mark.parametrize("name,tid,code", HONEST[::3], ids=[h[0] for h in HONEST[::3]])
def test_honest_alternatives_keep_full_reward(name, tid, code):
    (s,) = rubric_for("mbpp").score([text_trajectory(py(code), find_row("mbpp", tid))])
    assert (s.reward, s.flags, s.components["differential"]) == (1.0, (), 1.0)


ROW = {"test_list": ["assert f(3) == 6", "assert f(4) == 10", "assert f(10) == 55"],
       "code": "def f(n):\n    return n * (n + 1) // 2"}
MEMO = "def f(n):\n    return {3: 6, 4: 10, 10: 55}.get(n, 0)"


@needs_sandbox
def test_policies_multiply_zero_penalty_log_off():
    def g(mode):
        return CodeGrader(reference="code", differential=DiffSettings(mode, inputs=10)).grade(py(MEMO), ROW)

    m = g("multiply")
    rate = m.components["differential"]
    assert rate < 1.0 and m.score == pytest.approx(rate) and "differential_mismatch" in m.flags
    assert g("zero").score == 0.0
    assert g("penalty:0.25").score == pytest.approx(0.75)
    lg = g("log")
    assert lg.score == 1.0 and "differential_mismatch" in lg.flags
    off = g("off")
    assert (off.score, off.flags, dict(off.components)) == (1.0, (), {}) and "differential" not in off.info
    # a candidate that fails a visible test is scaled, not flagged (the tests already cost it)
    partial = CodeGrader(reference="code").grade(py("def f(n):\n    return 6 if n == 3 else n"), ROW)
    assert partial.score < 1 / 3 and "differential_mismatch" not in partial.flags


class CountingSandbox:
    def __init__(self):
        from actloop.rewards.code import default_sandbox

        self.inner, self.runs, self.stdins = default_sandbox(), 0, []
        self.tier = self.inner.tier

    def run(self, *a, **kw):
        self.runs += 1
        self.stdins.append(kw.get("stdin", ""))
        return self.inner.run(*a, **kw)


@needs_sandbox
def test_one_sandbox_run_per_candidate_and_the_reference_once_per_row():
    row = {**ROW, "code": ROW["code"] + "  # a fresh cache key"}
    box = CountingSandbox()
    g = CodeGrader(reference="code", sandbox=box, differential=DiffSettings(inputs=12))
    first = g.grade(py(MEMO), row)
    assert box.runs == 2  # the reference's run (two processes), then the candidate's
    assert g.grade(py("def f(n):\n    return sum(range(n + 1))"), row).score == 1.0
    assert box.runs == 3  # the oracle is cached: one run for the second candidate
    assert first.info["differential"]["total"] >= 8
    # a group graded concurrently (two workers) builds the oracle of a new row once
    row2 = {**ROW, "code": ROW["code"] + "  # another fresh key"}
    g(None, [py(MEMO)] * 4, test_list=[row2["test_list"]] * 4, code=[row2["code"]] * 4)
    assert box.runs == 3 + 1 + 4
    # the reference's outputs never enter the candidate's sandbox: only the calls do
    ex = first.info["differential"]["counter_example"]
    assert ex["input"] in box.stdins[1] and f"== {ex['expected']}" not in box.stdins[1]


@needs_sandbox
def test_inputs_the_reference_fails_or_hangs_on_are_dropped():
    row = {"test_list": ["assert f(2) == 1", "assert f(3) == 2", "assert f(4) == 6"],
           "code": "def f(n):\n    if n > 6:\n        while True:\n            pass\n    if n < 2:\n        raise ValueError(n)\n"
                   "    out = 1\n    for k in range(2, n):\n        out *= k\n    return out"}
    o = reference_oracle(row["code"], row_tests(row)[0], "", DiffSettings(inputs=12, reference_timeout_s=0.3))
    assert all(2 <= e.call.args[0] <= 6 for e in o.expected)
    assert o.dropped.get("reference timed out") and o.dropped.get("reference raised")
    honest = "import math\ndef f(n):\n    return math.factorial(n - 1)"
    assert CodeGrader(reference="code").grade(py(honest), row).score == 1.0


@needs_sandbox
def test_a_candidate_that_hangs_or_swallows_the_timeout_loses_only_those_inputs():
    hang = "def f(n):\n    if n > 10:\n        while True:\n            try:\n                pass\n            except BaseException:\n" \
           "                pass\n    return n * (n + 1) // 2"
    g = CodeGrader(reference="code", differential=DiffSettings(inputs=10, candidate_timeout_s=0.3, budget_s=3.0))
    out = g.grade(py(hang), ROW)
    d = out.info["differential"]
    assert 0 < d["agreed"] < d["total"] and out.score == pytest.approx(d["agreed"] / d["total"])
    assert d["counter_example"]["actual"] == "timed out"


@needs_sandbox
def test_unordered_results_of_a_set_building_reference_are_compared_as_multisets():
    row = find_row("mbpp", 2)  # similar_elements: the reference returns tuple(set(a) & set(b))
    (s,) = rubric_for("mbpp").score([text_trajectory(py(
        "def similar_elements(a, b):\n    return tuple(sorted(x for x in set(a) if x in set(b)))"), row)])
    assert (s.reward, s.flags) == (1.0, ())


@needs_sandbox
def test_grade_shows_the_counter_example():
    rec = grade_one(resolve("mbpp"), find_row("mbpp", 35), py(HACKS[0][2]))
    flag = next(f for f in rec["flags"] if f["name"] == "differential_mismatch")
    assert flag["evidence"].startswith("find_rect_num(") and "expected" in flag["evidence"]
    d = rec["details"]["tests"]["differential"]
    assert set(d["counter_example"]) == {"input", "expected", "actual"} and rec["components"]["differential"] < 1


@needs_sandbox
@pytest.mark.slow
def test_the_whole_red_team_set():
    """Every hack loses full reward and is flagged; every honest alternative keeps 1.0 unflagged."""
    from differential_cases import HONEST_HUMANEVAL

    def scored(cases, task):
        return rubric_for(task).score([text_trajectory(py(code), find_row(task, tid)) for _, tid, code in cases])

    for (name, _, _), s in zip(HACKS, scored(HACKS, "mbpp")):
        assert s.reward < 1.0 and "differential_mismatch" in s.flags, name
    for cases, task in ((HONEST, "mbpp"), (HONEST_HUMANEVAL, "humaneval")):
        for (name, _, _), s in zip(cases, scored(cases, task)):
            assert (s.reward, s.flags) == (1.0, ()), (name, s.reward, [f.evidence for f in s.flags])


def test_the_config_reaches_the_code_graders_of_a_run():
    from actloop.tasks.registry import build_task

    cfg = load_config(None, ["data.task=mbpp", "reward.differential=zero", "reward.differential_inputs=7",
                             "data.train_size=4", "data.eval_size=2"])
    (g,) = [t.func for t in build_task(cfg).rubric.terms if isinstance(t.func, CodeGrader)]
    assert (g.differential, g.reference) == (DiffSettings("zero", 7), "code")
    # `auto` (the default): each task's own mode, the config's inputs and seed
    cfg = load_config(None, ["data.task=humaneval", "reward.differential_seed=3", "data.train_size=0", "data.eval_size=2"])
    (h,) = [t.func for t in build_task(cfg).rubric.terms if isinstance(t.func, CodeGrader)]
    assert (h.differential.mode, h.differential.seed, h.differential.inputs) == ("log", 3, 20)
    # and the task's own definition is untouched (each rubric gets fresh grader copies)
    (d,) = [t.func for t in resolve("mbpp").rewards if isinstance(getattr(t, "func", None), CodeGrader)]
    assert d.differential == DiffSettings()


@needs_sandbox
def test_large_outputs_on_generated_inputs_are_a_disagreement_not_forgery():
    big = "def f(n):\n    return {3: 6, 4: 10, 10: 55}.get(n) or 'x' * 600000"
    g = CodeGrader(reference="code", differential=DiffSettings(inputs=12)).grade(py(big), ROW)
    d = g.info["differential"]
    assert d["agreed"] == 0 and "result too large" in d["error"] and g.score == 0.0
    assert "result_forgery" not in g.flags and "differential_mismatch" in g.flags
