"""A tool loop on the plain `openai` client, written as for any OpenAI endpoint.

    actloop train agent.entry=examples/agents/openai_tool_loop.py:run data.path=examples/agents/rows.jsonl

Rows: {"question": "...", "answer": 391}. Reward: 1 when the last number of the final reply is
the answer, else partial credit for a near miss (so a small model's groups differ in reward). The worked example in the opening messages shows the small embedded model the
tool-call format (small models follow a format when shown it, not when told).
"""

from __future__ import annotations

import ast
import json
import operator
import re

MODEL = "policy"  # the name the actloop gateway answers to (agent.model_name)

TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}]

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def calculator(expression: str) -> str:
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("unsupported expression")

    try:
        value = ev(ast.parse(expression, mode="eval").body)
        return str(int(value) if float(value).is_integer() else round(value, 6))
    except Exception as e:  # the tool's error goes back to the model, as a tool would answer
        return f"error: {e}"


def opening(question: str) -> list[dict]:
    example_call = {"id": "call_0", "type": "function",
                    "function": {"name": "calculator", "arguments": json.dumps({"expression": "12 * 34"})}}
    return [
        {"role": "system", "content": "Use the calculator tool for arithmetic, then reply: The answer is N."},
        {"role": "user", "content": "What is 12 times 34?"},
        {"role": "assistant", "content": "", "tool_calls": [example_call]},
        {"role": "tool", "tool_call_id": "call_0", "content": "408"},
        {"role": "assistant", "content": "The answer is 408."},
        {"role": "user", "content": question},
    ]


def last_number(text: str) -> float | None:
    nums = re.findall(r"-?\d+(?:\.\d+)?", (text or "").replace(",", ""))
    return float(nums[-1]) if nums else None


async def run(client, row: dict) -> float:
    """One episode: up to 3 calls, running the calculator for each tool call."""
    messages = opening(row["question"])
    reply = ""
    for _ in range(3):
        resp = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=48)
        msg = resp.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        reply = msg.content or ""
        if not msg.tool_calls:
            break
        for call in msg.tool_calls:
            try:
                args = json.loads(call.function.arguments)
                result = calculator(str(args.get("expression", "")))
            except Exception as e:
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return score(reply, float(row["answer"]))


def score(reply: str, answer: float) -> float:
    got = last_number(reply)
    if got is None:
        return 0.0
    if abs(got - answer) < 1e-6:
        return 1.0
    return 0.5 * max(0.0, 1.0 - abs(got - answer) / max(abs(answer), 1.0))
