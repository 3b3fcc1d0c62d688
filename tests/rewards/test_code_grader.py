"""Code grader: real sandbox runs, host-side comparison, one process per test."""

import json
import time

import pytest

from actloop.rewards import RewardTerm, Rubric
from actloop.rewards.code import CodeGrader, Opaque, decode, extract_code, parse_test, run_tests
from actloop.rewards.code import tests_from_row as row_tests
from actloop.rewards.rubric import text_trajectory
from actloop.tasks.registry import find_row, grade_rows, resolve
from actloop.sandbox import ExecResult, probe_bwrap


@pytest.fixture(scope="module", autouse=True)
def _needs_sandbox():
    status = probe_bwrap()
    if not status.available:
        pytest.skip(f"the code grader's tests run in the bwrap sandbox: {status.reason}")


def py(code):
    return f"```python\n{code}\n```"


def grade(code, row, **kw):
    return CodeGrader(**kw).grade(py(code), row)


ROW = {"test_list": ["assert f(3) == [1, 2, 3]", "assert f(0) == []", "assert f(1) == [1]"], "code": "def f(n): ..."}


@pytest.mark.data("mbpp")
def test_mbpp_reference_solutions_score_full_marks():
    mbpp = resolve("mbpp")
    report = mbpp.rubric().validate(grade_rows(mbpp), mbpp.gold, n=6, seed=1)
    assert report.ok and report.checked == 6, str(report)


def test_pass_counts_partial_credit_and_all_or_nothing():
    right = "def f(n):\n    return list(range(1, n + 1))"
    off_by_one = "def f(n):\n    return list(range(1, n + 1)) if n else [0]"
    g = grade(right, ROW)
    assert (g.score, g.info["passed"], g.info["total"], g.flags) == (1.0, 3, 3, ())
    g = grade(off_by_one, ROW)
    assert g.score == pytest.approx(2 / 3) and not g.flags
    assert grade(off_by_one, ROW, all_or_nothing=True).score == 0.0
    assert [t["passed"] for t in g.info["tests"]] == [True, False, True]


def test_exit_code_zero_and_printed_success_mean_nothing():
    code = "import sys\nprint('3 passed, 0 failed')\nprint('OK')\ndef f(n):\n    return None\nsys.stdout.flush()"
    report = run_tests(code, row_tests(ROW)[0])
    assert report.passed == 0 and report.total == 3
    assert {r.error for r in report.results} == {"wrong value"}


def test_syntax_errors_and_crashes_fail_without_flags():
    g = grade("def f(n) return n", ROW)
    assert g.score == 0.0 and not g.flags and "SyntaxError" in g.info["tests"][0]["error"]
    g = grade("def f(n):\n    return [1] * (10 // n)", ROW)  # ZeroDivisionError on f(0)
    assert g.info["passed"] == 0 and "ZeroDivisionError" in g.info["tests"][1]["error"]


def test_an_escaping_base_exception_fails_and_is_flagged_at_run_time():
    code = "class Out(BaseException):\n    pass\ndef f(n):\n    raise Out('past except Exception')"
    g = grade(code, ROW)
    assert g.score == 0.0 and g.flags == ("exception_escape",) and "Out: past except Exception" in g.flags[0].evidence
    g = grade("def f(n):\n    raise ValueError(n)", ROW)  # an ordinary error fails without a flag
    assert g.score == 0.0 and not g.flags


def test_an_endless_loop_times_out_per_test_and_fails():
    t0 = time.monotonic()
    g = grade("def f(n):\n    while True:\n        pass", {"test_list": ["assert f(1) == 1"]}, per_test_timeout_s=1.0)
    assert g.score == 0.0 and g.info["tests"][0]["error"] in ("timed out", "CPU time limit")
    assert time.monotonic() - t0 < 8


def test_the_expected_value_never_enters_the_sandbox():
    t = parse_test("assert similar((3, 4), (4, 5)) == (987654321,)")
    assert t.probes == ("similar((3, 4), (4, 5))",)
    assert "987654321" not in json.dumps(t.probes) and t.check == "__p0 == (987654321,)"
    # wrappers made of builtins are computed on the host, only the candidate's call is probed
    t = parse_test("assert set(f([1, 2])) == set([2, 1]) and math.isclose(g(1), 0.5)")
    assert t.probes == ("f([1, 2])", "g(1)")


def test_candidate_builtins_cannot_reach_the_host_side_check():
    row = {"test_list": ["assert set(f(3)) == set([1, 2])", "assert sorted(f(3)) == [1, 1, 2]"], "code": "def f(n): ..."}
    hijack = "set = lambda *a: 0\nsorted = lambda *a: [1, 1, 2]\ndef f(n):\n    return [9]"
    assert grade(hijack, row).info["passed"] == 0
    assert grade("def f(n):\n    return [2, 1, 1]", row).score == 1.0


@pytest.mark.data("mbpp")
def test_reference_names_that_shadow_builtins_run_in_the_sandbox():
    mbpp = resolve("mbpp")
    row = find_row(mbpp, 126, grade_rows(mbpp))  # the task's function is called `sum`
    assert parse_test(row["test_list"][0]).probes == ()  # alone, `sum` is the builtin ...
    assert row_tests(row)[0][0].probes == ("sum(10, 15)",)  # ... but the task defines it
    assert CodeGrader().grade(mbpp.gold(row), row).score == 1.0


def test_stdlib_values_round_trip_and_compare_like_python():
    row = {"test_list": ["assert a() == {'x': 2}", "assert b() == (1, 2)", "assert c() == 0.5",
                         "assert d() == 3", "assert e() == [1.5, None, True, 'é', b'z', frozenset({1})]"]}
    code = ("import collections, enum, fractions\n"
            "def a(): return collections.Counter('xx')\n"
            "P = collections.namedtuple('P', 'x y')\n"
            "def b(): return P(1, 2)\n"
            "def c(): return fractions.Fraction(1, 2)\n"
            "class Color(enum.IntEnum):\n    BLUE = 3\n"
            "def d(): return Color.BLUE\n"
            "def e(): return [1.5, None, True, 'é', b'z', frozenset({1})]")
    g = grade(code, row)
    assert g.score == 1.0, g.info["tests"]


def test_objects_of_candidate_classes_are_opaque_and_fail():
    row = {"test_list": ["assert f() == 5", "assert f() != 5", "assert f()"]}
    g = grade("class N(int):\n    def __ne__(self, o): return True\n    def __bool__(self): return True\n"
              "def f():\n    return N(5)", row)
    assert g.info["passed"] == 0 and "opaque_return" in g.flags
    with pytest.raises(Exception, match="only builtin values"):
        bool(decode(["opaque", "x.N"]))
    assert isinstance(decode(["opaque", "x.N"]), Opaque)


def test_candidate_cannot_read_the_harness_process():
    # the harness is non-dumpable: its environ, memory and fds are out of reach of the
    # candidate, which runs as the same uid
    row = {"test_list": ["assert probe() == 'denied'"]}
    code = ("import os\n"
            "def probe():\n"
            "    try:\n"
            "        open(f'/proc/{os.getppid()}/environ', 'rb').read()\n"
            "        return 'read'\n"
            "    except OSError:\n"
            "        return 'denied'")
    assert grade(code, row).score == 1.0


def test_hook_files_do_not_apply_to_later_tests_and_are_reported():
    row = {"test_list": ["assert f() == 1", "assert f() == 2"]}
    # the user site directory is writable in the sandbox (HOME is the work dir): a plain
    # `python` would run usercustomize.py and .pth files from it at the next start
    code = ("import builtins, os, sys\n"
            "hook = 'import builtins; builtins.HOOKED = 1'\n"
            "user_site = os.path.expanduser('~/.local/lib/python%d.%d/site-packages' % sys.version_info[:2])\n"
            "os.makedirs(user_site, exist_ok=True)\n"
            "for d in (os.getcwd(), os.path.dirname(os.getcwd()), user_site):\n"
            "    open(os.path.join(d, 'sitecustomize.py'), 'w').write(hook)\n"
            "    open(os.path.join(d, 'usercustomize.py'), 'w').write(hook)\n"
            "    open(os.path.join(d, 'a.pth'), 'w').write(hook + '\\n')\n"
            "def f():\n"
            "    return 2 if hasattr(builtins, 'HOOKED') else 1")
    g = grade(code, row)
    assert [t["passed"] for t in g.info["tests"]] == [True, False]
    assert "grader_hooks" in g.flags and "sitecustomize.py" in g.flags[0].evidence


def test_processes_a_test_leaves_behind_are_killed_before_the_next_test():
    # test 0 leaves a double-forked daemon that, 0.3 s later, would change what f() sees
    code = ("import os, time\n"
            "root = os.path.dirname(os.getcwd())\n"
            "def f():\n"
            "    return os.path.exists(os.path.join(root, 'flag'))\n"
            "if not os.path.exists(os.path.join(root, 'started')):\n"
            "    open(os.path.join(root, 'started'), 'w').close()\n"
            "    if os.fork() == 0:\n"
            "        os.setsid()\n"
            "        if os.fork() == 0:\n"
            "            time.sleep(0.3)\n"
            "            open(os.path.join(root, 'flag'), 'w').close()\n"
            "            time.sleep(30)\n"
            "        os._exit(0)\n")
    row = {"test_list": ["assert f() == False", "assert __import__('time').sleep(0.6) is None", "assert f() == False"]}
    assert [t["passed"] for t in grade(code, row).info["tests"]] == [True, True, True]


def test_tampering_with_the_harness_is_detected_by_hash():
    code = ("import os\n"
            "p = os.path.join(os.path.dirname(os.getcwd()), 'harness.py')\n"
            "open(p, 'a').write('# changed')\n"
            "def f(n):\n    return list(range(1, n + 1))")
    g = grade(code, ROW)
    assert "grader_tamper" in g.flags and "harness.py" in g.flags[0].evidence


def test_humaneval_style_rows():
    row = {"entry_point": "add", "test": ("import math\nMETADATA = {}\n\ndef check(candidate):\n"
                                          "    assert candidate(1, 2) == 3\n"
                                          "    assert abs(candidate(0.1, 0.2) - 0.3) < 1e-9\n")}
    assert grade("def add(a, b):\n    return a + b", row).score == 1.0
    assert grade("def add(a, b):\n    return a - b", row).score == 0.0
    # an object whose __sub__ returns 0 cannot fake the tolerance check: the subtraction is on the host
    cheat = "class Z:\n    def __sub__(self, o): return 0.0\n    def __eq__(self, o): return True\ndef add(a, b):\n    return Z()"
    assert grade(cheat, row).score == 0.0


def test_batches_run_concurrently_and_keep_their_order():
    comps = [py("def f(n):\n    return list(range(1, n + 1))"), py("def f(n):\n    return []"), "no code at all"]
    out = CodeGrader(max_workers=2)([[]] * 3, comps, **{k: [v] * 3 for k, v in ROW.items()})
    assert [g.info["passed"] for g in out] == [3, 1, 0]


def test_a_sandbox_that_cannot_start_masks_the_grade_instead_of_zeroing_it():
    class Broken:
        tier, isolated = "bwrap", True

        def run(self, *a, **kw):
            return ExecResult("", "", 1, False, False, 0.0, "bwrap", error="cannot create namespace")

    rubric = Rubric([RewardTerm("tests", CodeGrader(sandbox=Broken()))])
    (s,) = rubric.score([text_trajectory(py("def f(n): return []"), ROW)])
    assert s.masked and "sandbox_error" in s.flags and "tests" not in s.components


def test_extract_code():
    assert extract_code("Here:\n```python\ndef f(): pass\n```\nand\n```py\nx = 1\n```") == "def f(): pass\n\nx = 1\n"
    assert extract_code("```\nprint(1)\n```") == "print(1)\n"
    assert extract_code("def f(): pass") == "def f(): pass"
