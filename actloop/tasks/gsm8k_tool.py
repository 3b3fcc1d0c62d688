"""GSM8K with a Python tool (ReTool-style): the model interleaves reasoning with calls to a
Python interpreter (in Hermes spelling,

    <tool_call>{"name": "python", "arguments": {"code": "apples = 3 * 12\\nprint(apples - 5)"}}</tool_call>

each chat format spells the call its own way: the tool is declared by its schema and the worked
examples carry `ToolCall`s), reads what the code printed, and ends with ``#### N``. Each episode gets its own persistent
`PythonSession` (variables survive between calls), started at the first call and closed when
the episode ends — on the final answer, on an error in `step`, on `close()`, or, when the
rollout stops the episode itself (turn budget, token budget), when the environment is
garbage-collected (the session's own finalizer kills its sandbox).

Reward: `gsm8k`'s terms (`correct` from the maths grader; a final turn that is still a tool call
is no answer). Logged, weight 0: `format` (a ``#### N`` line), `used_tool`, `tool_errors`,
`answer_from_tool` (the final answer is a number some tool result of the episode printed).

Gold traces for an SFT cold start (`gold_trace`) come from GSM8K's own training solutions, whose
calculator annotations become Python calls. A solution such as

    Natalia sold 48/2 = <<48/2=24>>24 clips in May.
    Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.
    #### 72

becomes, after the environment's prompt,

    assistant  "Natalia sold 48/2\\n"                                          python: print(48/2)
    tool       24.0
    assistant  "Natalia sold 48/2 = 24 clips in May.\\nNatalia sold 48+24\\n"  python: print(48+24)
    tool       72
    assistant  "Natalia sold 48+24 = 72 clips altogether in April and May.\\n#### 72"

One assistant turn per annotated line, calling the tool *before* the line's result is written:
the turn says what the line computes (``Natalia sold 48/2``) and calls ``print(48/2)``; the next
turn opens with the whole line without the ``<<...>>`` markup (``Natalia sold 48/2 = 24 clips in
May.``), its number read off the tool result (lines without an annotation follow it). A line with
several annotations makes one call with one ``print(expr)`` per annotation (one tool result, a
printed line each). The final answer writes the last computed line (and any unannotated lines
after it) and ends with the solution's ``#### N``.
A tool result is what the sandbox prints for that code, computed on the host by the
calculator's AST evaluator (`calculator.arithmetic_value`, Python's own arithmetic: ``print(48/2)``
shows ``24.0``). A row converts only when every annotation is plain arithmetic that Python
evaluates to the annotation's own result (to float rounding: ``<<10/3=3.33>>`` does not), and it
needs at most `MAX_CALLS` calls; `trace_steps` says why another row does not.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from fractions import Fraction
from typing import Any, Iterable, Mapping

from actloop.envs.base import StepResult
from actloop.envs.tools import ToolEnv, ToolError, tool
from actloop.rewards.code import default_sandbox
from actloop.rewards.math import extract_final_answer, numbers_in
from actloop.rewards.rubric import RewardTerm
from actloop.sandbox import Limits, PythonSession, Sandbox
from actloop.tasks.base import Task
from actloop.tasks.calculator import CalcError, arithmetic_value
from actloop.tasks.gsm8k import TERMS, gold_completion
from actloop.types import Message, ToolCall

TOOL_SYSTEM = "Then give the final answer on its own line as #### N."
# for chat templates that cannot declare tools: the format fills {call} (a python call in its
# spelling) and {system} (TOOL_SYSTEM); SmolLM2 sees the prompt it had when the call was hand-written
TOOL_PROMPT = ("Solve the math problem. You can run Python code with {call} and see what it prints; variables are "
               "kept between calls. {system}")
NO_OUTPUT = "(no output: print the values you need)"
MAX_CALLS = 8  # python calls per episode (`GSM8KToolEnv.max_calls`); the call past it is refused


def _shot(question: str, steps: list[tuple[str, str, str]], answer: str) -> list[Message]:
    """steps: (reasoning, code, what it prints)."""
    out = [Message("user", question)]
    for text, code, printed in steps:
        out += [Message("assistant", f"{text}\n", tool_calls=(ToolCall("python", {"code": code}),)),
                Message("tool", printed, name="python")]
    return out + [Message("assistant", answer)]


TOOL_SHOTS = (
    _shot("Tom has 3 boxes with 12 apples in each box. He eats 5 apples. How many apples are left?",
          [("Tom starts with 3 boxes of 12 apples.", "apples = 3 * 12\nprint(apples - 5)", "31")],
          "Tom has 31 apples left.\n#### 31")
    + _shot("A shirt costs $20. It is on sale for 25% off. How much does the shirt cost on sale?",
            [("First the discount.", "price = 20\ndiscount = price * 25 / 100\nprint(discount)", "5.0"),
             ("Now the sale price.", "print(price - discount)", "15.0")],
            "The shirt costs $15 on sale.\n#### 15")
    + _shot("A train travels 84 miles in 2 hours. At the same speed, how far does it travel in 5 hours?",
            [("Speed times time.", "speed = 84 / 2\nprint(speed * 5)", "210.0")],
            "The train travels 210 miles.\n#### 210")
)


class GSM8KToolEnv(ToolEnv):
    """Multi-turn: python tool calls run in this episode's session; a reply without a tool call
    is the final answer. A session that breaks fails the episode (it is not the model's error)."""

    report_exceptions = (ToolError,)
    tool_prompt = TOOL_PROMPT

    def __init__(self, sandbox: Sandbox | None = None, limits: Limits | None = None, max_calls: int = MAX_CALLS):
        self.sandbox, self.limits, self.max_calls = sandbox, limits, max_calls
        self.session: PythonSession | None = None
        self.calls = self.errors = 0

    def prompt(self, row: dict[str, Any]) -> list[Message]:
        self.close()
        self.calls = self.errors = 0
        return [Message("system", TOOL_SYSTEM), *TOOL_SHOTS, Message("user", row["question"])]

    def _session(self) -> PythonSession:
        if self.session is None:
            self.session = PythonSession(self.sandbox or default_sandbox(), limits=self.limits)
        return self.session

    @tool
    def python(self, code: str) -> str:
        """Run Python code in a persistent interpreter and see what it prints.

        Args:
            code: Python statements; print the values you need
        """
        if not code.strip():
            raise ToolError('the python tool needs {"code": "..."}.')
        self.calls += 1
        if self.calls > self.max_calls:
            raise ToolError(f"no more than {self.max_calls} python calls; give the final answer.")
        out = self._session().execute(code)
        self.errors += not out.ok
        return out.text.rstrip("\n") or NO_OUTPUT

    def step(self, message: Message) -> StepResult:
        try:
            result = super().step(message)
            if result.done:
                self.close()
            return result
        except BaseException:
            self.close()  # never leave a sandbox behind, whatever failed
            raise

    def info(self) -> dict[str, Any]:
        """`python_errors`: refused calls (unknown tool, bad arguments, over the limit) and code that failed."""
        return {"python_calls": self.calls, "python_errors": self.tool_errors + self.errors}

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None


# ----------------------------------------------------------------------------------- rewards

def used_tool(prompts, completions, trajectories, **kwargs) -> list[float]:
    return [float(t.num_tool_calls > 0) for t in trajectories]


def tool_errors(prompts, completions, trajectories, **kwargs) -> list[float]:
    """Tool calls that failed (exceptions, timeouts, unknown tools) plus malformed calls."""
    return [float(t.info.get("python_errors", 0) + t.num_malformed_calls) for t in trajectories]


def answer_from_tool(prompts, completions, trajectories, **kwargs) -> list[float]:
    """1.0 when the final answer (the maths grader's extraction: one number, no hedging) equals a
    number that one of the episode's own tool results printed (``24.0`` counts as 24; refused
    calls, answered ``Error: ...``, do not count); 0.0 otherwise, and when the last turn is
    still a tool call (logged, weight 0: how often the answer was read off the tool)."""
    out = []
    for text, traj in zip(completions, trajectories):
        last = traj.turns[-1] if traj.turns else None
        predicted = extract_final_answer(text).value
        if last is None or last.message.tool_calls or last.malformed_tool_call or predicted is None:
            out.append(0.0)
            continue
        printed = {v for t in traj.turns for m in t.env_messages
                   if m.role == "tool" and not m.content.startswith("Error:") for v in numbers_in(m.content)}
        out.append(float(predicted in printed))
    return out


# ------------------------------------------------------------------------------ gold traces

_ANNOTATION = re.compile(r"<<([^<>]*)>>")


class NoTrace(ValueError):
    """A GSM8K solution that does not convert to a tool trace; `reason` is a short name for it."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def python_value(expr: str) -> int | float:
    """The value Python gives the arithmetic `expr` (so ``print(expr)`` shows ``str`` of it),
    computed on the host without running code; `NoTrace("not_arithmetic")` for anything else."""
    try:
        value = arithmetic_value(expr)
        str(value)  # an int too long to print raises ValueError, as print would
        return value
    except (CalcError, ValueError) as e:
        raise NoTrace("not_arithmetic", f"{expr!r}: {e}") from None


def _agrees(value: int | float, result: str) -> bool:
    """`value` (Python's) is the annotation's `result` number: exactly for ints, to float rounding
    (relative 1e-9) for floats (``0.1+0.2`` is 0.3; ``10/3`` is not 3.33)."""
    try:
        want = Fraction(result.strip())
    except (ValueError, ZeroDivisionError):
        return False
    if isinstance(value, int):
        return Fraction(value) == want
    return math.isclose(value, float(want), rel_tol=1e-9, abs_tol=1e-12)


def _before_call(line: str) -> str:
    """What a line says before its first calculation: ``Natalia sold 48/2 = <<48/2=24>>24 clips``
    -> ``Natalia sold 48/2`` (the expression, without the `=` and the result it is about to read)."""
    head = re.sub(r"\s+", " ", line.split("<<", 1)[0]).strip()
    return re.sub(r"[\s=$]+$", "", head)


def trace_steps(answer: str, max_calls: int = MAX_CALLS) -> tuple[list[tuple[str, str, str]], str]:
    """A GSM8K solution (``...<<expr=result>>...`` lines, then ``#### N``) -> (steps, final):
    steps are (reasoning text, python code, what it prints), one per annotated line; final is the
    last assistant message, ending in ``#### N`` (see the module docstring).

    The tool is called *before* its result is written: a turn says what the line computes
    (`_before_call`), calls python, and the next turn (or the final answer) opens with the whole
    line, its numbers now read off the tool result. So the trace teaches reading results off the
    tool, not writing them and calling the tool to confirm. Raises `NoTrace` with reason
    `no_final_answer`, `no_annotations`, `not_arithmetic` (an annotation Python cannot evaluate as
    plain arithmetic), `disagrees` (Python prints another number than the annotation states) or
    `too_many_calls` (more than `max_calls` annotated lines)."""
    body, hashes, final = answer.rpartition("####")
    if not hashes or not final.strip():
        raise NoTrace("no_final_answer")
    steps: list[tuple[str, str, str]] = []
    said: list[str] = []  # lines not yet written: the last computed line, then unannotated ones
    for line in (ln.strip() for ln in body.split("\n")):
        if not line:
            continue
        annotations = _ANNOTATION.findall(line)
        text = re.sub(r"\s+", " ", _ANNOTATION.sub("", line)).strip()
        if not annotations:
            said.append(text)
            continue
        codes, outputs = [], []
        for a in annotations:
            expr, eq, result = a.rpartition("=")
            if not eq or not expr.strip():
                raise NoTrace("not_arithmetic", f"<<{a}>>")
            value = python_value(expr.strip())
            if not _agrees(value, result):
                raise NoTrace("disagrees", f"print({expr.strip()}) shows {value}, the annotation says {result}")
            codes.append(f"print({expr.strip()})")
            outputs.append(str(value))
        steps.append(("\n".join(t for t in [*said, _before_call(line)] if t), "\n".join(codes), "\n".join(outputs)))
        said = [text]
    if not steps:
        raise NoTrace("no_annotations")
    if len(steps) > max_calls:
        raise NoTrace("too_many_calls", f"{len(steps)} > {max_calls}")
    return steps, "\n".join(said) + f"\n#### {final.strip()}"


def gold_trace(row: Mapping[str, Any]) -> list[Message] | None:
    """The tool-use episode of a GSM8K training row, after the environment's prompt (the
    messages a rollout of it would hold), or None when the solution does not convert."""
    try:
        steps, final = trace_steps(str(row["answer"]))
    except NoTrace:
        return None
    return _shot(str(row["question"]), steps, final)[1:]


def trace_counts(rows: Iterable[Mapping[str, Any]]) -> Counter:
    """How many rows convert (`converted`) and, for the rest, each `NoTrace` reason."""
    counts: Counter = Counter()
    for row in rows:
        try:
            trace_steps(str(row["answer"]))
            counts["converted"] += 1
        except NoTrace as e:
            counts[e.reason] += 1
    return counts


TASK = Task(
    name="gsm8k-tool",
    env=GSM8KToolEnv,
    rewards=[*TERMS, RewardTerm("used_tool", used_tool, 0.0), RewardTerm("tool_errors", tool_errors, 0.0),
             RewardTerm("answer_from_tool", answer_from_tool, 0.0)],
    dataset="gsm8k",
    success="correct",
    gold=gold_completion,
    gold_trace=gold_trace,
    description="GSM8K with a persistent Python interpreter tool (ReTool-style), ending in #### N",
)
