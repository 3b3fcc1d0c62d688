"""An agent whose tools come from an MCP server over stdio (the `mcp` package).

    actloop train agent.entry=examples/agents/mcp_agent.py:run data.path=examples/agents/rows.jsonl

Each episode starts the server (mcp_calculator_server.py) as a subprocess, lists its tools,
offers them to the model in OpenAI's `tools` shape, and runs every tool call through the MCP
session. Same rows and reward as openai_tool_loop.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from openai_tool_loop import MODEL, opening, score  # noqa: E402

SERVER = StdioServerParameters(command=sys.executable, args=[str(HERE / "mcp_calculator_server.py")])


def openai_tools(listed) -> list[dict]:
    return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.input_schema}} for t in listed.tools]


async def run(client, row: dict) -> float:
    async with stdio_client(SERVER) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        tools = openai_tools(await session.list_tools())
        messages = opening(row["question"])
        reply = ""
        for _ in range(3):
            resp = await client.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=48)
            msg = resp.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            reply = msg.content or ""
            if not msg.tool_calls:
                break
            for call in msg.tool_calls:
                try:
                    out = await session.call_tool(call.function.name, json.loads(call.function.arguments))
                    result = "".join(getattr(c, "text", "") for c in out.content)
                except Exception as e:
                    result = f"error: {e}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return score(reply, float(row["answer"]))
