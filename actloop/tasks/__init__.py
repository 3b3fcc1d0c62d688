"""Tasks: one module per built-in task, one registry (see docs/tasks.md).

| task | module | episode | reward |
|---|---|---|---|
| `calculator` | `calculator.py` | tool calls to a calculator, then "The answer is N" (the demo) | last number == target |
| `gsm8k` | `gsm8k.py` | one turn of chain of thought ending in `#### N` | maths grader |
| `gsm8k-tool` | `gsm8k_tool.py` | reasoning interleaved with Python calls (a persistent session) | maths grader |
| `mbpp` | `mbpp.py` | write code, run the visible tests (a tool), revise | tests passed / tests |
| `humaneval` | `humaneval.py` | complete a function (evaluation only) | asserts passed / asserts |
| `instructions` | `instructions.py` | a writing task with 1-3 verifiable constraints (generated) | constraints met / constraints |
| `countdown` | `countdown.py` | reach a target with + - * / from given numbers (generated) | 1 if exact, else 0 |
"""

from actloop.tasks.base import LoadedTask, Task
from actloop.tasks.registry import BUILTIN, build_task, resolve

__all__ = ["BUILTIN", "LoadedTask", "Task", "build_task", "resolve"]
