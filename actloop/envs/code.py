"""Code tasks: MBPP as a multi-turn code agent, HumanEval as single-turn completion.

`mbpp`: the prompt is MBPP's task text and its visible tests (`test_list`). The model writes
the function in a ```python block. It may call

    <tool_call>{"name": "run_tests", "arguments": {}}</tool_call>

which runs the newest code block of the episode against the visible tests in the sandbox and
answers with what passed and what failed; it revises and tests again within `max_test_runs`
and the rollout's turn budget. A reply without a tool call ends the episode, and its code is
graded (`final` completion): the code grader (`actloop.rewards.code`) on the full `test_list`
plus the held-out `challenge_test_list` where a row has one, with the hack detectors.
Reward = tests passed / tests; `success` = all passed.

`humaneval`: the function's signature and docstring; the reply is the whole function. The
graded program is the prompt (its imports and helper functions) followed by the reply's code
(or, when the reply does not define the entry point, the prompt continued by the reply).
Reward = asserts of `check(candidate)` passed / asserts.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any, Mapping

from actloop.envs.base import StepResult
from actloop.envs.prompted import PromptEnv, qa_shots
from actloop.rewards.code import CodeGrader, TestReport, TestResult, extract_code, parse_test, run_tests, tests_from_row
from actloop.rewards.flags import Grade
from actloop.sandbox import Sandbox
from actloop.types import Message

RUN_TESTS_TOOL = {
    "type": "function",
    "function": {
        "name": "run_tests",
        "description": "Run your newest ```python code block against the visible tests.",
        "parameters": {"type": "object", "properties": {}},
    },
}
RUN_TESTS_CALL = '<tool_call>{"name": "run_tests", "arguments": {}}</tool_call>'

MBPP_SYSTEM = (
    "You are an expert Python programmer. Write the function the task asks for in a ```python code "
    f"block. To test it, write the code, then call {RUN_TESTS_CALL} and read which tests fail. "
    "Your last reply without a tool call is graded: give the final code in a ```python block."
)


def mbpp_prompt(row: Mapping[str, Any]) -> str:
    return f"{row['text']}\nYour code should pass these tests:\n" + "\n".join(row["test_list"])


def format_report(report: TestReport) -> str:
    """What the model reads after `run_tests`."""
    if report.sandbox_error:
        return f"Error: the tests could not be run ({report.sandbox_error[:200]})."
    failed = [r for r in report.results if not r.passed]
    head = f"Ran {report.total} tests: {report.passed} passed, {len(failed)} failed."
    if not failed:
        return head
    return head + "".join(f"\nFAILED {r.test.source}: {r.error[:300]}" for r in failed)


def _report(passed: list[bool], tests: list[str], errors: list[str]) -> str:
    results = tuple(TestResult(parse_test(t), p, e) for t, p, e in zip(tests, passed, errors))
    return format_report(TestReport(results))


_SHOT2_TESTS = ["assert count_vowels('hello') == 2", "assert count_vowels('AEIOU') == 5"]
MBPP_SHOTS = qa_shots([(
    "Write a function to return the sum of the squares of a list of numbers.\nYour code should pass these tests:\n"
    "assert sum_squares([1, 2, 3]) == 14\nassert sum_squares([]) == 0",
    "```python\ndef sum_squares(nums):\n    return sum(n * n for n in nums)\n```",
)]) + [
    Message("user", "Write a function to count the vowels in a string.\nYour code should pass these tests:\n"
            + "\n".join(_SHOT2_TESTS)),
    Message("assistant", "```python\ndef count_vowels(s):\n    return sum(1 for c in s if c in 'aeiou')\n```\n"
            + RUN_TESTS_CALL),
    Message("tool", _report([True, False], _SHOT2_TESTS, ["", "wrong value"]), name="run_tests"),
    Message("assistant", "```python\ndef count_vowels(s):\n    return sum(1 for c in s.lower() if c in 'aeiou')\n```"),
]


@dataclass
class MBPPEnv:
    """Multi-turn MBPP: write, run the visible tests, revise; the last reply without a tool call
    is graded."""

    sandbox: Sandbox | None = None
    max_test_runs: int = 3
    per_test_timeout_s: float = 5.0

    def reset(self, row: dict[str, Any]) -> tuple[list[Message], list[dict[str, Any]]]:
        self.row, self.code, self.runs = row, None, 0
        return [Message("system", MBPP_SYSTEM), *MBPP_SHOTS, Message("user", mbpp_prompt(row))], [RUN_TESTS_TOOL]

    def step(self, message: Message) -> StepResult:
        blocks = extract_code(message.content) if "```" in message.content else None
        if blocks and blocks.strip():
            self.code = blocks
        if not message.tool_calls:
            return StepResult([], True, {"test_runs": self.runs})
        return StepResult([self._tool(c.name) for c in message.tool_calls], False, {"test_runs": self.runs})

    def _tool(self, name: str) -> Message:
        if name != "run_tests":
            return Message("tool", f"Error: unknown tool {name!r}; the only tool is run_tests.", name=name)
        if self.code is None:
            return Message("tool", "Error: there is no ```python code block to test yet; write the code first.",
                           name="run_tests")
        if self.runs >= self.max_test_runs:
            return Message("tool", f"Error: no test runs left ({self.max_test_runs} used); give your final code.",
                           name="run_tests")
        self.runs += 1
        tests, setup = tests_from_row({**self.row, "challenge_test_list": []})  # visible tests only
        report = run_tests(self.code, tests, setup, self.sandbox, self.per_test_timeout_s)
        return Message("tool", format_report(report), name="run_tests")

    def close(self) -> None:
        pass  # each test run is its own sandbox run: nothing stays open


def test_runs(prompts, completions, trajectories, **kwargs) -> list[float]:
    """How many times the episode ran the visible tests (logged, weight 0)."""
    return [float(t.info.get("test_runs", 0)) for t in trajectories]


# ----------------------------------------------------------------------------------- HumanEval

HUMANEVAL_SYSTEM = "Complete the Python function. Reply with the whole function in a ```python block."


def stub(row: Mapping[str, Any]) -> str:
    """The function's signature and docstring (`code_prompt`; HumanEval's own column is `prompt`)."""
    return row.get("code_prompt") or row["prompt"]


def humaneval_prompt(row: Mapping[str, Any]) -> str:
    return f"```python\n{stub(row).strip()}\n```"


HUMANEVAL_SHOTS = qa_shots([(
    humaneval_prompt({"code_prompt": 'def add_one(xs: list) -> list:\n    """Return the list with 1 added to each number.\n'
                                '    >>> add_one([1, 2])\n    [2, 3]\n    """\n'}),
    "```python\ndef add_one(xs: list) -> list:\n    return [x + 1 for x in xs]\n```",
)])


def humaneval_env() -> PromptEnv:
    return PromptEnv(HUMANEVAL_SYSTEM, HUMANEVAL_SHOTS, humaneval_prompt)


def defines(code: str, name: str) -> bool:
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return False
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in tree.body)


def humaneval_program(row: Mapping[str, Any], completion: str) -> str:
    """The program graded for a HumanEval reply: prompt + the reply's function, or the prompt
    continued by the reply when it gives only the body."""
    code = extract_code(completion)
    if defines(code, row["entry_point"]):
        return f"{stub(row)}\n\n{code}\n"
    return f"{stub(row)}{code}\n"


@dataclass
class HumanEvalGrader(CodeGrader):
    """`CodeGrader` on `humaneval_program(row, completion)`."""

    __name__ = "humaneval_tests"

    def grade(self, completion: str, row: Mapping[str, Any]) -> Grade:
        return super().grade(f"```python\n{humaneval_program(row, completion)}```", row)


def humaneval_gold_completion(row: Mapping[str, Any]) -> str:
    """The canonical solution (a function body) as a whole function in a ```python block."""
    return f"```python\n{stub(row)}{row['canonical_solution']}\n```"
