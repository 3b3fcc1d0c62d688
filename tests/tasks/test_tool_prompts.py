"""Tools through the chat template (issue 12 item 3): no built-in task and no example under
`examples/tasks/` writes a tool-call spelling into its prompt. Tools are declared by their
schemas and worked examples are `ToolCall` messages, so each chat format (hermes, qwen3,
harmony) spells them its own way; the environment's `tool_prompt` words the one tool prompt the
renderer writes for a template that cannot declare tools, and `rollout.tool_prompt` overrides it."""

import hashlib
import json
from pathlib import Path

import pytest

from actloop.config import ConfigError, load_config
from actloop.data.mix import MixedEnv
from actloop.rollout.episodes import open_episode
from actloop.rollout.formats.hermes import TOOL_CALL_OPEN
from actloop.rollout.renderer import Renderer
from actloop.tasks import BUILTIN, resolve
from actloop.tasks.calculator import CalculatorEnv
from actloop.types import Message

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(f"examples/tasks/{p.name}:TASK" for p in (ROOT / "examples" / "tasks").glob("*.py"))
# one row per built-in dataset (the fields each task's prompt reads)
DATASET_ROWS = {
    "gsm8k": {"question": "Ann has 3 bags of 4 apples. How many apples?", "answer": "3 * 4 = 12\n#### 12"},
    "mbpp": {"text": "Write a function to double a number.", "test_list": ["assert double(2) == 4"],
             "code": "def double(x):\n    return 2 * x", "task_id": 1, "challenge_test_list": []},
    "humaneval": {"prompt": "def double(x: int) -> int:\n    \"\"\"Twice x.\"\"\"\n", "entry_point": "double",
                  "test": "def check(f):\n    assert f(2) == 4\n", "task_id": "HumanEval/0"},
}
# the hand-written tool-call spellings of the three formats
SPELLINGS = (TOOL_CALL_OPEN, "to=functions.", "<|call|>")


def a_row(task):
    if task.splits is not None:
        return task.splits(0, 1, 0, "test")[1][0]
    return DATASET_ROWS[task.dataset]


def every_task():
    return [(name, BUILTIN[name]) for name in BUILTIN] + [(spec, resolve(spec)) for spec in EXAMPLES]


@pytest.fixture(scope="module")
def renderers(tokenizer, tiny_qwen3_dir, tiny_gpt_oss_dir):
    from transformers import AutoTokenizer

    return {"hermes": Renderer(tokenizer), "qwen3": Renderer(AutoTokenizer.from_pretrained(tiny_qwen3_dir)),
            "harmony": Renderer(AutoTokenizer.from_pretrained(tiny_gpt_oss_dir))}


def test_no_task_writes_a_tool_call_spelling_into_its_prompt():
    """Every built-in task and example: the opening messages hold no tool-call syntax; worked
    examples carry their calls as `tool_calls`."""
    with_tools = []
    for name, task in every_task():
        env = task.env()
        messages, tools = env.reset(a_row(task))
        for m in messages:
            assert not any(s in m.content for s in SPELLINGS), f"{name}: a tool call is hand-written in {m.role}: " \
                                                               f"{m.content[:200]!r}"
        if tools:
            with_tools.append(name)
            assert any(m.tool_calls for m in messages), f"{name} declares tools but shows no worked call"
        env.close()
    assert {"calculator", "gsm8k-tool", "mbpp"} <= set(with_tools)
    assert any("letter_count" in n for n in with_tools)


@pytest.mark.parametrize("fmt", ["hermes", "qwen3", "harmony"])
def test_worked_examples_come_out_in_each_formats_own_spelling(renderers, fmt):
    """The worked examples' calls, rendered for each format: Hermes text for SmolLM2, Qwen3's
    template's `<tool_call>` block, Harmony's `to=functions.NAME` commentary message; and never
    another format's spelling."""
    r = renderers[fmt]
    for name, task in every_task():
        env = task.env()
        messages, tools, ids = open_episode(r, env, a_row(task))
        env.close()
        if not tools:
            continue
        text = r.decode(ids)
        for m in messages:
            for c in m.tool_calls:
                args = json.dumps(c.arguments)
                spelled = {"hermes": f'{TOOL_CALL_OPEN}{{"name": "{c.name}", "arguments": {args}}}</tool_call>',
                           "qwen3": f'<tool_call>\n{{"name": "{c.name}", "arguments": {args}}}\n</tool_call>',
                           # in history, as gpt-oss's published template writes a call (docs/models.md)
                           "harmony": f"<|start|>assistant to=functions.{c.name}<|channel|>commentary json"
                                      f"<|message|>{args}<|call|>"}[fmt]
                assert spelled in text, f"{name} ({fmt}): the call {c} is not spelled {spelled!r}"
        if fmt == "harmony":
            assert TOOL_CALL_OPEN not in text, name
        else:
            assert "to=functions." not in text, name


def test_the_calculator_tool_prompt_is_the_environments_wording(renderers):
    """hermes on SmolLM2 (no tool support in the template): the system message is the
    calculator's TOOL_PROMPT filled by the format, said once; formats that declare tools show
    the task's system message and their own tool declaration instead."""
    row = {"question": "What is 12 times 13, plus 5?"}
    text = renderers["hermes"].decode(open_episode(renderers["hermes"], CalculatorEnv(), row)[2])
    system = text.split("<|im_end|>")[0]
    assert system == ('<|im_start|>system\nYou are a careful assistant with a calculator tool. For any arithmetic, call '
                      'the tool as <tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call> and '
                      "wait for its result. Then reply with the final answer as: The answer is N.")
    assert "You can call these tools" not in text  # the default layout is not added on top
    for fmt in ("qwen3", "harmony"):
        text = renderers[fmt].decode(open_episode(renderers[fmt], CalculatorEnv(), row)[2])
        assert "You are a careful assistant" not in text and "Then reply with the final answer as" in text


# the system messages gsm8k-tool and mbpp had when the call was hand-written in them
HAND_WRITTEN = {
    "gsm8k-tool": 'Solve the math problem. You can run Python code with <tool_call>{"name": "python", "arguments": '
                  '{"code": "..."}}</tool_call> and see what it prints; variables are kept between calls. Then give the '
                  "final answer on its own line as #### N.",
    "mbpp": "You are an expert Python programmer. Write the function the task asks for in a ```python code block. To "
            'test it, write the code, then call <tool_call>{"name": "run_tests", "arguments": {}}</tool_call> and read '
            "which tests fail. Your last reply without a tool call is graded: give the final code in a ```python block.",
}


@pytest.mark.parametrize("name", list(HAND_WRITTEN))
def test_smollm2_sees_the_system_message_it_had_when_calls_were_hand_written(renderers, name):
    """gsm8k-tool and mbpp word their tool prompts (`tool_prompt`) so that SmolLM2's prompt is
    the one it had before (token for token: the hand-written prompt rendered without tools)."""
    r, task = renderers["hermes"], BUILTIN[name]
    env = task.env()
    messages, _tools, ids = open_episode(r, env, a_row(task))
    env.close()
    assert r.decode(ids).split("<|im_end|>")[0] == f"<|im_start|>system\n{HAND_WRITTEN[name]}"
    hand_written = [Message("system", HAND_WRITTEN[name])] + [
        Message(m.role, m.content + "".join(f'<tool_call>{{"name": "{c.name}", "arguments": {json.dumps(c.arguments)}}}'
                                            "</tool_call>" for c in m.tool_calls), name=m.name)
        for m in messages[1:]]
    assert ids == r.prompt_ids(hand_written)


def test_rollout_tool_prompt_overrides_the_environments(tokenizer):
    row = {"question": "What is 12 times 13, plus 5?"}
    r = Renderer(tokenizer, tool_prompt="{system}\nTools:\n{tools}\nExample: {call}")
    text = r.decode(open_episode(r, CalculatorEnv(), row)[2])
    assert ("Then reply with the final answer as: The answer is N.\nTools:\n- calculator(expression: string): "
            "Evaluate an arithmetic expression") in text
    assert "You are a careful assistant" not in text


def test_a_tool_prompt_without_system_is_refused(tokenizer):
    """The task's system message would be lost silently: a clear error instead."""
    with pytest.raises(ConfigError, match=r"rollout.tool_prompt must contain \{system\}"):
        load_config(None, ["rollout.tool_prompt=Call tools as {call}."])

    class Careless(CalculatorEnv):
        tool_prompt = "Call the calculator as {call}."

    with pytest.raises(ValueError, match=r"has no \{system\}"):
        open_episode(Renderer(tokenizer), Careless(), {"question": "1 + 1?"})


def test_a_mixture_renders_each_sources_tool_prompt(tokenizer):
    """data.mix: the episode's environment is chosen per row; its tool_prompt goes with it."""
    r = Renderer(tokenizer)
    env = MixedEnv({"calculator": CalculatorEnv, "letter_count": resolve("examples/tasks/letter_count.py:TASK").env})
    row = {"question": "What is 12 times 13, plus 5?", "source": "calculator"}
    assert open_episode(r, env, row)[2] == open_episode(r, CalculatorEnv(), row)[2]
    letters = {"word": "banana", "letter": "a", "answer": 3, "source": "letter_count"}
    text = r.decode(open_episode(r, env, letters)[2])
    assert "You can call these tools:\n- count_letter(word: string, letter: string)" in text  # the default layout


def test_the_examples_prompts_are_unchanged(tokenizer):
    """examples/tasks/letter_count.py on the embedded model: moving its worked calls from Hermes
    text to ToolCalls left its rendered prompt as it was (its 2-step training test holds)."""
    task = resolve("examples/tasks/letter_count.py:TASK")
    ids = open_episode(Renderer(tokenizer), task.env(), {"word": "banana", "letter": "a", "answer": 3})[2]
    assert hashlib.sha256(json.dumps(ids).encode()).hexdigest() == LETTER_COUNT_PROMPT_SHA256


LETTER_COUNT_PROMPT_SHA256 = "86491678f9490a416cd38104b71863df1131fca348f50da5c27cc4d8c665a040"


def test_the_worked_calls_survive_serialization():
    """Reward functions' `prompts`, DPO's pairs.jsonl and SFT rows hold messages as dicts: the
    worked examples' calls go there as OpenAI `tool_calls` and read back to the same messages."""
    from actloop.train.offline.pairs import to_messages

    messages, _tools = CalculatorEnv().reset({"question": "What is 12 times 13, plus 5?"})
    dicts = [m.to_dict() for m in messages]
    assert [c["function"] for d in dicts for c in d.get("tool_calls", [])] == [
        {"name": "calculator", "arguments": {"expression": e}} for e in ("14 * 36 - 97", "58 * 23 + 311", "27 * 4 + 9")]
    assert to_messages(json.loads(json.dumps(dicts)), "row 1") == messages
