"""Code grader (MBPP / HumanEval style): candidate code runs in the sandbox, values come back as
type-tagged canonical JSON, and every comparison happens on the host.

How one test is graded. ``assert similar([1, 2], [2, 3]) == (2,)`` is split on the host:
the parts that need the candidate — here ``similar([1, 2], [2, 3])`` — become *probes*,
evaluated in the sandbox; what remains, ``__p0 == (2,)``, is evaluated on the host over the
decoded values (pure builtins: no candidate class can reach the host, so no ``__eq__`` of
the candidate's ever runs there). The expected value never enters the sandbox.

What does not count as passing: an exit code of 0, anything the candidate prints (results are
read only from lines carrying a per-run nonce that the candidate cannot read), a skipped,
crashed, timed-out or missing test (each is a failure), an object of a class of the
candidate's (``opaque``: it cannot be compared, the test fails, ``opaque_return`` is flagged).
Each test runs in a fresh ``python -I -S`` process (no ``sitecustomize``, ``.pth`` or
``conftest.py`` can apply), protected files are hashed before and after each test, and
hook files written anywhere in the work directory are reported. See `_harness.py`.

Reward: passed / total over the visible tests and the held-out ones (MBPP's
``challenge_test_list``, when the row has them); `all_or_nothing=True` gives 1.0 only when all
pass. Runtime flags: ``early_exit``, ``raise_skip``, ``exception_escape`` (a ``BaseException``
that is neither an exit nor a skip), ``opaque_return``, ``grader_tamper``,
``grader_hooks``, ``result_forgery``, ``harness_killed``, ``heldout_gap`` (log-only by default),
``sandbox_error`` (masks). Static hack detectors live in `actloop.rewards.hacking`.

Differential testing: with a reference solution (`CodeGrader(reference=...)`) the candidate
also runs on inputs mutated from the tests' arguments — one more process in the same sandbox
run — and is compared with the reference's outputs on the host (`differential` component,
``differential_mismatch`` flag with a counter-example; see `actloop.rewards.differential`).
"""

from __future__ import annotations

import ast
import builtins
import collections
import dataclasses
import decimal
import fractions
import hashlib
import json
import math
import re
import secrets
import sys
import threading
import types
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from actloop.rewards import _harness, differential
from actloop.rewards.base import RewardError
from actloop.rewards.differential import DiffSettings, Oracle
from actloop.rewards.flags import Flag, Grade
from actloop.sandbox import Limits, Sandbox, get_sandbox

# --- the code in a completion ------------------------------------------------------------

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)


def extract_code(text: str) -> str:
    """The Python code of a completion: the ```python (or ```py) fenced blocks joined in
    order; else untagged fenced blocks; else the whole text."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(text)]
    py = [b for lang, b in blocks if lang in ("python", "py", "python3")]
    if not py:
        py = [b for lang, b in blocks if not lang]
    return "\n".join(py) if py else text


def quiet_parse(code: str) -> ast.Module:
    """ast.parse without the SyntaxWarnings of other people's code (invalid escapes...)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ast.parse(code)


# --- splitting a test into sandbox probes and a host-side check ---------------------------

_SAFE_BUILTINS = {
    n: getattr(builtins, n)
    for n in ("abs all any bool bytes complex dict divmod enumerate filter float frozenset int isinstance "
              "len list map max min pow range reversed round set sorted str sum tuple zip type "
              "True False None").split()
}
_SAFE_MODULES: dict[str, Any] = {
    "math": math,
    "cmath": __import__("cmath"),
    "re": re,
    "collections": collections,
    "fractions": fractions,
    "decimal": decimal,
    "sys": types.SimpleNamespace(getsizeof=sys.getsizeof, maxsize=sys.maxsize, float_info=sys.float_info),
}
HOST_NAMES = frozenset(_SAFE_BUILTINS) | frozenset(_SAFE_MODULES)


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


class _Split(ast.NodeTransformer):
    """Replace each smallest sub-expression that needs the candidate by a placeholder."""

    def __init__(self, host_names: frozenset[str] = HOST_NAMES) -> None:
        self.probes: list[str] = []
        self.host = host_names

    def _probe(self, node: ast.expr) -> ast.Name:
        self.probes.append(ast.unparse(node))
        return ast.copy_location(ast.Name(f"__p{len(self.probes) - 1}", ast.Load()), node)

    def _sandboxed(self, node: ast.AST) -> bool:
        return any(isinstance(n, ast.Name) and n.id not in self.host for n in ast.walk(node))

    def visit_Call(self, node: ast.Call) -> ast.AST:
        root = _root(node.func)
        if root is not None and root not in self.host:
            return self._probe(node)
        return self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        root = _root(node)
        if root is not None and root not in self.host:
            return self._probe(node)
        return self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> ast.AST:
        return self.visit_Attribute(node)  # type: ignore[arg-type]

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return self._probe(node) if node.id not in self.host else node

    def _scoped(self, node: ast.expr) -> ast.AST:
        # comprehension variables and lambda arguments cannot be split across processes
        return self._probe(node) if self._sandboxed(node) else node

    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = visit_Lambda = _scoped  # type: ignore[assignment]


@dataclass(frozen=True)
class TestCase:
    """One assert: its source, the probes the sandbox evaluates, and the host-side check."""

    __test__ = False  # not a pytest class
    source: str
    probes: tuple[str, ...]
    check: str  # the assert's expression with probes replaced by __p0, __p1, ...
    hidden: bool = False  # a held-out test (not shown in the prompt)

    def evaluate(self, values: Sequence[Any]) -> bool:
        env: dict[str, Any] = {"__builtins__": _SAFE_BUILTINS, **_SAFE_MODULES}
        env.update({f"__p{i}": v for i, v in enumerate(values)})
        return bool(eval(compile(self.check, "<check>", "eval"), env))  # dataset-authored code, pure values


def parse_test(source: str, hidden: bool = False, rename: Mapping[str, str] | None = None,
               task_names: frozenset[str] = frozenset()) -> TestCase:
    """`assert <expr>[, msg]` -> TestCase. `rename` maps names (HumanEval's `candidate`);
    `task_names` are names the task's reference solution defines: always evaluated in the
    sandbox, even where they shadow a builtin (MBPP task 126 defines `sum`)."""
    try:
        mod = ast.parse(source.strip())
    except SyntaxError as e:
        raise RewardError(f"test {source!r:.120} does not parse: {e}") from None
    if len(mod.body) != 1 or not isinstance(mod.body[0], ast.Assert):
        raise RewardError(f"test {source!r:.120} must be a single assert statement")
    expr = mod.body[0].test
    if rename:
        for n in ast.walk(expr):
            if isinstance(n, ast.Name) and n.id in rename:
                n.id = rename[n.id]
    split = _Split(HOST_NAMES - task_names)
    check = split.visit(expr)
    return TestCase(source.strip(), tuple(split.probes), ast.unparse(check), hidden)


def tests_from_row(row: Mapping[str, Any]) -> tuple[list[TestCase], str]:
    """(tests, setup code) from an MBPP row (`test_list`, `challenge_test_list`,
    `test_setup_code`, `test_imports`) or a HumanEval row (`test` with `check(candidate)`,
    `entry_point`)."""
    names = task_names(row)
    if "test_list" in row:
        tests = [parse_test(t, task_names=names) for t in row["test_list"] or []]
        tests += [parse_test(t, hidden=True, task_names=names) for t in row.get("challenge_test_list") or []]
        setup = "\n".join(list(row.get("test_imports") or []) + [row.get("test_setup_code") or ""])
        return tests, setup.replace("\r\n", "\n")
    if "test" in row and "entry_point" in row:
        return tests_from_check(row["test"], row["entry_point"])
    raise RewardError("a code row needs `test_list` (MBPP) or `test` and `entry_point` (HumanEval)")


def task_names(row: Mapping[str, Any]) -> frozenset[str]:
    """Module-level names of the row's reference solution (`code`), and its `entry_point`.

    Only these may shadow a builtin in a test: a candidate that defines its own `set` or
    `sorted` does not move the test's `set(f(x)) == set(y)` into its process."""
    names = {row["entry_point"]} if isinstance(row.get("entry_point"), str) else set()
    try:
        tree = quiet_parse(str(row.get("code") or ""))
    except SyntaxError:
        return frozenset(names)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return frozenset(names)


def tests_from_check(test_src: str, entry_point: str) -> tuple[list[TestCase], str]:
    """HumanEval: the asserts of `def check(candidate)` become tests (``candidate`` is the
    entry point); the module's other top-level statements and check's non-assert statements
    (imports, helper functions, constants) become the setup code run in the sandbox."""
    mod = ast.parse(test_src)
    setup: list[str] = []
    tests: list[TestCase] = []
    for node in mod.body:
        if isinstance(node, ast.FunctionDef) and node.name == "check":
            for st in node.body:
                if isinstance(st, ast.Assert):
                    tests.append(parse_test(ast.unparse(st), rename={"candidate": entry_point},
                                            task_names=frozenset({entry_point})))
                elif isinstance(st, (ast.Import, ast.ImportFrom, ast.Assign, ast.FunctionDef, ast.Expr)):
                    if isinstance(st, ast.Expr) and not isinstance(st.value, ast.Constant):
                        raise RewardError(f"unsupported statement in check(): {ast.unparse(st)[:80]}")
                    setup.append(ast.unparse(st))
                else:
                    raise RewardError(f"unsupported statement in check() (only asserts and setup): "
                                      f"{ast.unparse(st)[:80]}")
        else:
            setup.append(ast.unparse(node))
    if not tests:
        raise RewardError("check(candidate) has no assert to grade")
    return tests, "\n".join(setup)


# --- values back from the sandbox -------------------------------------------------------

class OpaqueValue(Exception):
    """A test touched an object of a class the candidate defined (or any non-builtin)."""


class Opaque:
    """Stands for a value the sandbox could not serialise as builtin data. Any comparison,
    truth test, hash or attribute raises, so a test that uses it fails."""

    __slots__ = ("type_name",)

    def __init__(self, type_name: str) -> None:
        object.__setattr__(self, "type_name", type_name)

    def _refuse(self, *a: Any) -> Any:
        raise OpaqueValue(f"the candidate returned a {self.type_name} object; only builtin values can be graded")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = __hash__ = __len__ = __iter__ = _refuse
    __contains__ = __add__ = __radd__ = __sub__ = __rsub__ = __getitem__ = __float__ = __int__ = _refuse

    def __getattr__(self, name: str) -> Any:
        self._refuse()

    def __repr__(self) -> str:
        return f"<opaque {self.type_name}>"


def decode(tagged: Any) -> Any:
    """Type-tagged canonical JSON -> a value built only from builtin (and stdlib) types."""
    tag, *rest = tagged
    if tag == "none":
        return None
    if tag == "bool":
        return bool(rest[0])
    if tag == "int":
        return int(rest[0])
    if tag == "float":
        return float(rest[0])
    if tag == "complex":
        return complex(float(rest[0]), float(rest[1]))
    if tag == "str":
        return str(rest[0])
    if tag == "bytes":
        return bytes.fromhex(rest[0])
    if tag == "list":
        return [decode(x) for x in rest[0]]
    if tag == "tuple":
        return tuple(decode(x) for x in rest[0])
    if tag == "dict":
        return {decode(k): decode(v) for k, v in rest[0]}
    if tag == "set":
        return {decode(x) for x in rest[0]}
    if tag == "frozenset":
        return frozenset(decode(x) for x in rest[0])
    if tag == "deque":
        return collections.deque(decode(x) for x in rest[0])
    if tag == "range":
        return range(int(rest[0]), int(rest[1]), int(rest[2]))
    if tag == "fraction":
        return fractions.Fraction(int(rest[0]), int(rest[1]))
    if tag == "decimal":
        return decimal.Decimal(rest[0])
    if tag == "opaque":
        return Opaque(str(rest[0]))
    raise ValueError(f"unknown value tag {tag!r}")


def _opaque_names(tagged: Any) -> list[str]:
    if not isinstance(tagged, list) or not tagged:
        return []
    if tagged[0] == "opaque":
        return [str(tagged[1])]
    out: list[str] = []
    for part in tagged[1:]:
        if isinstance(part, list):
            for x in part:
                out += _opaque_names(x) if isinstance(x, list) else []
    return out


# --- running the tests ------------------------------------------------------------------

@dataclass(frozen=True)
class TestResult:
    __test__ = False
    test: TestCase
    passed: bool
    error: str = ""  # why it failed ("" when it passed)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"test": self.test.source, "hidden": self.test.hidden, "passed": self.passed, "error": self.error}


@dataclass(frozen=True)
class Batch:
    """Many probes evaluated in one process (differential testing's generated inputs), each
    with its own time limit and a budget for them all."""

    probes: tuple[str, ...]
    probe_timeout_s: float
    budget_s: float


@dataclass(frozen=True)
class BatchResult:
    """Per probe ``{"ok": tagged value}`` or ``{"err", "kind"}``; `values` is None when the
    process did not report (`error` says why)."""

    values: list[dict[str, Any]] | None
    error: str = ""
    seconds: float = 0.0  # the process's wall time


@dataclass(frozen=True)
class TestReport:
    __test__ = False
    results: tuple[TestResult, ...]
    flags: tuple[Flag, ...] = ()
    sandbox_error: str | None = None
    tier: str = ""
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    batches: tuple[BatchResult, ...] = ()

    @property
    def passed(self) -> int:
        return sum(r.passed for r in self.results)

    @property
    def total(self) -> int:
        return len(self.results)


HARNESS_FILE = "harness.py"
_SKIP_KIND, _EXIT_KIND, _ESCAPE_KIND = "skip", "exit", "escape"


_BATCH_GRACE_S = 1.5  # a batch's process may run this much past its budget before it is killed


def _limits(n_tests: int, per_test_s: float, memory_mb: int, batches: Sequence[Batch] = ()) -> Limits:
    batch_s = [b.budget_s + _BATCH_GRACE_S for b in batches]
    return Limits(timeout_s=n_tests * (per_test_s + 0.5) + sum(batch_s) + 3.0,
                  cpu_s=max([per_test_s, *batch_s]), memory_mb=memory_mb,
                  max_procs=64, tmpfs_mb=32, max_output_bytes=1 << 20)


def run_tests(
    code: str,
    tests: Sequence[TestCase],
    setup: str = "",
    sandbox: Sandbox | None = None,
    per_test_timeout_s: float = 5.0,
    memory_mb: int = 512,
    batches: Sequence[Batch] = (),
) -> TestReport:
    """Run every test of `tests` on `code` in the sandbox, each in its own process, and compare
    on the host. Never raises for what the candidate does; a sandbox that cannot start gives
    `sandbox_error` (the grade is then masked, not zero).

    `batches` run in the same sandbox run after the tests, one process each; their raw
    per-probe results come back in `TestReport.batches` for the caller to compare.

    If the harness dies before the end (not at the deadline) the run is repeated once: a
    candidate that kills it does so again (`harness_killed`), a host-side hiccup does not."""
    sandbox = sandbox or default_sandbox()
    limits = _limits(len(tests), per_test_timeout_s, memory_mb, batches)
    for attempt in range(2):
        run = _run_harness(code, tests, setup, sandbox, per_test_timeout_s, limits, batches)
        if isinstance(run, TestReport):
            return run
        res, ready, records, done = run
        if done or res.timed_out:
            break
    results, flags = [], []
    for i, test in enumerate(tests):
        got = records.get(i, [])
        if len(got) != 1:
            results.append(TestResult(test, False, "no result" if not got else "duplicate result"))
            continue
        tr, fl = _judge_record(test, got[0], i)
        flags += fl
        results.append(tr)
    batch_results = []
    for j in range(len(batches)):
        got = records.get(len(tests) + j, [])
        if len(got) != 1:
            batch_results.append(BatchResult(None, "no result" if not got else "duplicate result"))
            continue
        br, fl = _batch_record(got[0], len(tests) + j, len(batches[j].probes))
        flags += fl
        batch_results.append(br)
    n_runs = len(tests) + len(batches)
    if not done and not res.timed_out:
        why = (res.stderr.strip().splitlines() or [""])[-1][:200]
        flags.append(Flag("harness_killed", f"the grading harness stopped after {len(records)} of {n_runs} "
                                            f"tests, twice (exit {res.exit_code}) {why}".strip()))
    visible = [r for r in results if not r.test.hidden]
    hidden = [r for r in results if r.test.hidden]
    if hidden and visible and all(r.passed for r in visible) and not all(r.passed for r in hidden):
        flags.append(Flag("heldout_gap", f"visible tests {len(visible)}/{len(visible)}, held-out "
                                         f"{sum(r.passed for r in hidden)}/{len(hidden)}"))
    return TestReport(tuple(results), tuple(_dedupe(flags)), tier=res.tier, seconds=res.duration_s,
                      extra={"attempts": attempt + 1}, batches=tuple(batch_results))


def _run_harness(code: str, tests: Sequence[TestCase], setup: str, sandbox: Sandbox, per_test_timeout_s: float,
                 limits: Limits, batches: Sequence[Batch] = ()
                 ) -> TestReport | tuple[Any, dict[str, Any], dict[int, list[dict[str, Any]]], bool]:
    """One sandbox run: (result, ready record, records by test, done) or a sandbox-error report.
    Records of batch j are numbered len(tests) + j."""
    nonce = secrets.token_hex(16)
    job = {
        "nonce": nonce, "code": code, "setup": setup, "child": _harness.CHILD, "module_name": "solution",
        "tests": [list(t.probes) for t in tests] + [list(b.probes) for b in batches],
        "timeouts": [per_test_timeout_s] * len(tests) + [b.budget_s + _BATCH_GRACE_S for b in batches],
        "batch": [None] * len(tests) + [{"probe_timeout": b.probe_timeout_s, "budget": b.budget_s} for b in batches],
        "protected": [HARNESS_FILE], "own_pid_namespace": getattr(sandbox, "tier", "") in ("bwrap", "docker"),
    }
    res = sandbox.run(argv=["python", "-I", HARNESS_FILE], files={HARNESS_FILE: _harness.PARENT},
                      stdin=json.dumps(job), limits=limits)

    def failed(why: str) -> TestReport:
        return TestReport(tuple(TestResult(t, False, "not graded") for t in tests), sandbox_error=why,
                          tier=res.tier, seconds=res.duration_s,
                          batches=tuple(BatchResult(None, "not run") for _ in batches))

    if res.error:
        return failed(res.error)
    records: dict[int, list[dict[str, Any]]] = {}
    ready: dict[str, Any] | None = None
    done = False
    for line in res.stdout.splitlines():
        if not line.startswith(nonce + " "):
            continue  # the candidate's output, or forged lines: never read
        try:
            rec = json.loads(line[len(nonce) + 1:])
        except ValueError:
            continue
        if rec.get("ready"):
            ready = rec
        elif rec.get("done"):
            done = True
        elif isinstance(rec.get("i"), int):
            records.setdefault(rec["i"], []).append(rec)
    if ready is None:
        why = (res.stderr.strip().splitlines() or [f"exit {res.exit_code}"])[-1][:300]
        return failed(f"the grading harness did not start: {why}")
    if ready["hashes"].get(HARNESS_FILE) != _HARNESS_SHA:  # only a broken sandbox could do this
        return failed("the harness in the sandbox is not the one we sent")
    return res, ready, records, done


_HARNESS_SHA = hashlib.sha256(_harness.PARENT.encode()).hexdigest()


def _dedupe(flags: list[Flag]) -> list[Flag]:
    seen: dict[str, Flag] = {}
    for f in flags:
        seen.setdefault(str(f), f)
    return list(seen.values())


def _channel_flags(r: Mapping[str, Any], i: int, oversize_is_forgery: bool = True) -> tuple[list[Flag], bool]:
    """Flags any record can raise (tampering, hooks, a forged result channel), and whether the
    result channel is to be trusted."""
    flags: list[Flag] = []
    if r.get("tampered"):
        flags.append(Flag("grader_tamper", f"test {i}: protected files changed: {r['tampered']}"))
    if r.get("hooks"):
        flags.append(Flag("grader_hooks", f"test {i}: wrote {r['hooks'][:5]}"))
    if not oversize_is_forgery and r.get("oversize") and r.get("messages", 0) <= 1:
        return flags, False  # a batch's many values can be large without forging anything
    if r.get("messages", 0) > 1 or r.get("bad_message") or r.get("oversize"):
        flags.append(Flag("result_forgery", f"test {i}: {r.get('messages')} messages on the result channel "
                                            "(the harness writes exactly one)"))
        return flags, False
    return flags, True


def _batch_record(r: Mapping[str, Any], i: int, n_probes: int) -> tuple[BatchResult, list[Flag]]:
    flags, trusted = _channel_flags(r, i, oversize_is_forgery=False)
    if not trusted:
        return BatchResult(None, "result too large" if not flags else "result channel tampered with"), flags
    if r.get("timeout"):
        return BatchResult(None, "timed out (the whole batch)"), flags
    res = r.get("result")
    if res is None:
        if r.get("rc") != -24:  # SIGXCPU is the CPU limit, not an exit
            flags.append(Flag("early_exit", f"test {i}: the process ended (exit {r.get('rc')}) before the harness "
                                            "reported"))
        return BatchResult(None, f"no result (exit {r.get('rc')})"), flags
    for stage in ("load_error", "setup_error"):
        if stage in res:
            flags += _error_flags(res[stage], i)
            return BatchResult(None, f"{stage.replace('_', ' ')}: {res[stage].get('err', '')}"), flags
    vals = res.get("values")
    if not isinstance(vals, list) or len(vals) != n_probes or not all(isinstance(v, dict) for v in vals):
        flags.append(Flag("result_forgery", f"test {i}: malformed result message"))
        return BatchResult(None, "malformed result"), flags
    for v in vals:
        if "ok" not in v and v.get("kind") in (_EXIT_KIND, _SKIP_KIND, _ESCAPE_KIND):
            flags += _error_flags(v, i)
    return BatchResult(vals, seconds=float(r.get("seconds", 0.0))), flags


def _judge_record(test: TestCase, r: Mapping[str, Any], i: int) -> tuple[TestResult, list[Flag]]:
    secs = float(r.get("seconds", 0.0))
    flags, trusted = _channel_flags(r, i)
    if not trusted:
        return TestResult(test, False, "result channel tampered with", secs), flags
    if r.get("timeout"):
        return TestResult(test, False, "timed out", secs), flags
    res = r.get("result")
    if res is None:
        rc = r.get("rc")
        if rc == -24:  # SIGXCPU: the CPU limit
            return TestResult(test, False, "CPU time limit", secs), flags
        flags.append(Flag("early_exit", f"test {i}: the process ended (exit {rc}) before the harness reported"))
        return TestResult(test, False, f"no result (exit {rc})", secs), flags
    for stage in ("load_error", "setup_error"):
        if stage in res:
            flags += _error_flags(res[stage], i)
            return TestResult(test, False, f"{stage.replace('_', ' ')}: {res[stage].get('err', '')}", secs), flags
    vals = res.get("values")
    if not isinstance(vals, list) or len(vals) != len(test.probes):
        flags.append(Flag("result_forgery", f"test {i}: malformed result message"))
        return TestResult(test, False, "malformed result", secs), flags
    decoded = []
    for v in vals:
        if "ok" not in v:
            flags += _error_flags(v, i)
            return TestResult(test, False, str(v.get("err", "error"))[:300], secs), flags
        try:
            decoded.append(decode(v["ok"]))
        except (ValueError, TypeError, IndexError, KeyError) as e:
            flags.append(Flag("result_forgery", f"test {i}: undecodable value ({e})"))
            return TestResult(test, False, "undecodable value", secs), flags
    try:
        ok = test.evaluate(decoded)
    except OpaqueValue as e:
        names = sorted({n for v in vals for n in _opaque_names(v["ok"])})
        flags.append(Flag("opaque_return", f"test {i}: returned {', '.join(names)} where builtin data was expected"))
        return TestResult(test, False, str(e), secs), flags
    except Exception as e:  # the check itself failed on these values, e.g. a TypeError
        return TestResult(test, False, f"{type(e).__name__}: {e}"[:300], secs), flags
    return TestResult(test, ok, "" if ok else "wrong value", secs), flags


def _error_flags(err: Mapping[str, Any], i: int) -> list[Flag]:
    kind = err.get("kind")
    if kind == _EXIT_KIND:
        return [Flag("early_exit", f"test {i}: raised {err.get('err', '')[:120]}")]
    if kind == _SKIP_KIND:
        return [Flag("raise_skip", f"test {i}: raised {err.get('err', '')[:120]}")]
    if kind == _ESCAPE_KIND:  # a BaseException that is no exit: meant to get past `except Exception`
        return [Flag("exception_escape", f"test {i}: raised {err.get('err', '')[:120]}")]
    return []


_DEFAULT_SANDBOX: Sandbox | None = None


def default_sandbox() -> Sandbox:
    """The process-wide sandbox for grading: the best tier here (bwrap where it works)."""
    global _DEFAULT_SANDBOX
    if _DEFAULT_SANDBOX is None:
        _DEFAULT_SANDBOX = get_sandbox()
    return _DEFAULT_SANDBOX


# --- the reward function ------------------------------------------------------------------

# --- differential testing against a reference solution ------------------------------------

_ORACLES: dict[str, Oracle] = {}
_ORACLES_LOCK = threading.Lock()
_BUILDING: dict[str, threading.Lock] = {}
_MAX_ORACLES = 4096


def reference_oracle(reference: str, tests: Sequence[TestCase], setup: str, settings: DiffSettings,
                     entry: str | None = None, sandbox: Sandbox | None = None,
                     memory_mb: int = 512) -> Oracle | str:
    """The reference's outputs on inputs generated from the tests' calls (see
    `actloop.rewards.differential`), or why there are none. The reference runs in the sandbox,
    twice, in one sandbox run; the result is cached on the host per (reference, tests,
    settings), so a group of completions for one prompt pays for it once."""
    probes = [p for t in tests for p in t.probes]
    fn = differential.entry_function(probes, reference, entry)
    if fn is None:
        return "no function of the reference is called by the tests"
    calls = differential.visible_calls(probes, fn, {"__builtins__": _SAFE_BUILTINS, **_SAFE_MODULES})
    if not calls:
        return f"no call of {fn}() in the tests has plain-data arguments to mutate"
    inputs = differential.generate_inputs(calls, settings.inputs, settings.seed)
    if not inputs:
        return f"no new inputs could be generated from the {len(calls)} visible call(s) of {fn}()"
    key = hashlib.sha256(json.dumps([reference, setup, fn, [c.key for c in inputs], [t.check for t in tests],
                                     settings.reference_timeout_s]).encode()).hexdigest()
    with _ORACLES_LOCK:
        if key in _ORACLES:
            return _ORACLES[key]
        lock = _BUILDING.setdefault(key, threading.Lock())
    with lock:  # the completions of one group arrive together: the first builds, the others wait
        with _ORACLES_LOCK:
            if key in _ORACLES:
                return _ORACLES[key]
        batch = Batch(tuple(c.source(fn) for c in inputs), settings.reference_timeout_s,
                      settings.reference_timeout_s * len(inputs) + 1.0)
        report = run_tests(reference, [], setup, sandbox, memory_mb=memory_mb, batches=[batch, batch])
        if report.sandbox_error:
            return f"sandbox error running the reference: {report.sandbox_error}"  # not cached: may pass
        eq = differential.equivalence_from_checks(t.check for t in tests)
        if not eq.unordered and differential.builds_sets(reference):
            eq = dataclasses.replace(eq, unordered="multiset")
        oracle = differential.expected_outputs(fn, inputs, [b.values for b in report.batches], eq, decode,
                                               reference_seconds=max(b.seconds for b in report.batches))
        with _ORACLES_LOCK:
            if len(_ORACLES) >= _MAX_ORACLES:
                _ORACLES.clear()
                _BUILDING.clear()
            _ORACLES[key] = oracle
        return oracle


def with_differential(grade: Grade, report: TestReport, plan: Oracle | str | None, settings: DiffSettings) -> Grade:
    """`grade` with the candidate's agreement with the reference: the `differential` component,
    `info["differential"]`, the `differential_mismatch` flag (a candidate that passes every test
    and disagrees on a generated input) with one counter-example, and the settings' mode applied
    to the score."""
    if plan is None or grade.score is None:
        return grade
    info = dict(grade.info)
    if isinstance(plan, str) or not plan.expected:
        why = plan if isinstance(plan, str) else f"the reference kept no generated input ({plan.to_dict()['dropped']})"
        info["differential"] = {"skipped": why}
        return Grade(grade.score, grade.flags, info, grade.components)
    batch = report.batches[0] if report.batches else BatchResult(None, "not run")
    verdict = differential.compare(plan, batch.values, decode, batch.error)
    info["differential"] = {**plan.to_dict(), **verdict.to_dict()}
    flags = list(grade.flags)
    score = grade.score
    mismatch = verdict.agreed < verdict.total and report.passed == report.total
    mode, penalty = differential.parse_mode(settings.mode)
    if mode == "multiply":
        score *= verdict.rate
    if mismatch:
        ce = verdict.counter_example or {"input": "?", "expected": "?", "actual": "?"}
        flags.append(Flag("differential_mismatch", f"{differential.describe(ce)} ({verdict.agreed}/{verdict.total} "
                                                   "generated inputs agree with the reference)"))
        score = 0.0 if mode == "zero" else score - penalty if mode == "penalty" else score
    return Grade(score, tuple(flags), info, {**grade.components, "differential": verdict.rate})


# --- the reward function ------------------------------------------------------------------

@dataclass
class CodeGrader:
    """TRL-signature reward for code rows (MBPP: `test_list`, `challenge_test_list`,
    `test_setup_code`; HumanEval: `test`, `entry_point`): passed / total, with flags.

    ``CodeGrader()(prompts, completions, test_list=[...], ...) -> list[Grade]``. Completions
    are model answers: the code is taken from ```python blocks when present.

    With a `reference` (a row column holding a reference solution, or a function row -> code),
    the candidate is also run on inputs generated from the tests' arguments and compared with
    the reference (`differential`; see `actloop.rewards.differential`)."""

    sandbox: Sandbox | None = None
    per_test_timeout_s: float = 5.0
    memory_mb: int = 512
    all_or_nothing: bool = False
    max_workers: int = 2  # sandboxes run at once (each runs its tests one after another)
    reference: str | Callable[[Mapping[str, Any]], str | None] | None = None
    differential: DiffSettings = field(default_factory=DiffSettings)
    __name__ = "code_tests"  # what logs and errors call this reward

    def grade(self, completion: str, row: Mapping[str, Any]) -> Grade:
        tests, setup = tests_from_row(row)
        code = extract_code(completion)
        plan = self.oracle(row, tests, setup)
        batches = []
        if isinstance(plan, Oracle) and plan.expected:
            s = self.differential
            # as long for all inputs as 3x what the reference took, at least `budget_s`
            budget = max(s.budget_s, 3 * plan.reference_seconds)
            batches = [Batch(tuple(e.call.source(plan.entry) for e in plan.expected), s.candidate_timeout_s, budget)]
        report = run_tests(code, tests, setup, self.sandbox, self.per_test_timeout_s, self.memory_mb, batches)
        return with_differential(grade_from_report(report, self.all_or_nothing), report, plan, self.differential)

    def oracle(self, row: Mapping[str, Any], tests: Sequence[TestCase], setup: str) -> Oracle | str | None:
        """The reference's outputs on generated inputs; a reason string when there are none;
        None when this grader has no reference for the row or differential testing is off."""
        if not self.differential.enabled or self.reference is None:
            return None
        ref = self.reference(row) if callable(self.reference) else row.get(self.reference)
        if not isinstance(ref, str) or not ref.strip():
            return None
        entry = row.get("entry_point") if isinstance(row.get("entry_point"), str) else None
        return reference_oracle(ref, tests, setup, self.differential, entry, self.sandbox, self.memory_mb)

    def __call__(self, prompts: list, completions: list[str], **columns: Any) -> list[Grade]:
        rows = [{k: v[i] for k, v in columns.items() if isinstance(v, (list, tuple)) and len(v) == len(completions)}
                for i in range(len(completions))]
        if len(completions) <= 1 or self.max_workers <= 1:
            return [self.grade(c, r) for c, r in zip(completions, rows)]
        with ThreadPoolExecutor(self.max_workers) as ex:
            return list(ex.map(self.grade, completions, rows))


def grade_from_report(report: TestReport, all_or_nothing: bool = False) -> Grade:
    info = {"passed": report.passed, "total": report.total, "tier": report.tier,
            "seconds": round(report.seconds, 3), "tests": [r.to_dict() for r in report.results]}
    if report.sandbox_error:
        return Grade(None, (Flag("sandbox_error", report.sandbox_error),), info)
    if not report.total:
        raise RewardError("a code row with no tests cannot be graded")
    frac = report.passed / report.total
    score = float(frac == 1.0) if all_or_nothing else frac
    return Grade(score, report.flags, info)
