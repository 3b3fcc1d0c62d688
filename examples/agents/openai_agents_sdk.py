"""An OpenAI Agents SDK (`openai-agents`) agent with a function tool, trained unchanged.

    actloop train agent.entry=examples/agents/openai_agents_sdk.py:run data.path=examples/agents/rows.jsonl

The SDK talks Chat Completions to the gateway through `OpenAIChatCompletionsModel`; tracing is
off (it would upload traces to OpenAI). Same rows and reward as openai_tool_loop.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded

sys.path.insert(0, str(Path(__file__).resolve().parent))
from openai_tool_loop import MODEL, calculator as _calculate, score  # noqa: E402

set_tracing_disabled(True)


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses.

    Args:
        expression: the expression, e.g. 23 * 17 + 4
    """
    return _calculate(expression)


async def run(client, row: dict) -> float:
    agent = Agent(
        name="calculator agent",
        instructions=("Use the calculator tool for arithmetic: write "
                      '<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call>. '
                      "Then reply: The answer is N."),
        tools=[calculator],
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        model_settings=ModelSettings(max_tokens=48),
    )
    try:
        result = await Runner.run(agent, row["question"], max_turns=3)
    except MaxTurnsExceeded:  # still calling tools after 3 turns: no answer
        return 0.0
    return score(str(result.final_output or ""), float(row["answer"]))
