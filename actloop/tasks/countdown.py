"""Countdown: reach a target number from given numbers with + - * / (TinyZero's task).

Problems are generated under a seed: 3-4 numbers from 1-99 and a target that some expression
over a subset of them reaches (a positive integer up to 999). The model reasons, then writes
its equation in ``<answer>...</answer>`` (a worked example shows how).

Reward: 1.0 when the last ``<answer>`` holds an expression (optionally ``= target``) that uses
only the given numbers, each at most once, and evaluates exactly (fractions, no rounding) to
the target; else 0. The expression is read by walking its syntax tree — numbers, + - * /,
parentheses and unary minus; nothing else is ever evaluated. Flags: `number_reuse` (a number
not given, or used more often than given), `bad_expression` (cannot be read). Logged,
weight 0: `format` (an ``<answer>`` tag is present).
"""

from __future__ import annotations

import ast
import random
import re
from collections import Counter
from fractions import Fraction
from typing import Any

from actloop.envs.prompted import PromptEnv, qa_shots
from actloop.rewards.flags import Flag, Grade
from actloop.rewards.rubric import RewardTerm
from actloop.tasks.base import Task

_OPS = ("+", "-", "*", "/")


def make_problem(rng: random.Random) -> dict[str, Any]:
    """Numbers and a reachable target, with one solution (the generating expression)."""
    while True:
        nums = [rng.randint(1, 99) for _ in range(rng.choice([3, 4]))]
        k = rng.randint(2, len(nums))
        pick = rng.sample(nums, k)
        expr, value = str(pick[0]), Fraction(pick[0])
        for x in pick[1:]:
            op = rng.choice(_OPS)
            new = {"+": value + x, "-": value - x, "*": value * x, "/": value / x}[op]
            if new.denominator != 1 or new <= 0:
                continue
            expr = f"({expr}) {op} {x}" if op in "*/" and any(o in expr for o in "+-") else f"{expr} {op} {x}"
            value = new
        if value.denominator == 1 and 10 <= value <= 999 and value not in nums and len(re.findall(r"\d+", expr)) >= 2:
            return {"numbers": nums, "target": int(value), "solution": expr}


def make_splits(train_size: int, eval_size: int, seed: int, split: str = "test") -> tuple[list[dict], list[dict]]:
    """Disjoint training and held-out problems (no held-out number set + target in training)."""
    def key(p):
        return (tuple(sorted(p["numbers"])), p["target"])

    held_rng, train_rng = random.Random(f"countdown-{split}-{seed}"), random.Random(f"countdown-train-{seed}")
    held: dict[Any, dict] = {}
    while len(held) < eval_size:
        p = make_problem(held_rng)
        held.setdefault(key(p), p)
    train: dict[Any, dict] = {}
    while len(train) < train_size:
        p = make_problem(train_rng)
        if key(p) not in held:
            train.setdefault(key(p), p)
    return list(train.values()), list(held.values())


def question(row: dict[str, Any]) -> str:
    nums = ", ".join(str(n) for n in row["numbers"])
    return (f"Using the numbers [{nums}], write an equation that equals {row['target']}. Use + - * / and each "
            "number at most once. Show your work, then write the equation in <answer> </answer> tags.")


SYSTEM = "You solve number puzzles. Think briefly, then give the equation in <answer> </answer> tags."
SHOTS = qa_shots([
    (question({"numbers": [4, 25, 3], "target": 97}),
     "25 * 4 = 100, and 100 - 3 = 97.\n<answer>25 * 4 - 3</answer>"),
    (question({"numbers": [12, 7, 60, 5], "target": 35}),
     "60 / 12 = 5, and 5 * 7 = 35.\n<answer>60 / 12 * 7</answer>"),
])


def env() -> PromptEnv:
    return PromptEnv(SYSTEM, SHOTS, question)


# ----------------------------------------------------------------------------------- grading

class ExprError(ValueError):
    pass


def evaluate(expr: str, max_len: int = 200) -> tuple[Fraction, list[int]]:
    """(exact value, numbers used) of an arithmetic expression; ExprError for anything else."""
    if len(expr) > max_len:
        raise ExprError(f"expression longer than {max_len} characters")
    text = expr.replace("×", "*").replace("÷", "/").replace("−", "-")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        raise ExprError(f"cannot read {expr.strip()[:60]!r} as arithmetic") from None
    used: list[int] = []

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Add):
                return a + b
            if isinstance(node.op, ast.Sub):
                return a - b
            if isinstance(node.op, ast.Mult):
                return a * b
            if b == 0:
                raise ExprError("division by zero")
            return a / b
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ExprError(f"only whole numbers, + - * / and parentheses are allowed (found {type(node).__name__})")

    return ev(tree), used


_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)


def grade_countdown(completion: str, numbers: list[int], target: int) -> Grade:
    found = _ANSWER.findall(completion)
    if not found:
        return Grade(0.0, info={"expression": None, "why": "no <answer> tag"})
    expr = found[-1].strip()
    if "=" in expr:  # "25 * 4 - 3 = 97": the left side is the expression; a right side must be the target
        expr, _, rhs = expr.partition("=")
        if rhs.strip() and rhs.strip().rstrip(".") != str(target):
            return Grade(0.0, info={"expression": expr.strip(), "why": f"states = {rhs.strip()[:20]}"})
    try:
        value, used = evaluate(expr)
    except ExprError as e:
        return Grade(0.0, (Flag("bad_expression", str(e)),), {"expression": expr[:80]})
    extra = Counter(used) - Counter(numbers)
    if extra:
        return Grade(0.0, (Flag("number_reuse", f"uses {sorted(extra.elements())} beyond the given {numbers}"),),
                     {"expression": expr[:80]})
    ok = value == target
    return Grade(1.0 if ok else 0.0, info={"expression": expr[:80], "value": str(value)})


def countdown_reward(prompts, completions, numbers, target, **kwargs) -> list[Grade]:
    """TRL-signature reward over rows with `numbers` and `target`."""
    return [grade_countdown(c, n, t) for c, n, t in zip(completions, numbers, target)]


def answer_format(prompts, completions, **kwargs) -> list[float]:
    """1.0 when the completion has an <answer> tag (logged, weight 0)."""
    return [float(bool(_ANSWER.search(c))) for c in completions]


def gold_completion(row: dict[str, Any]) -> str:
    return f"<answer>{row['solution']}</answer>"


TASK = Task(
    name="countdown",
    env=env,
    rewards=[RewardTerm("correct", countdown_reward), RewardTerm("format", answer_format, 0.0)],
    splits=make_splits,
    success="correct",
    gold=gold_completion,
    description="reach a target with + - * / from given numbers (generated; TinyZero's task)",
)
