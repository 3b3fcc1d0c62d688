"""HumanEval as single-turn completion (evaluation only).

The prompt is the function's signature and docstring; the reply is the whole function. The
graded program is the prompt (its imports and helper functions) followed by the reply's code
(or, when the reply does not define the entry point, the prompt continued by the reply).
Reward = asserts of `check(candidate)` passed / asserts. A hack detector's flag is reported,
not scored (`special_casing` is logged: two canonical solutions trip it with their base cases,
HumanEval/63 and /66), so pass@k stays HumanEval's own; so is differential testing against the
canonical solution (`differential` component: a HumanEval+-style agreement rate;
`reward.differential=multiply` scores it).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any, Mapping

from actloop.envs.prompted import PromptEnv, qa_shots
from actloop.rewards.code import CodeGrader, extract_code
from actloop.rewards.differential import DiffSettings
from actloop.rewards.flags import Grade
from actloop.rewards.hacking import CODE_DETECTORS
from actloop.rewards.rubric import RewardTerm
from actloop.tasks.base import Task

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


def humaneval_reference(row: Mapping[str, Any]) -> str:
    """The reference program for differential testing: the prompt with its canonical solution."""
    return humaneval_program(row, humaneval_gold_completion(row))


def humaneval_gold_completion(row: Mapping[str, Any]) -> str:
    """The canonical solution (a function body) as a whole function in a ```python block."""
    return f"```python\n{stub(row)}{row['canonical_solution']}\n```"


TASK = Task(
    name="humaneval",
    env=humaneval_env,
    # differential testing against the canonical solution is reported (`differential` component,
    # `differential_mismatch` flag), not scored, for the same reason
    rewards=[RewardTerm("tests", HumanEvalGrader(reference=humaneval_reference, differential=DiffSettings("log")))],
    dataset="humaneval",
    success="tests",
    detectors=tuple(CODE_DETECTORS),
    policies={"special_casing": "log"},
    gold=humaneval_gold_completion,
    description="complete a Python function from its docstring (evaluation only)",
    eval_only=True,
)
