"""`actloop grade`: one completion, one row, one JSON line."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from actloop.cli import app
from actloop.sandbox import probe_bwrap

runner = CliRunner()


def grade(tmp_path, text, *args):
    f = tmp_path / "answer.txt"
    f.write_text(text)
    return runner.invoke(app, ["grade", *args, "--completion", str(f), "--json"])


def record(result):
    assert result.exit_code == 0, result.output
    (line,) = [ln for ln in result.stdout.splitlines() if ln.strip()]
    return json.loads(line)


@pytest.mark.data("gsm8k")
def test_gsm8k_right_and_hedged(tmp_path):
    r = record(grade(tmp_path, "9 * 2 = 18\n#### 18", "--task", "gsm8k", "--id", "0"))
    assert (r["reward"], r["passed"], r["total"], r["flags"], r["components"]) == (1.0, 1, 1, [], {"correct": 1.0, "format": 1.0})  # the training rubric
    r = record(grade(tmp_path, "#### 17 or 18", "--task", "gsm8k", "--id", "0"))
    assert r["reward"] == 0.0 and r["passed"] == 0
    assert r["flags"][0]["name"] == "hedged_answer" and "17, 18" in r["flags"][0]["evidence"]
    assert r["flags"][0]["action"] == "zero"


@pytest.mark.skipif(not probe_bwrap().available, reason="the code grader runs in the bwrap sandbox")
@pytest.mark.data("mbpp")
def test_mbpp_fenced_code_and_a_lookup_table(tmp_path):
    honest = "Here you go:\n```python\ndef similar_elements(a, b):\n    return tuple(sorted(set(a) & set(b)))\n```\nDone."
    r = record(grade(tmp_path, honest, "--task", "mbpp", "--id", "2"))
    assert (r["reward"], r["passed"], r["total"], r["flags"]) == (1.0, 3, 3, [])
    table = ("def similar_elements(a, b):\n    return {((3, 4, 5, 6), (5, 7, 4, 10)): (4, 5), ((1, 2, 3, 4), (5, 4, 3, 7)):"
             " (3, 4), ((11, 12, 14, 13), (17, 15, 14, 13)): (13, 14)}[(a, b)]")
    r = record(grade(tmp_path, table, "--task", "mbpp", "--id", "2"))  # no fence: the whole text is the code
    assert (r["passed"], r["total"], r["reward"]) == (3, 3, 0.0)
    assert sorted(f["name"] for f in r["flags"]) == ["differential_mismatch", "special_casing"]
    # without --json: the counter-example from the generated inputs is on the flag's line
    f = tmp_path / "table.py"
    f.write_text(table)
    out = runner.invoke(app, ["grade", "--task", "mbpp", "--id", "2", "--completion", str(f)]).stdout
    line = next(ln for ln in out.splitlines() if "differential_mismatch" in ln)
    assert "similar_elements((" in line and "expected" in line and "got" in line


def test_instructions_from_a_data_file_and_the_data_dir_override(tmp_path, monkeypatch):
    rows = tmp_path / "if.jsonl"
    rows.write_text(json.dumps({"prompt": "x", "constraints": [{"type": "no_commas"}, {"type": "lowercase"}]}) + "\n")
    r = record(grade(tmp_path, "all lower, but a comma", "--task", "instructions", "--id", "0", "--data", str(rows)))
    assert (r["reward"], r["passed"], r["total"]) == (0.5, 1, 2)
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text(json.dumps({"question": "q", "answer": "#### 7"}) + "\n")
    monkeypatch.setenv("ACTLOOP_DATA_DIR", str(tmp_path))
    assert record(grade(tmp_path, "#### 7", "--task", "gsm8k", "--id", "0"))["reward"] == 1.0


@pytest.mark.parametrize("args,msg", [
    (["--task", "poetry", "--id", "0"], "unknown task"),
    pytest.param(["--task", "gsm8k", "--id", "5000"], "rows 0..1318", marks=pytest.mark.data("gsm8k")),
    pytest.param(["--task", "mbpp", "--id", "99999"], "no mbpp row with task_id 99999", marks=pytest.mark.data("mbpp")),
    (["--task", "nope.py:TASK", "--id", "0"], "does not exist"),
    (["--task", "json:__name__", "--id", "0"], "is a str, not an actloop Task"),
    (["--task", "json:loads", "--id", "0"], "calling it with the config failed"),
])
def test_bad_arguments_fail_with_a_message(tmp_path, args, msg):
    result = grade(tmp_path, "#### 1", *args)
    assert result.exit_code == 2 and msg in result.output


@pytest.mark.data("gsm8k")
def test_without_json_it_shows_the_row_it_graded(tmp_path):
    f = tmp_path / "answer.txt"
    f.write_text("9 * 2 = 18\n#### 18")
    out = runner.invoke(app, ["grade", "--task", "gsm8k", "--id", "0", "--completion", str(f)]).stdout
    lines = out.splitlines()
    assert lines[0].startswith("gsm8k #0: reward 1, correct, components")  # not "1/1 passed": there are no tests
    assert lines[1].startswith("  question: Janet") and "expected (the task's reference answer):" in lines[2]
    assert "#### 18" in lines[2]


@pytest.mark.data("gsm8k")
def test_the_installed_entry_point_prints_one_json_line(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("\\boxed{3}")
    out = subprocess.run([sys.executable, "-m", "actloop", "grade", "--task", "gsm8k", "--id", "1",
                          "--completion", str(f), "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["reward"] == 1.0
