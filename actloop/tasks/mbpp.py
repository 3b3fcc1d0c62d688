"""MBPP as a multi-turn code agent.

The prompt is MBPP's task text and its visible tests (`test_list`). The model writes
the function in a ```python block. It may call the `run_tests` tool (declared by its schema; in
Hermes spelling ``<tool_call>{"name": "run_tests", "arguments": {}}</tool_call>``), which runs
the newest code block of the episode against the visible tests in the sandbox and answers with
what passed and what failed; it revises and tests again within `max_test_runs`
and the rollout's turn budget. A reply without a tool call ends the episode, and its code is
graded (`final` completion): the code grader (`actloop.rewards.code`) on the full `test_list`
plus the held-out `challenge_test_list` where a row has one, with the hack detectors.
Reward = tests passed / tests; `success` = all passed.

"""

from __future__ import annotations

from typing import Any, Mapping

from actloop.envs.base import StepResult
from actloop.envs.prompted import qa_shots
from actloop.envs.tools import ToolEnv, ToolError, tool
from actloop.rewards.code import (CodeGrader, TestReport, TestResult, extract_code,
                                  parse_test, run_tests, tests_from_row)
from actloop.rewards.hacking import CODE_DETECTORS
from actloop.rewards.rubric import RewardTerm
from actloop.sandbox import Sandbox
from actloop.tasks.base import Task
from actloop.types import Message, ToolCall

MBPP_SYSTEM = "You are an expert Python programmer. Write the function the task asks for in a ```python code block."
# for chat templates that cannot declare tools: the format fills {system} (MBPP_SYSTEM) and {call}
# (the run_tests call in its spelling); SmolLM2 sees the prompt it had when the call was hand-written
MBPP_TOOL_PROMPT = ("{system} To test it, write the code, then call {call} and read which tests fail. Your last reply "
                    "without a tool call is graded: give the final code in a ```python block.")
RUN_TESTS = (ToolCall("run_tests", {}),)


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
    Message("assistant", "```python\ndef count_vowels(s):\n    return sum(1 for c in s if c in 'aeiou')\n```\n",
            tool_calls=RUN_TESTS),
    Message("tool", _report([True, False], _SHOT2_TESTS, ["", "wrong value"]), name="run_tests"),
    Message("assistant", "```python\ndef count_vowels(s):\n    return sum(1 for c in s.lower() if c in 'aeiou')\n```"),
]


class MBPPEnv(ToolEnv):
    """Multi-turn MBPP: write, run the visible tests, revise; the last reply without a tool call
    is graded."""

    tool_prompt = MBPP_TOOL_PROMPT

    def __init__(self, sandbox: Sandbox | None = None, max_test_runs: int = 3, per_test_timeout_s: float = 5.0):
        self.sandbox, self.max_test_runs, self.per_test_timeout_s = sandbox, max_test_runs, per_test_timeout_s

    def prompt(self, row: dict[str, Any]) -> list[Message]:
        self.code, self.runs = None, 0
        return [Message("system", MBPP_SYSTEM), *MBPP_SHOTS, Message("user", mbpp_prompt(row))]

    def step(self, message: Message) -> StepResult:
        blocks = extract_code(message.content) if "```" in message.content else None
        if blocks and blocks.strip():
            self.code = blocks
        return super().step(message)

    @tool
    def run_tests(self) -> str:
        """Run your newest ```python code block against the visible tests."""
        if self.code is None:
            raise ToolError("there is no ```python code block to test yet; write the code first.")
        if self.runs >= self.max_test_runs:
            raise ToolError(f"no test runs left ({self.max_test_runs} used); give your final code.")
        self.runs += 1
        tests, setup = tests_from_row({**self.row, "challenge_test_list": []})  # visible tests only
        return format_report(run_tests(self.code, tests, setup, self.sandbox, self.per_test_timeout_s))

    def info(self) -> dict[str, Any]:
        return {"test_runs": self.runs}


def gold_completion(row: Mapping[str, Any]) -> str:
    """MBPP's reference solution as a model would answer: a ```python block."""
    return f"```python\n{row['code']}\n```"


def test_runs(prompts, completions, trajectories, **kwargs) -> list[float]:
    """How many times the episode ran the visible tests (logged, weight 0)."""
    return [float(t.info.get("test_runs", 0)) for t in trajectories]




TASK = Task(
    name="mbpp",
    env=MBPPEnv,
    # MBPP's reference solution (`code`) is the oracle on generated inputs (`reward.differential`)
    rewards=[RewardTerm("tests", CodeGrader(reference="code")), RewardTerm("test_runs", test_runs, 0.0)],
    dataset="mbpp",
    success="tests",
    detectors=tuple(CODE_DETECTORS),
    gold=gold_completion,
    description="write a Python function, run the visible tests (a tool), revise; graded on all tests",
    id_field="task_id",
)
