"""`ToolEnv`: tools are typed Python functions; schemas from hints and docstrings; every error
goes back to the model as a tool message and is counted; turns are limited."""

import pytest

from actloop import Env, Message, StepResult, ToolCall, ToolEnv, ToolError, tool
from actloop.tasks.calculator import CalculatorEnv


def lookup(city: str, metric: bool = True) -> dict:
    """Look up the weather.

    Args:
        city: the city's name
        metric: degrees Celsius when true
    """
    if city == "Atlantis":
        raise KeyError(city)
    return {"city": city, "temp": 21 if metric else 70}


class Weather(ToolEnv):
    tools = (lookup,)
    max_tool_calls = 4

    def __init__(self):
        self.closed = 0

    def prompt(self, row):
        return [Message("user", row["q"])]

    @tool
    def add(self, a: int, b: float) -> float:
        """Add two numbers.

        Args:
            a: a whole number
            b: any number
        """
        if a < 0:
            raise ToolError("a must be >= 0")
        return a + b

    def close(self):
        self.closed += 1


def call(name, **args):
    return ToolCall(name, args)


def reply(*calls, text=""):
    return Message("assistant", text, tool_calls=tuple(calls))


def test_schemas_come_from_type_hints_and_docstrings():
    env = Weather()
    assert isinstance(env, Env)
    messages, tools = env.reset({"q": "hi"})
    assert messages == [Message("user", "hi")]
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    assert by_name["lookup"] == {
        "name": "lookup", "description": "Look up the weather.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "the city's name"},
            "metric": {"type": "boolean", "description": "degrees Celsius when true"}}, "required": ["city"]}}
    assert by_name["add"]["parameters"]["properties"]["a"] == {"type": "integer", "description": "a whole number"}
    assert all(t["type"] == "function" for t in tools)


def test_calls_run_and_errors_go_back_to_the_model():
    env = Weather()
    env.reset({"q": "hi"})
    res = env.step(reply(call("lookup", city="Oslo"), call("add", a=2, b=0.5), call("shell", cmd="ls"),
                         call("add", a="2", b=1)))
    assert [m.content for m in res.messages[:2]] == ['{"city": "Oslo", "temp": 21}', "2.5"]
    assert res.messages[2].content == "Error: unknown tool 'shell'; the tools are add, lookup."
    assert res.messages[3].content.startswith('Error: the add tool needs {"a": 0, "b": 0} (`a` must be integer')  # typed example
    assert all(m.role == "tool" for m in res.messages) and [m.name for m in res.messages][:2] == ["lookup", "add"]
    assert not res.done and res.info == {"tools_run": 4, "tool_errors": 2}


def test_a_tool_that_raises_and_missing_or_extra_arguments():
    env = Weather()
    env.reset({"q": "hi"})
    res = env.step(reply(call("lookup", city="Atlantis"), call("add", a=-1, b=1), call("add", a=1),
                         call("lookup", city="x", units="K")))
    texts = [m.content for m in res.messages]
    assert texts[0] == "Error: KeyError: 'Atlantis'"
    assert texts[1] == "Error: a must be >= 0"  # ToolError: just its text
    assert "missing a required argument: 'b'" in texts[2]
    assert "unexpected keyword argument 'units'" in texts[3]
    assert res.info["tool_errors"] == 4


def test_turn_limit_and_final_answer():
    env = Weather()
    env.reset({"q": "hi"})
    assert not env.step(reply(call("add", a=1, b=1), call("add", a=1, b=1))).done
    assert not env.step(reply(call("add", a=1, b=1), call("add", a=1, b=1))).done
    res = env.step(reply(call("add", a=1, b=1)))  # the 5th call is past max_tool_calls=4
    assert res.done and res.messages == [Message("tool", "Error: no more than 4 tool calls; the episode ends.", name="add")]
    env.reset({"q": "again"})  # counters start over
    res = env.step(Message("assistant", "done"))
    assert res == StepResult([], True, {"tools_run": 0, "tool_errors": 0})


def test_a_tool_without_described_arguments_is_refused():
    class Bad(ToolEnv):
        def prompt(self, row):
            return []

        @tool
        def f(self, x: int) -> int:
            """No Args section."""
            return x

    with pytest.raises(TypeError, match="tool `f`"):
        Bad().reset({})


def test_calculator_is_a_tool_env_with_the_demo_schema():
    env = CalculatorEnv()
    _, tools = env.reset({"question": "q", "answer": 1})
    assert tools == [{"type": "function", "function": {
        "name": "calculator", "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. 23 * 17 + 4"}},
                       "required": ["expression"]}}}]
    res = env.step(reply(call("calculator", expression="12 * 12"), call("calculator", expression="1/0")))
    assert [m.content for m in res.messages] == ["144", "Error: division by zero"]
    assert env.step(Message("assistant", "The answer is 144.")).info["answer"] == 144.0
