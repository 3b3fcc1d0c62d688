"""A LangGraph agent: a model node and a tool node in a StateGraph, looping until no tool call.

    actloop train agent.entry=examples/agents/langgraph_agent.py:run data.path=examples/agents/rows.jsonl

The model node calls the `openai` client it is given (any OpenAI-compatible endpoint, here the
actloop gateway). Same rows and reward as openai_tool_loop.py.
"""

from __future__ import annotations

import json
import operator
import sys
from pathlib import Path
from typing import Annotated, Any, TypedDict

from langgraph.graph import END, START, StateGraph

sys.path.insert(0, str(Path(__file__).resolve().parent))
from openai_tool_loop import MODEL, TOOLS, calculator, opening, score  # noqa: E402


class State(TypedDict):
    messages: Annotated[list[dict[str, Any]], operator.add]
    calls: int


def build(client):
    async def model(state: State) -> dict:
        resp = await client.chat.completions.create(model=MODEL, messages=state["messages"], tools=TOOLS,
                                                    max_tokens=48)
        return {"messages": [resp.choices[0].message.model_dump(exclude_none=True)], "calls": state["calls"] + 1}

    def tools(state: State) -> dict:
        out = []
        for call in state["messages"][-1].get("tool_calls", []):
            try:
                result = calculator(str(json.loads(call["function"]["arguments"]).get("expression", "")))
            except Exception as e:
                result = f"error: {e}"
            out.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        return {"messages": out}

    def route(state: State) -> str:
        return "tools" if state["messages"][-1].get("tool_calls") and state["calls"] < 3 else END

    g = StateGraph(State)
    g.add_node("model", model)
    g.add_node("tools", tools)
    g.add_edge(START, "model")
    g.add_conditional_edges("model", route, ["tools", END])
    g.add_edge("tools", "model")
    return g.compile()


async def run(client, row: dict) -> float:
    final = await build(client).ainvoke({"messages": opening(row["question"]), "calls": 0})
    return score(final["messages"][-1].get("content") or "", float(row["answer"]))
