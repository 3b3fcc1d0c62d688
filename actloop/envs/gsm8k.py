"""GSM8K, two ways.

`gsm8k`: single-turn chain of thought; the answer's last line is ``#### N``.

`gsm8k-tool` (ReTool-style): the model interleaves reasoning with calls to a Python interpreter,

    <tool_call>{"name": "python", "arguments": {"code": "apples = 3 * 12\\nprint(apples - 5)"}}</tool_call>

reads what the code printed, and ends with ``#### N``. Each episode gets its own persistent
`PythonSession` (variables survive between calls), started at the first call and closed when
the episode ends — on the final answer, on an error in `step`, on `close()`, or, when the
rollout stops the episode itself (turn budget, token budget), when the environment is
garbage-collected (the session's own finalizer kills its sandbox).

Reward (both): 1.0 when the final answer equals the gold number (the maths grader,
`actloop.rewards.math`: one final answer, hedging and answer-spraying score 0). A final turn
that is still a tool call is no answer. Logged, weight 0: `format` (a ``#### N`` line),
`used_tool`, `tool_errors`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from actloop.envs.base import StepResult
from actloop.envs.prompted import PromptEnv, qa_shots
from actloop.rewards.flags import Grade
from actloop.rewards.math import grade_math
from actloop.sandbox import Limits, PythonSession, Sandbox
from actloop.types import Message

COT_SYSTEM = "Solve the math problem. Reason step by step, then give the final answer on its own line as #### N."

COT_SHOTS = qa_shots([
    ("Tom has 3 boxes with 12 apples in each box. He eats 5 apples. How many apples are left?",
     "Tom has 3 * 12 = 36 apples. After eating 5 he has 36 - 5 = 31 apples.\n#### 31"),
    ("A shirt costs $20. It is on sale for 25% off. How much does the shirt cost on sale?",
     "25% of $20 is 0.25 * 20 = $5. On sale the shirt costs 20 - 5 = $15.\n#### 15"),
])


def cot_env() -> PromptEnv:
    return PromptEnv(COT_SYSTEM, COT_SHOTS, lambda row: row["question"])


# ------------------------------------------------------------------------------ with a tool

PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code in a persistent interpreter and see what it prints.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}

TOOL_SYSTEM = (
    "Solve the math problem. You can run Python code with "
    '<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call> and see what it prints; '
    "variables are kept between calls. Then give the final answer on its own line as #### N."
)
NO_OUTPUT = "(no output: print the values you need)"


def _call(code: str) -> str:
    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"


def _shot(question: str, steps: list[tuple[str, str, str]], answer: str) -> list[Message]:
    """steps: (reasoning, code, what it prints)."""
    out = [Message("user", question)]
    for text, code, printed in steps:
        out += [Message("assistant", f"{text}\n{_call(code)}"), Message("tool", printed, name="python")]
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


class GSM8KToolEnv:
    """Multi-turn: python tool calls run in this episode's session; a reply without a tool call
    is the final answer."""

    def __init__(self, sandbox: Sandbox | None = None, limits: Limits | None = None, max_calls: int = 8):
        self.sandbox, self.limits, self.max_calls = sandbox, limits, max_calls
        self.session: PythonSession | None = None
        self.calls = self.errors = 0

    def reset(self, row: dict[str, Any]) -> tuple[list[Message], list[dict[str, Any]]]:
        self.close()
        self.calls = self.errors = 0
        return [Message("system", TOOL_SYSTEM), *TOOL_SHOTS, Message("user", row["question"])], [PYTHON_TOOL]

    def _session(self) -> PythonSession:
        if self.session is None:
            from actloop.rewards.code import default_sandbox

            self.session = PythonSession(self.sandbox or default_sandbox(), limits=self.limits)
        return self.session

    def _run(self, call) -> Message:
        if call.name != "python":
            self.errors += 1
            return Message("tool", f"Error: unknown tool {call.name!r}; the only tool is python.", name=call.name)
        code = call.arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            self.errors += 1
            return Message("tool", 'Error: the python tool needs {"code": "..."}.', name="python")
        self.calls += 1
        if self.calls > self.max_calls:
            self.errors += 1
            return Message("tool", f"Error: no more than {self.max_calls} python calls; give the final answer.",
                           name="python")
        out = self._session().execute(code)
        self.errors += not out.ok
        return Message("tool", out.text.rstrip("\n") or NO_OUTPUT, name="python")

    def step(self, message: Message) -> StepResult:
        try:
            if not message.tool_calls:
                self.close()
                return StepResult([], True, self._info())
            msgs = [self._run(c) for c in message.tool_calls]
            return StepResult(msgs, False, self._info())
        except BaseException:
            self.close()  # never leave a sandbox behind, whatever failed
            raise

    def _info(self) -> dict[str, Any]:
        return {"python_calls": self.calls, "python_errors": self.errors}

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None


# ----------------------------------------------------------------------------------- rewards

_HASH_LINE = re.compile(r"(?m)^\s*####\s*\S")


def final_math(prompts, completions, answer, trajectories=None, **kwargs) -> list[Grade]:
    """The maths grader on the final answer; a final turn that is a tool call scores 0."""
    out = []
    for i, (text, gold) in enumerate(zip(completions, answer)):
        last = trajectories[i].turns[-1] if trajectories is not None and trajectories[i].turns else None
        if last is not None and (last.message.tool_calls or last.malformed_tool_call):
            out.append(Grade(0.0, info={"predicted": None, "kind": "tool_call"}))
            continue
        out.append(grade_math(text, gold))
    return out


def hash_format(prompts, completions, **kwargs) -> list[float]:
    """1.0 when the answer has a `#### N` line (logged, weight 0)."""
    return [float(bool(_HASH_LINE.search(c))) for c in completions]


def used_tool(prompts, completions, trajectories, **kwargs) -> list[float]:
    return [float(t.num_tool_calls > 0) for t in trajectories]


def tool_errors(prompts, completions, trajectories, **kwargs) -> list[float]:
    """Tool calls that failed (exceptions, timeouts, unknown tools) plus malformed calls."""
    return [float(t.info.get("python_errors", 0) + t.num_malformed_calls) for t in trajectories]
