"""gsm8k-tool gold traces: GSM8K training solutions whose `<<expr=result>>` annotations become
python calls. Hand-computed traces of real rows, the rows that do not convert and why, the count
over the whole train split, the sandbox printing exactly what the traces say it prints; and the
logged `answer_from_tool` term on hand-built episodes."""

import json

import pytest

from actloop.data.sources import data_dir
from actloop.rollout.engine import SamplingParams
from fixtures.teacher import TeacherEngine
from actloop.rollout.episodes import run_episodes
from actloop.rollout.renderer import Renderer
from actloop.rewards.code import default_sandbox
from actloop.sandbox import PythonSession, probe_bwrap
from actloop.tasks.gsm8k_tool import (TASK, GSM8KToolEnv, NoTrace, gold_trace, python_value, trace_counts,
                                      trace_steps)
from actloop.train.offline.pairs import gold_conversation, gold_sequences, masked_spans
from actloop.types import Message, ToolCall, Trajectory, Turn

needs_sandbox = pytest.mark.skipif(not probe_bwrap().available, reason="needs the bwrap sandbox (actloop sandbox doctor)")

# rows 0, 1, 14, 44 and 48 of GSM8K's train split, as they are in train.jsonl
NATALIA = {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                       "How many clips did Natalia sell altogether in April and May?",
           "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
                     "altogether in April and May.\n#### 72"}
WENG = {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
                    "How much did she earn?",
        "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
                  "$<<0.2*50=10>>10.\n#### 10"}
JOY = {"question": "Joy can read 8 pages of a book in 20 minutes. How many hours will it take her to read 120 pages?",
       "answer": "In one hour, there are 3 sets of 20 minutes.\nSo, Joy can read 8 x 3 = <<8*3=24>>24 pages in an hour.\n"
                 "It will take her 120/24 = <<120/24=5>>5 hours to read 120 pages.\n#### 5"}
JAMES = {"question": "James is a first-year student at a University in Chicago. He has a budget of $1000 per semester. "
                     "He spends 30% of his money on food, 15% on accommodation, 25% on entertainment, and the rest on "
                     "coursework materials. How much money does he spend on coursework materials?",
         "answer": "Accommodation is 15% * $1000=$<<15*.01*1000=150>>150\nFood is          30% * $1000=$<<30*.01*1000="
                   "300>>300\nEntertainment is   25% * $1000=$<<25*.01*1000=250>>250\nCoursework materials are thus "
                   "$1000-($150+$300+$250) = $300\n#### 300"}
SAM = {"question": "Sam memorized six more digits of pi than Carlos memorized. Mina memorized six times as many digits "
                   "of pi as Carlos memorized. If Mina memorized 24 digits of pi, how many digits did Sam memorize?",
       "answer": "Carlos memorized 24/6=<<24/6=4>>4 digits of pi.\nSam memorized 4+6=10 digits of pi.\n#### 10"}


def call(text, code):
    return Message("assistant", text + "\n", tool_calls=(ToolCall("python", {"code": code}),))


def result(printed):
    return Message("tool", printed, name="python")


# each line is said after the call that computes it: a turn names the calculation, the next one
# (or the final answer) writes the line with the number read off the tool's result
EXPECTED = [
    (NATALIA, [call("Natalia sold 48/2", "print(48/2)"), result("24.0"),
               call("Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24", "print(48+24)"), result("72"),
               Message("assistant", "Natalia sold 48+24 = 72 clips altogether in April and May.\n#### 72")]),
    (WENG, [call("Weng earns 12/60", "print(12/60)"), result("0.2"),
            call("Weng earns 12/60 = $0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50", "print(0.2*50)"),
            result("10.0"),
            Message("assistant", "Working 50 minutes, she earned 0.2 x 50 = $10.\n#### 10")]),
    # an unannotated first line joins the first call's turn
    (JOY, [call("In one hour, there are 3 sets of 20 minutes.\nSo, Joy can read 8 x 3", "print(8*3)"), result("24"),
           call("So, Joy can read 8 x 3 = 24 pages in an hour.\nIt will take her 120/24", "print(120/24)"),
           result("5.0"),
           Message("assistant", "It will take her 120/24 = 5 hours to read 120 pages.\n#### 5")]),
    # runs of spaces collapse; an unannotated last line follows the last computed line in the final answer
    (JAMES, [call("Accommodation is 15% * $1000", "print(15*.01*1000)"), result("150.0"),
             call("Accommodation is 15% * $1000=$150\nFood is 30% * $1000", "print(30*.01*1000)"), result("300.0"),
             call("Food is 30% * $1000=$300\nEntertainment is 25% * $1000", "print(25*.01*1000)"), result("250.0"),
             Message("assistant", "Entertainment is 25% * $1000=$250\nCoursework materials are thus "
                                  "$1000-($150+$300+$250) = $300\n#### 300")]),
    (SAM, [call("Carlos memorized 24/6", "print(24/6)"), result("4.0"),
           Message("assistant", "Carlos memorized 24/6=4 digits of pi.\nSam memorized 4+6=10 digits of pi.\n#### 10")]),
]


@pytest.mark.parametrize("row, expected", EXPECTED, ids=["natalia", "weng", "joy", "james", "sam"])
def test_real_rows_become_hand_computed_tool_traces(row, expected):
    assert gold_trace(row) == expected


def test_several_annotations_on_one_line_are_one_call_with_a_print_each():
    steps, final = trace_steps("He pays 3*4 = <<3*4=12>>12 and 10/4 = <<10/4=2.5>>2.5 dollars.\n#### 14.5")
    assert steps == [("He pays 3*4", "print(3*4)\nprint(10/4)", "12\n2.5")]
    assert final == "He pays 3*4 = 12 and 10/4 = 2.5 dollars.\n#### 14.5"


@pytest.mark.parametrize("answer, reason", [
    ("He has 10/3 = <<10/3=3.33>>3.33 each.\n#### 3.33", "disagrees"),        # Python prints 3.3333333333333335
    ("So 2+2 = <<2+2=5>>5.\n#### 5", "disagrees"),
    ("x = <<x*2=8>>8\n#### 8", "not_arithmetic"),                              # a name
    ("It costs <<1,000*2=2000>>2000.\n#### 2000", "not_arithmetic"),           # a tuple in Python
    ("Start at <<05+1=6>>6.\n#### 6", "not_arithmetic"),                       # Python refuses leading zeros
    ("Power <<9**9**9=1>>1.\n#### 1", "not_arithmetic"),                       # refused by the evaluator
    ("Divide <<1/0=0>>0.\n#### 0", "not_arithmetic"),
    ("Just <<48>>48 clips.\n#### 48", "not_arithmetic"),                       # no `=`
    ("No calculation here.\n#### 3", "no_annotations"),
    ("Natalia sold 48/2 = <<48/2=24>>24 clips.", "no_final_answer"),
    ("".join(f"Step {i}: {i}+1 = <<{i}+1={i + 1}>>{i + 1}\n" for i in range(9)) + "#### 9", "too_many_calls"),
])
def test_rows_that_do_not_convert_say_why(answer, reason):
    with pytest.raises(NoTrace) as e:
        trace_steps(answer)
    assert e.value.reason == reason
    assert gold_trace({"question": "q", "answer": answer}) is None
    assert trace_counts([{"answer": answer}, NATALIA]) == {reason: 1, "converted": 1}


def test_python_value_prints_as_python_prints():
    assert [str(python_value(e)) for e in ("48/2", "48+24", "0.1+0.2", "7//2", "2**10", "-3*4", "10/4", "0.2*3")] == [
        "24.0", "72", "0.30000000000000004", "3", "1024", "-12", "2.5", "0.6000000000000001"]
    assert trace_steps("So 0.2*3 = <<0.2*3=0.6>>0.6.\n#### 0.6")[0] == [("So 0.2*3", "print(0.2*3)",
                                                                          "0.6000000000000001")]  # float noise agrees
    with pytest.raises(NoTrace):
        python_value("2^3")  # XOR in Python, a power on the calculator: not the calculator's spelling here


def train_rows():
    return [json.loads(line) for line in (data_dir() / "gsm8k" / "train.jsonl").read_text().splitlines()]


@pytest.mark.data("gsm8k")
def test_conversion_count_over_the_train_split():
    """Measured: 7375 of 7473 rows convert; 95 have no annotation at all, 3 need 9 calls."""
    assert trace_counts(train_rows()) == {"converted": 7375, "no_annotations": 95, "too_many_calls": 3}


@needs_sandbox
@pytest.mark.data("gsm8k")
def test_the_sandbox_prints_what_every_trace_says():
    """Every call of every converted train row (23,689, ~2 s in one session) prints in the real
    sandbox exactly the tool result the trace holds."""
    steps = []
    for row in train_rows():
        try:
            steps += trace_steps(row["answer"])[0]
        except NoTrace:
            pass
    session = PythonSession(default_sandbox())
    try:
        wrong = [(code, out.text, printed) for _, code, printed in steps
                 if not (out := session.execute(code)).ok or out.text.rstrip("\n") != printed]
    finally:
        session.close()
    assert len(steps) == 23689 and wrong == []


def calls_and_results(messages):
    """(tool calls, tool results) of the messages after the prompt."""
    return ([(c.name, c.arguments) for m in messages for c in m.tool_calls],
            [(m.name, m.content) for m in messages if m.role == "tool"])


@needs_sandbox
@pytest.mark.parametrize("row", [NATALIA, JAMES, SAM], ids=["natalia", "james", "sam"])
def test_gold_trace_is_a_rollout_of_the_real_environment_with_full_marks(tokenizer, row):
    """Played through GSM8KToolEnv (its own sandbox session), the trace's turns get the very tool
    results it holds, the SFT rendering has the rollout's ids and mask, and the rubric gives full
    marks, the answer read off a tool result."""
    r = Renderer(tokenizer)
    prompt, completion, tools, wording = gold_conversation(gold_trace, GSM8KToolEnv, row)
    assert tools == GSM8KToolEnv().tool_schemas() and wording == GSM8KToolEnv.tool_prompt
    turns = [r.assistant_text(m)[0] for m in completion if m.role == "assistant"]
    [traj] = run_episodes(TeacherEngine(r, turns), r, GSM8KToolEnv, [row], SamplingParams(max_new_tokens=256), 9)
    assert traj.error is None and list(traj.prompt_messages) == prompt
    # the same calls, answered by the sandbox with the very results the trace holds
    assert calls_and_results(traj.messages[len(prompt):]) == calls_and_results(completion)
    [seq], skipped = gold_sequences(gold_trace, GSM8KToolEnv, [row], r)
    assert skipped == 0 and list(seq.ids) == traj.input_ids and list(seq.mask) == traj.loss_mask
    assert len(masked_spans(seq.ids, seq.mask)) == len(turns)
    (s,) = TASK.rubric().score([traj])
    assert s.components == {"correct": 1.0, "format": 1.0, "used_tool": 1.0, "tool_errors": 0.0,
                            "answer_from_tool": 1.0 if row is not SAM else 0.0}  # Sam's 10 is said, not printed


# ------------------------------------------------------------------------- answer_from_tool


def episode(*turns, row=None):
    """A hand-built trajectory: turns are (assistant text or a python call's code, tool results)."""
    out = []
    for said, results in turns:
        msg = (Message("assistant", "", tool_calls=(ToolCall("python", {"code": said}),)) if said.startswith("print(")
               else Message("assistant", said))
        out.append(Turn(msg, (), (), "tool_call" if msg.tool_calls else "stop",
                        env_messages=tuple(Message("tool", r, name="python") for r in results)))
    return Trajectory(prompt_messages=(Message("user", "q"),), prompt_ids=(), turns=tuple(out),
                      row=row or {"answer": "#### 24"})


ANSWER_FROM_TOOL = [
    ("read off the tool", [("print(48/2)", ["24.0"]), ("So 24 clips.\n#### 24", [])], 1.0),
    ("another number", [("print(48/2)", ["24.0"]), ("#### 25", [])], 0.0),
    ("no tool call", [("#### 24", [])], 0.0),
    ("still calling", [("print(48/2)", ["24.0"]), ("print(24)", ["24"])], 0.0),
    ("a refused call's text", [("print(1)", ["Error: no more than 24 python calls; give the final answer."]),
                               ("#### 24", [])], 0.0),
    ("a later line of one result", [("print(3*4)\nprint(10/4)", ["12\n2.5"]), ("#### 2.5", [])], 1.0),
    ("rounded, not printed", [("print(10/3)", ["3.3333333333333335"]), ("#### 3.33", [])], 0.0),
    ("thousands separators", [("print(1234)", ["The total is 1,234"]), ("#### 1234", [])], 1.0),
    ("hedged", [("print(24)\nprint(25)", ["24\n25"]), ("#### 24 or 25", [])], 0.0),
    ("an earlier turn's result", [("print(24)", ["24"]), ("print(2)", ["2"]), ("It is 24.\n#### 24", [])], 1.0),
]


def test_answer_from_tool_on_hand_built_episodes():
    trajs = [episode(*turns) for _, turns, _ in ANSWER_FROM_TOOL]
    scored = TASK.rubric().score(trajs)
    assert {name: s.components["answer_from_tool"] for (name, _, _), s in zip(ANSWER_FROM_TOOL, scored)} == {
        name: want for name, _, want in ANSWER_FROM_TOOL}
    assert all(s.reward == s.components["correct"] for s in scored)  # weight 0: logged, never rewarded
