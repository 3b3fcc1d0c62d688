"""The calculator task (the demo): the model calls a calculator tool, reads the result, answers.

Problems are multi-step word problems with 2-3 digit numbers that a 135M model cannot multiply
in its head, generated from templates under a seed. The prompt shows three worked examples as
earlier chat turns (small models follow a tool format only when shown it, not when told); their
calls are `ToolCall`s, so each chat format spells them its own way. The tool is declared only by
its schema. `TOOL_PROMPT` words the tool prompt for SmolLM2's template (which cannot declare
tools): with it the embedded model's prompt is token for token the one the demo's learning result
was measured with (tests/tasks/test_registry.py).

Gold traces for an SFT cold start (`gold_trace`): one calculator call with the row's expression,
its result, `The answer is N.`

Reward: `correct`, 1.0 when the last number of the final answer equals the target (a final turn
that is still a tool call is no answer). Logged, weight 0: `used_tool`, `malformed`.
"""

from __future__ import annotations

import ast
import math
import operator
import random
import re
from typing import Any

from actloop.envs.base import StepResult
from actloop.envs.tools import ToolEnv, ToolError, tool
from actloop.rewards.rubric import RewardTerm
from actloop.tasks.base import Task
from actloop.types import Message, ToolCall

SYSTEM = "Then reply with the final answer as: The answer is N."
# the format fills {call} (the calculator's call in its own spelling) and {system} (SYSTEM)
TOOL_PROMPT = ("You are a careful assistant with a calculator tool. For any arithmetic, call the tool as {call} and "
               "wait for its result. {system}")


def _example(question: str, expression: str) -> list[Message]:
    result = safe_eval(expression)
    return [
        Message("user", question),
        Message("assistant", "", tool_calls=(ToolCall("calculator", {"expression": expression}),)),
        Message("tool", str(result), name="calculator"),
        Message("assistant", f"The answer is {result}."),
    ]


def examples() -> list[Message]:
    """Three worked examples, shown as earlier chat turns. Measured on the embedded model, 48
    held-out problems, greedy: 1 example 0% success (it never calls the tool), 2 examples 23%,
    3 examples 44% with a tool call in every episode."""
    return (
        _example("A baker makes 14 trays of 36 muffins and sells 97 of them. How many muffins are left?", "14 * 36 - 97")
        + _example("What is 58 times 23, plus 311?", "58 * 23 + 311")
        + _example("A bus has 27 rows of 4 seats and 9 extra seats. How many seats are there?", "27 * 4 + 9")
    )


# (question template, expression template). Numbers a, b, c are drawn per problem.
TEMPLATES = [
    ("A farmer plants {a} rows of {b} trees and then {c} more trees. How many trees are there?", "{a} * {b} + {c}"),
    ("A school buys {a} boxes of {b} pencils and gives away {c} pencils. How many pencils are left?", "{a} * {b} - {c}"),
    ("A theatre has {a} rows of {b} seats. {c} seats are broken. How many seats can be used?", "{a} * {b} - {c}"),
    ("A shop sells {a} packs of {b} stickers on Monday and {c} single stickers on Tuesday. How many stickers did it sell?", "{a} * {b} + {c}"),
    ("Each crate holds {b} bottles. A truck carries {a} crates and {c} loose bottles. How many bottles does it carry?", "{a} * {b} + {c}"),
    ("A library has {a} shelves with {b} books each. It lends out {c} books. How many books are still on the shelves?", "{a} * {b} - {c}"),
    ("Tickets cost {b} dollars each. A club buys {a} tickets and gets a {c} dollar discount. How many dollars does it pay?", "{a} * {b} - {c}"),
    ("A worker earns {b} dollars a day for {a} days and a bonus of {c} dollars. How many dollars does the worker earn?", "{a} * {b} + {c}"),
    ("A factory makes {a} toys an hour for {b} hours, plus {c} toys on a night shift. How many toys does it make?", "{a} * {b} + {c}"),
    ("What is {a} times {b}, plus {c}?", "{a} * {b} + {c}"),
    ("What is {a} times {b}, minus {c}?", "{a} * {b} - {c}"),
    ("A garden has {a} beds of {b} flowers and {c} flowers in pots. How many flowers are there in all?", "{a} * {b} + {c}"),
]


def make_problem(rng: random.Random) -> dict[str, Any]:
    q, e = rng.choice(TEMPLATES)
    a, b = rng.randint(12, 99), rng.randint(12, 99)
    c = rng.randint(11, min(999, a * b // 2))  # keeps a - c result well above zero
    expr = e.format(a=a, b=b, c=c)
    return {"question": q.format(a=a, b=b, c=c), "answer": safe_eval(expr), "expression": expr}


def make_splits(train_size: int, eval_size: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Disjoint train and held-out problems: no held-out question appears in training."""
    held_rng, train_rng = random.Random(f"calc-eval-{seed}"), random.Random(f"calc-train-{seed}")
    held: dict[str, dict] = {}
    while len(held) < eval_size:
        p = make_problem(held_rng)
        held.setdefault(p["question"], p)
    train: dict[str, dict] = {}
    while len(train) < train_size:
        p = make_problem(train_rng)
        if p["question"] not in held:
            train.setdefault(p["question"], p)
    return list(train.values()), list(held.values())


# ----------------------------------------------------------------------------------- evaluator

_BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(ToolError, ValueError):
    pass


def arithmetic_value(expr: str, max_len: int = 200) -> int | float:
    """The value Python itself gives the arithmetic expression `expr` (Python's spelling: `**`,
    not `^`), unrounded — `arithmetic_value("48/2")` is 24.0, as `print(48/2)` shows — computed by
    walking the AST: numbers and operators only, no names, no calls, no attribute access, bounded
    exponents, so model-written input can never run code. Raises `CalcError` for anything else,
    for division by zero and for results that are not finite real numbers."""
    return _walk(_parse(expr, max_len))


def safe_eval(expr: str, max_len: int = 200) -> int | float:
    """The calculator tool's arithmetic: `arithmetic_value` of `expr` in calculator spelling
    (`^` is a power, `×` and `÷` are accepted), then whole floats as ints and other floats rounded
    to 6 decimals (`safe_eval("48/2")` is 24)."""
    value = _walk(_parse(expr, max_len, calculator_spelling=True))
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        return round(value, 6)
    return value


def _parse(expr: str, max_len: int, calculator_spelling: bool = False) -> ast.Expression:
    if len(expr) > max_len:
        raise CalcError(f"expression longer than {max_len} characters")
    if calculator_spelling:
        expr = expr.replace("^", "**").replace("×", "*").replace("÷", "/")
    try:
        return ast.parse(expr, mode="eval")
    except SyntaxError:
        raise CalcError(f"cannot parse expression {expr!r}") from None


def _walk(tree: ast.Expression) -> int | float:
    def ev(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
                raise CalcError("exponent too large")
            try:
                return _BINOPS[type(node.op)](left, right)
            except ZeroDivisionError:
                raise CalcError("division by zero") from None
            except OverflowError:
                raise CalcError("result too large") from None
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        raise CalcError(f"unsupported element {type(node).__name__} in expression")

    value = ev(tree)
    if not isinstance(value, (int, float)) or (isinstance(value, float) and not math.isfinite(value)):
        raise CalcError("result is not a finite real number")  # (-8) ** 0.5 is complex, 1e300 * 1e300 inf
    return value


def format_number(x: int | float) -> str:
    return str(x)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> float | None:
    """The last number in `text` (thousands separators allowed), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


class CalculatorEnv(ToolEnv):
    """Multi-turn: tool calls get results; a message without a tool call is the final answer."""

    tool_prompt = TOOL_PROMPT

    def __init__(self, shots: list[Message] | None = None):
        self.shots = examples() if shots is None else shots
        self.row: dict[str, Any] = {}

    def prompt(self, row: dict[str, Any]) -> list[Message]:
        return [Message("system", SYSTEM), *self.shots, Message("user", row["question"])]

    @tool
    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression with + - * / // % ** and parentheses.

        Args:
            expression: e.g. 23 * 17 + 4
        """
        return format_number(safe_eval(expression))

    def finish(self, message: Message) -> StepResult:
        return StepResult(messages=[], done=True, info={**self.info(), "answer": final_number(message.content)})


# ------------------------------------------------------------------------------------- rewards


def correct_answer(prompts, completions, answer, trajectories=None, **kwargs) -> list[float]:
    """1.0 when the last number of the final answer equals the row's `answer`. A final turn that
    is itself a tool call (the episode ran out of turns) is no answer."""
    out = []
    for i, (text, target) in enumerate(zip(completions, answer)):
        last = trajectories[i].turns[-1] if trajectories is not None and trajectories[i].turns else None
        if last is not None and (last.message.tool_calls or last.malformed_tool_call):
            out.append(0.0)
            continue
        got = final_number(text)
        out.append(1.0 if got is not None and abs(got - float(target)) < 1e-6 else 0.0)
    return out


def used_tool(prompts, completions, trajectories, **kwargs) -> list[float]:
    """1.0 when the episode made at least one well-formed tool call (logged, weight 0)."""
    return [1.0 if t.num_tool_calls > 0 else 0.0 for t in trajectories]


def malformed_calls(prompts, completions, trajectories, **kwargs) -> list[float]:
    """Number of malformed tool calls in the episode (logged, weight 0)."""
    return [float(t.num_malformed_calls) for t in trajectories]


def splits(train_size: int, eval_size: int, seed: int, split: str = "test") -> tuple[list[dict], list[dict]]:
    """`make_splits`; the calculator has one held-out split, `test`."""
    if split != "test":
        raise ValueError(f"calculator has splits train and test (its held-out problems); got `{split}`")
    return make_splits(train_size, eval_size, seed)


def gold_completion(row: dict[str, Any]) -> str:
    return f"The answer is {row['answer']}."


def gold_trace(row: dict[str, Any]) -> list[Message]:
    """The ReTool-style cold-start episode of one problem (after the environment's prompt): a
    calculator call with the row's expression, the tool's result, then `The answer is N.`"""
    return _example(row["question"], row["expression"])[1:]


TASK = Task(
    name="calculator",
    env=CalculatorEnv,
    rewards=[RewardTerm("correct", correct_answer), RewardTerm("used_tool", used_tool, 0.0),
             RewardTerm("malformed", malformed_calls, 0.0)],
    splits=splits,
    success="correct",
    gold=gold_completion,
    gold_trace=gold_trace,
    description="the demo: word problems solved with calls to a calculator tool, then \"The answer is N\"",
)
