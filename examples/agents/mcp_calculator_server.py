"""An MCP server (stdio) with one tool, for mcp_agent.py: `python mcp_calculator_server.py`."""

import sys
from pathlib import Path

from mcp.server.mcpserver import MCPServer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from openai_tool_loop import calculator as _calculate  # noqa: E402

server = MCPServer("calculator")


@server.tool()
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses."""
    return _calculate(expression)


if __name__ == "__main__":
    server.run("stdio")
