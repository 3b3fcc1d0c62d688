"""`evaluate`: greedy accuracy, pass@k with the unbiased estimator, per-source numbers — driven by
a scripted engine; and `actloop eval` on the embedded model (slow)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from actloop.config import load_config
from actloop.tasks import build_task
from actloop.tasks.base import LoadedTask
from actloop.tasks.gsm8k_tool import TASK as GSM8K_TOOL
from actloop.train.runtime.evaluate import evaluate, pass_at_k
from actloop.types import Message, ToolCall, Trajectory, Turn

ROOT = Path(__file__).resolve().parents[2]


def test_pass_at_k_matches_the_combinatorial_definition():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7) and pass_at_k(10, 0, 5) == 0.0 and pass_at_k(3, 2, 2) == 1.0
    assert pass_at_k(200, 13, 1) == pytest.approx(13 / 200)
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_evaluate_reports_pass_at_k_and_per_source(renderer, scripted):
    over = ["data.mix=[countdown:1,instructions:1]", "data.train_size=0", "data.eval_size=2"]
    t = build_task(load_config(None, over))
    rows = sorted(t.eval_rows, key=lambda r: r["source"])  # countdown, instructions
    gold = f"<answer>{rows[0]['solution']}</answer>"
    from actloop.tasks.instructions import gold_response

    ok = gold_response(rows[1]["topic"], rows[1]["constraints"])
    eng = scripted(renderer, [[gold, "<answer>1 + 1</answer>", "", ok]])
    res = evaluate(eng, renderer, t, rows, 64, 2, samples_per_problem=2, temperature=0.8, ks=(1, 2),
                   keep_problems=True)
    assert res["pass@k"] == {"1": 0.5, "2": 1.0} and res["success"] == 0.5 and res["n"] == 2
    assert res["per_source"]["countdown"]["pass@k"] == {"1": 0.5, "2": 1.0}
    assert [p["correct"] for p in res["problems"]] == [1, 1] and res["problems"][0]["source"] == "countdown"
    assert res["samples"][0]["reward"] == 1.0
    with pytest.raises(ValueError, match="temperature"):
        evaluate(eng, renderer, t, rows, 64, 2, samples_per_problem=2)


def test_evaluate_keeps_the_trainers_call(renderer, scripted):
    t = build_task(load_config(None, ["data.task=countdown", "data.train_size=0", "data.eval_size=3"]))
    eng = scripted(renderer, [[f"<answer>{r['solution']}</answer>" for r in t.eval_rows]])
    res = evaluate(eng, renderer, t, t.eval_rows, 32, 1)  # positional, as actloop.train calls it
    assert res["success"] == 1.0 and "pass@k" not in res and "problems" not in res


def test_evaluate_reports_the_mean_of_every_rubric_component():
    """`components`: each term's mean, weight-0 ones included, over hand-built gsm8k-tool episodes
    (a task's own episode runner hands them to `evaluate`, no engine needed)."""

    def ep(final, printed=None, errors=0):  # an optional python call that printed `printed`, then `final`
        call = Message("assistant", "", tool_calls=(ToolCall("python", {"code": "..."}),))
        turns = [] if printed is None else [
            Turn(call, (), (), "tool_call", env_messages=(Message("tool", printed, name="python"),))]
        turns.append(Turn(Message("assistant", final), (), (), "stop"))
        return Trajectory((Message("user", "q"),), (), tuple(turns), row={"answer": "#### 24", "source": "gsm8k-tool"},
                          info={"python_errors": errors})

    trajs = [ep("#### 24", "24.0"), ep("#### 24"), ep("It is 25.", "24.0"), ep("#### 24", "24", errors=2)]
    rows = [t.row for t in trajs]
    task = LoadedTask("gsm8k-tool", GSM8K_TOOL.env, GSM8K_TOOL.rubric(), [], rows, rollout=lambda *args: trajs)
    res = evaluate(None, None, task, rows, 64, 3)
    assert res["components"] == {"correct": 0.75, "format": 0.75, "used_tool": 0.75, "tool_errors": 0.5,
                                 "answer_from_tool": 0.5}
    assert res["success"] == 0.75 and res["tool_calls_per_episode"] == 0.75


def test_evaluate_says_how_many_tokens_it_sampled_and_how_fast():
    """A slow evaluation must say whether the model wrote more (tokens, turns) or the engine ran
    slower (tokens a second): hand-built episodes of 3+2 and 4 sampled tokens over 1.5 turns."""
    from actloop.train.runtime.evaluate import eval_line

    def ep(*turn_lengths):
        turns = tuple(Turn(Message("assistant", "x"), tuple(range(n)), (0.0,) * n, "stop") for n in turn_lengths)
        return Trajectory((Message("user", "q"),), (), turns, row={"answer": "1"})

    trajs = [ep(3, 2), ep(4)]
    rows = [t.row for t in trajs]
    task = LoadedTask("t", GSM8K_TOOL.env, GSM8K_TOOL.rubric(), [], rows, rollout=lambda *args: trajs)
    res = evaluate(None, None, task, rows, 64, 3)
    assert res["sampled_tokens"] == 9 and res["turns_per_episode"] == 1.5
    assert res["sampled_tokens_per_second"] > 0
    assert ": 9 tokens sampled at " in eval_line("eval_before", res)


def run_cli(*args):
    proc = subprocess.run([sys.executable, "-m", "actloop", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_eval_cli_greedy_and_pass_at_k(tmp_path):
    out = tmp_path / "r.json"
    line = run_cli("eval", "--task", "countdown", "--n", "2", "--max-new-tokens", "12", "--json", "--out", str(out))
    res = json.loads(line.strip().splitlines()[-1])
    assert res["n"] == 2 and 0 <= res["success"] <= 1 and res["file"] == str(out)
    saved = json.loads(out.read_text())
    assert len(saved["problems"]) == 2 and saved["task"] == "countdown" and saved["split"] == "test"
    text = run_cli("eval", "--task", "countdown", "--n", "2", "--max-new-tokens", "12", "--samples-per-problem", "2",
                   "--temperature", "0.8", "--out", str(out))
    assert "pass@2" in text and "countdown" in text
    assert set(json.loads(out.read_text())["pass@k"]) == {"1", "2"}
