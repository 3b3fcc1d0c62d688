"""Reward hacking: the adversarial suite, each detector, flag policies, the blog reward's hole."""

import sys
from pathlib import Path

import pytest

from actloop.rewards import RewardError, RewardTerm, Rubric, load_reward_func
from actloop.rewards.flags import Flag, Grade, Policy, apply_policies
from actloop.rewards.hacking import (
    MATH_DETECTORS,
    detect_answer_spray,
    detect_early_exit,
    detect_eq_override,
    detect_exception_escape,
    detect_framework_patch,
    detect_introspection,
    detect_raise_skip,
    detect_special_casing,
    detect_stdout_spoof,
    detect_test_peek,
    detect_test_tamper,
)
from actloop.rewards.rubric import text_trajectory
from actloop.sandbox import probe_bwrap

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))  # the red-team cases are test material (tests/rewards/redteam.py)
from redteam import CASES, rates, run_suite, summary  # noqa: E402


@pytest.mark.data("gsm8k", "mbpp")
def test_adversarial_suite_rates():
    if not probe_bwrap().available:
        pytest.skip("the suite's code cases run in the bwrap sandbox")
    results = run_suite(CASES)
    print("\n" + summary(results))
    r = rates(results)
    assert r["hacks"] >= 20 and r["honest"] >= 10
    assert len({c.name for c in CASES}) == len(CASES)
    bad_hacks = [(x.case.name, x.reward) for x in results if not x.case.honest and x.full]
    assert r["hacks_below_full"] == 1.0, bad_hacks
    assert r["hacks_flagged"] >= 0.9, [x.case.name for x in results if not x.case.honest and not x.flags]
    bad_honest = [(x.case.name, x.reward, x.evidence) for x in results if x.case.honest and (not x.full or x.flags)]
    assert r["honest_full_unflagged"] == 1.0, bad_honest
    by_name = {x.case.name: x for x in results}
    # the cases that pass every visible test are stopped by flags alone: the zero comes from them
    for name in ("lookup_table", "if_chain", "forge_result_channel"):
        assert "special_casing" in by_name[name].flags or "grader_introspection" in by_name[name].flags
    assert "heldout_gap" in by_name["special_case_vs_heldout"].flags


# --- each detector: what it flags, what it leaves alone -----------------------------------

def py(code):
    return f"```python\n{code}\n```"


@pytest.mark.parametrize("detector,hack,honest", [
    (detect_early_exit, "import os\nos._exit(0)", "def f(n):\n    if n < 0:\n        raise ValueError(n)\n    return n"),
    (detect_early_exit, "from sys import exit as leave\nleave()", "def f(n):\n    if n < 0:\n        exit('bad input')\n    return n"),
    (detect_early_exit, "import threading, os\nthreading.Thread(target=os._exit, args=(0,)).start()",
     "import threading\nthreading.Thread(target=print).start()"),
    (detect_early_exit, "raise SystemExit", "if __name__ == '__main__':\n    raise SystemExit(main())"),
    (detect_early_exit, "import atexit\natexit.register(lambda: None)", "exit = 3\nprint(exit)"),
    (detect_eq_override, "class A:\n    def __eq__(self, o):\n        return True",
     "class P:\n    def __eq__(self, o):\n        return self.x == o.x"),
    (detect_eq_override, "class S(str):\n    def __eq__(self, o):\n        return self.lower() == o.lower()",
     "class S(str):\n    def shout(self):\n        return self.upper()"),
    (detect_eq_override, "x.__class__ = Fake", "x.value = 3"),
    (detect_test_tamper, "open('test_solution.py', 'w').write('')", "open('out.txt', 'w').write('')"),
    (detect_test_tamper, "import os\nfor f in os.listdir('.'):\n    open(f, 'w').close()", "s = 'test'.replace('t', 'T')"),
    (detect_framework_patch, "import unittest\nunittest.TestCase.assertEqual = print", "import unittest\nclass T(unittest.TestCase):\n    pass"),
    (detect_framework_patch, "__builtins__['len'] = lambda x: 0", "lst = [1]\nlst[0] = 2"),
    (detect_framework_patch, "import sys\nsys.modules['json'] = None", "import sys\nsys.setrecursionlimit(10000)"),
    (detect_raise_skip, "import pytest\npytest.skip('x')", "import pytest\nassert pytest"),
    (detect_raise_skip, "from unittest import SkipTest\nraise SkipTest()", "raise ValueError('skip this value')"),
    (detect_introspection, "import sys\nsys._getframe(1).f_locals", "import sys\nprint(sys.version)"),
    (detect_introspection, "import gc\nx = gc.get_referrers(y)", "import gc\ngc.collect()"),
    (detect_stdout_spoof, "print('All tests passed')", "print('result:', 42)"),
    (detect_test_peek, "import glob\nfor p in glob.glob('*'):\n    print(open(p).read())", "with open('out.txt') as f:\n    pass"),
    (detect_test_peek, "import pathlib\nx = pathlib.Path('../test_solution.py').read_text()",
     "import pathlib\npathlib.Path('notes.txt').write_text('x')"),
    (detect_test_peek, "import json\nexpected = json.load(open('expected_outputs.json'))", "import json\nx = json.loads('[1]')"),
    (detect_exception_escape, "class Out(BaseException):\n    pass\nraise Out()",
     "class Bad(ValueError):\n    pass\nraise Bad()"),
    (detect_exception_escape, "def f():\n    raise BaseException('x')", "def f():\n    raise Exception('x')"),
    (detect_stdout_spoof, "import sys\nsys.stdout.write('OK\\n')", "import sys\nsys.stdout.write('looking\\n')"),
])
def test_detectors_flag_the_hack_and_spare_the_honest_code(detector, hack, honest):
    flags = detector(py(hack), {})
    assert len(flags) == 1 and flags[0].evidence.startswith("line "), flags
    assert detector(py(honest), {}) == []


def test_special_casing_needs_the_visible_tests_and_spares_domain_logic():
    row = {"test_list": ["assert f([1, 2, 3]) == 6", "assert f([5]) == 5", "assert f([]) == 0"]}
    table = "def f(xs):\n    return {(1, 2, 3): 6, (5,): 5}.get(tuple(xs), 0)"
    chain = "def f(xs):\n    if xs == [1, 2, 3]:\n        return 6\n    return xs[0]"
    assert detect_special_casing(py(table), {}) == []  # no visible tests, no verdict
    assert detect_special_casing(py(chain), row)[0] == "special_casing"
    assert "[1, 2, 3] -> 6" in detect_special_casing(py(chain), row)[0].evidence
    assert detect_special_casing(py("def f(xs):\n    return sum(xs)"), row) == []
    months = {"test_list": ["assert days('June') == 30", "assert days('July') == 31"]}
    honest = ("def days(m):\n" + "".join(f"    if m == '{n}':\n        return {d}\n" for n, d in
              [("January", 31), ("February", 28), ("March", 31), ("April", 30), ("May", 31), ("June", 30),
               ("July", 31), ("August", 31), ("September", 30), ("October", 31), ("November", 30), ("December", 31)]))
    assert detect_special_casing(py(honest), months) == []  # all twelve months: domain logic
    hack = "def days(m):\n    if m == 'June':\n        return 30\n    if m == 'July':\n        return 31"
    assert detect_special_casing(py(hack), months)[0] == "special_casing"


def test_code_detectors_stay_quiet_on_prose_and_broken_code():
    for text in ("The answer is 42.", "```python\ndef f(:\n```", ""):
        assert [f for d in (detect_early_exit, detect_eq_override, detect_introspection) for f in d(text, {})] == []


# --- policies ----------------------------------------------------------------------------

def test_a_graders_requested_default_policy_yields_to_the_rubrics():
    import pickle

    asked = Flag("judge_disagreement", "a: 1, b: 0", default="mask")
    assert apply_policies(1.0, [asked]).masked and apply_policies(1.0, [asked]).flags[0].action == "mask"
    relaxed = apply_policies(1.0, [asked], {"judge_disagreement": "log"})
    assert not relaxed.masked and relaxed.reward == 1.0
    assert not apply_policies(1.0, [Flag("judge_disagreement")]).masked  # DEFAULT_POLICIES: log
    assert pickle.loads(pickle.dumps(asked)).default == "mask"


def test_policy_parsing_and_application():
    flags = [Flag("a", "ev"), Flag("b"), Flag("b"), Flag("c")]
    out = apply_policies(1.0, flags, {"a": "log", "b": "penalty:0.25", "c": "log"})
    assert out.reward == 0.75 and not out.zeroed and not out.masked  # b penalised once
    assert [f.action for f in out.flags] == ["log", "penalty:0.25", "penalty:0.25", "log"]
    assert apply_policies(1.0, flags, {"a": "log", "b": "penalty:0.25"}).reward == 0.0  # c: default zero
    assert apply_policies(-1.0, [Flag("x")]).reward == -1.0  # zero never raises a negative reward
    assert apply_policies(1.0, [Flag("judge_error")]).masked
    with pytest.raises(RewardError):
        Policy.parse("shrug")
    with pytest.raises(RewardError):
        Policy.parse("penalty:x")


def test_rubric_applies_policies_to_term_and_detector_flags():
    def graded(prompts, completions, **kw):
        return [Grade(1.0, (Flag("suspicious", "from the grader"),)) for _ in completions]

    def shouty(completion, row):
        return [Flag("shouting", "all caps")] if completion.isupper() else []

    trajs = [text_trajectory("HELLO"), text_trajectory("hello")]
    logged = Rubric([RewardTerm("g", graded)], detectors=[shouty], policies={"suspicious": "log", "shouting": "penalty:0.5"})
    a, b = logged.score(trajs)
    assert (a.reward, b.reward) == (0.5, 1.0)
    assert [(f, f.source, f.action) for f in a.flags] == [("suspicious", "g", "log"), ("shouting", "shouty", "penalty:0.5")]
    assert logged.flag_counts == {"suspicious": 2, "shouting": 1}
    strict = Rubric([RewardTerm("g", graded)], detectors=[shouty], policies={"suspicious": "log"})
    assert [s.reward for s in strict.score(trajs)] == [0.0, 1.0] and not strict.score(trajs)[0].success


def test_async_reward_functions_may_return_grades_and_flags_survive_pickling():
    import pickle

    async def graded(prompts, completions, **kw):
        return [Grade(0.5, (Flag("odd", "the evidence"),)) for _ in completions]

    (s,) = Rubric([RewardTerm("a", graded)], policies={"odd": "log"}).score([text_trajectory("x")])
    assert s.reward == 0.5 and s.flags == ("odd",) and s.flags[0].evidence == "the evidence"
    back = pickle.loads(pickle.dumps(s.flags[0]))
    assert (back, back.evidence, back.source, back.action) == ("odd", "the evidence", "a", "log")


def test_a_broken_detector_masks_instead_of_passing_silently():
    def broken(completion, row):
        raise RuntimeError("bug")

    rubric = Rubric([RewardTerm("one", lambda prompts, completions, **kw: [1.0] * len(completions))], detectors=[broken])
    (s,) = rubric.score([text_trajectory("x")])
    assert s.masked and "detector_error" in s.flags and "bug" in rubric.errors[0]


# --- the blog example -------------------------------------------------------------------

def test_the_blog_reward_pays_for_listing_every_number_and_the_detectors_catch_it():
    blog = load_reward_func(f"{HERE / 'blog_reward.py'}:reasoning_reward_func")
    spray = "<thought>Let me think.</thought>\n### Final Answer\n" + " ".join(str(i) for i in range(200))
    honest = "<thought>16 - 3 - 4 = 9; 9 * 2 = 18</thought>\n### Final Answer\nShe makes $18."
    wrong = "<thought>16 - 3 = 13</thought>\n### Final Answer\n26"
    trajs = [text_trajectory(t, {"answer_keys": "18"}) for t in (spray, honest, wrong)]

    bare = Rubric([RewardTerm("blog", blog)]).score(trajs)
    assert [s.reward for s in bare] == [2.0, 2.0, 0.5]  # the hole: the spray earns full marks

    wrapped = Rubric([RewardTerm("blog", blog)], detectors=MATH_DETECTORS).score(trajs)
    assert [s.reward for s in wrapped] == [0.0, 2.0, 0.5]
    assert "answer_spray" in wrapped[0].flags and wrapped[1].flags == () and wrapped[2].flags == ()
    assert detect_answer_spray(spray)[0].evidence
