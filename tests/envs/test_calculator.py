import pytest

from actloop.tasks.calculator import CalcError, CalculatorEnv, final_number, make_splits, safe_eval
from actloop.types import Message, ToolCall


@pytest.mark.parametrize("expr,value", [("14 * 36 - 97", 407), ("(2 + 3) * 4", 20), ("7 / 2", 3.5), ("2 ^ 10", 1024),
                                        ("-3 + 5", 2), ("10 // 3", 3), ("1.5 * 2", 3)])
def test_safe_eval_arithmetic(expr, value):
    assert safe_eval(expr) == value


@pytest.mark.parametrize("expr", ["__import__('os').system('true')", "open('/etc/passwd')", "x + 1", "(1).__class__",
                                  "9 ** 9 ** 9", "1 / 0", "[1, 2]", "lambda: 1", "1e308 * 10", "1 if 1 else 2"])
def test_safe_eval_refuses_code_and_blowups(expr):
    with pytest.raises(CalcError):
        safe_eval(expr)


def test_splits_are_disjoint_and_deterministic():
    train, held = make_splits(500, 100, seed=0)
    assert len(held) == 100 and len(train) == 500
    assert not {r["question"] for r in train} & {r["question"] for r in held}
    assert make_splits(500, 100, seed=0) == (train, held)
    for r in held:
        assert safe_eval(r["expression"]) == r["answer"] and r["answer"] >= 72  # a * b >= 144, c <= a * b / 2


def test_episode_with_tool_call_then_answer():
    env = CalculatorEnv()
    messages, tools = env.reset({"question": "What is 12 times 13, plus 5?", "answer": 161})
    assert messages[-1].content == "What is 12 times 13, plus 5?" and tools[0]["function"]["name"] == "calculator"
    r1 = env.step(Message("assistant", "...", tool_calls=(ToolCall("calculator", {"expression": "12 * 13 + 5"}),)))
    assert not r1.done and r1.messages == [Message("tool", "161", name="calculator")]
    r2 = env.step(Message("assistant", "The answer is 161."))
    assert r2.done and r2.info["answer"] == 161


def test_bad_tool_use_becomes_an_error_message_not_an_exception():
    env = CalculatorEnv()
    env.reset({"question": "q", "answer": 1})
    r = env.step(Message("assistant", "", tool_calls=(ToolCall("search", {}), ToolCall("calculator", {"expr": "1"}),
                                                      ToolCall("calculator", {"expression": "import os"}))))
    assert not r.done and len(r.messages) == 3
    assert all(m.content.startswith("Error:") for m in r.messages)


def test_final_number():
    assert final_number("The answer is 1,234.") == 1234
    assert final_number("-5 and then 7.5") == 7.5
    assert final_number("no digits") is None
