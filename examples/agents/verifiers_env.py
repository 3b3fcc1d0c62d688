"""A `verifiers` environment (a ToolEnv with a calculator and a Rubric) run through the gateway.

    actloop train agent.entry=examples/agents/verifiers_env.py:run data.path=examples/agents/rows.jsonl

verifiers runs the rollout itself (its own tool loop and its own rubric), calling the model via
the OpenAI client it is given; actloop captures the calls token by token and trains on the
reward verifiers computed.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from openai_tool_loop import MODEL, calculator as _calculate, score  # noqa: E402


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses.

    Args:
        expression: the expression, e.g. 23 * 17 + 4
    """
    return _calculate(expression)


def correct(completion, answer, **kwargs) -> float:
    """verifiers reward function: the last assistant message's last number against the answer."""
    def field(m, key):  # messages are dicts or typed message objects, by verifiers version
        return m.get(key) if isinstance(m, dict) else getattr(m, key, None)

    replies = [m for m in completion if field(m, "role") == "assistant"]
    text = (field(replies[-1], "content") or "") if replies else ""
    return score(text if isinstance(text, str) else str(text), float(answer))


@functools.cache
def environment():
    import verifiers as vf
    from datasets import Dataset

    rows = Dataset.from_list([{"question": "What is 2 plus 2?", "answer": "4"}])
    return vf.ToolEnv(dataset=rows, tools=[calculator], max_turns=3, rubric=vf.Rubric(funcs=[correct]),
                      system_prompt=("Use the calculator tool for arithmetic: write "
                                     '<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}'
                                     "</tool_call>. Then reply: The answer is N."))


async def run(client, row: dict) -> dict:
    from verifiers.clients import OpenAIChatCompletionsClient

    out = await environment().run_rollout(
        {"prompt": [{"role": "user", "content": row["question"]}], "answer": str(row["answer"]), "example_id": 0},
        OpenAIChatCompletionsClient(client), MODEL, {"max_tokens": 48})
    if out.get("error"):
        raise RuntimeError(f"verifiers rollout failed: {out['error']}")
    return {"reward": float(out["reward"]), **{k: float(v) for k, v in (out.get("metrics") or {}).items()}}
