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
is no answer). Logged, weight 0: `format` (a ``#### N`` line), `used_tool`, `tool_errors`.
"""

from __future__ import annotations

from typing import Any

from actloop.envs.base import StepResult
from actloop.envs.tools import ToolEnv, ToolError, tool
from actloop.rewards.code import default_sandbox
from actloop.rewards.rubric import RewardTerm
from actloop.sandbox import Limits, PythonSession, Sandbox
from actloop.tasks.base import Task
from actloop.tasks.gsm8k import TERMS, gold_completion
from actloop.types import Message, ToolCall

TOOL_SYSTEM = "Then give the final answer on its own line as #### N."
# for chat templates that cannot declare tools: the format fills {call} (a python call in its
# spelling) and {system} (TOOL_SYSTEM); SmolLM2 sees the prompt it had when the call was hand-written
TOOL_PROMPT = ("Solve the math problem. You can run Python code with {call} and see what it prints; variables are "
               "kept between calls. {system}")
NO_OUTPUT = "(no output: print the values you need)"


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

    def __init__(self, sandbox: Sandbox | None = None, limits: Limits | None = None, max_calls: int = 8):
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


TASK = Task(
    name="gsm8k-tool",
    env=GSM8KToolEnv,
    rewards=[*TERMS, RewardTerm("used_tool", used_tool, 0.0), RewardTerm("tool_errors", tool_errors, 0.0)],
    dataset="gsm8k",
    success="correct",
    gold=gold_completion,
    description="GSM8K with a persistent Python interpreter tool (ReTool-style), ending in #### N",
)
