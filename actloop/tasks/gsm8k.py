"""GSM8K as single-turn chain of thought: the answer's last line is ``#### N``.

Reward: `correct`, 1.0 when the final answer equals the gold number (the maths grader,
`actloop.rewards.math`: one final answer; hedging and answer-spraying score 0 and are flagged).
A final turn that is still a tool call is no answer (`gsm8k-tool` shares these terms). Logged,
weight 0: `format` (a ``#### N`` line).

`actloop grade` scores with these same terms (it used `math_correct` alone before the task
registry: `final_math` is `math_correct` plus the tool-call rule, so single-turn scores agree).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from actloop.envs.prompted import PromptEnv, qa_shots
from actloop.rewards.flags import Grade
from actloop.rewards.math import grade_math
from actloop.rewards.rubric import RewardTerm
from actloop.tasks.base import Task

COT_SYSTEM = "Solve the math problem. Reason step by step, then give the final answer on its own line as #### N."

COT_SHOTS = qa_shots([
    ("Tom has 3 boxes with 12 apples in each box. He eats 5 apples. How many apples are left?",
     "Tom has 3 * 12 = 36 apples. After eating 5 he has 36 - 5 = 31 apples.\n#### 31"),
    ("A shirt costs $20. It is on sale for 25% off. How much does the shirt cost on sale?",
     "25% of $20 is 0.25 * 20 = $5. On sale the shirt costs 20 - 5 = $15.\n#### 15"),
])


def cot_env() -> PromptEnv:
    return PromptEnv(COT_SYSTEM, COT_SHOTS, lambda row: row["question"])


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


def gold_completion(row: Mapping[str, Any]) -> str:
    """GSM8K's own solution text is a gold completion (it ends in ``#### N``)."""
    return str(row["answer"])


TERMS = [RewardTerm("correct", final_math), RewardTerm("format", hash_format, 0.0)]

TASK = Task(
    name="gsm8k",
    env=cot_env,
    rewards=TERMS,
    dataset="gsm8k",
    success="correct",
    gold=gold_completion,
    description="grade-school maths, one turn of chain of thought ending in #### N",
)
