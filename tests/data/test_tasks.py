"""Built-in tasks: what `build_task` gives for each, its splits and its errors."""

import pytest

from actloop.config import ConfigError, load_config
from actloop.data.jsonl import DataError
from actloop.data.sources import data_dir
from actloop.tasks.registry import BUILTIN, build_task
from actloop.tasks.calculator import make_splits

needs_data = pytest.mark.skipif(not (data_dir() / "gsm8k" / "test.jsonl").exists(),
                                reason="no local GSM8K/MBPP copies (set ACTLOOP_DATA_DIR)")


def build(*over):
    return build_task(load_config(None, list(over)))


def test_calculator_is_unchanged():
    t = build()
    train, held = make_splits(2000, 100, 0)
    untagged = [[{k: v for k, v in r.items() if k != "source"} for r in rows] for rows in (t.train_rows, t.eval_rows)]
    assert (t.name, untagged) == ("calculator", [train, held])  # the demo's rows, with their `source` column
    assert {r["source"] for r in t.train_rows + t.eval_rows} == {"calculator"}
    assert [x.name for x in t.rubric.terms] == ["correct", "used_tool", "malformed"]


@needs_data
@pytest.mark.parametrize("name", [n for n in BUILTIN if n not in ("calculator", "humaneval")])
def test_each_task_builds_with_tagged_rows(name):
    t = build(f"data.task={name}", "data.eval_size=7", "data.train_size=30")
    assert t.name == name and len(t.eval_rows) == 7 and t.train_rows
    assert {r["source"] for r in t.train_rows + t.eval_rows} == {name}
    messages, tools = t.make_env().reset(t.eval_rows[0])
    assert messages[0].role == "system" and messages[-1].role == "user"
    assert sum(m.role == "assistant" for m in messages) >= 1  # the format is shown, not told
    assert bool(tools) == (name in ("gsm8k-tool", "mbpp"))


@needs_data
def test_dataset_splits():
    assert len(build("data.task=gsm8k", "data.eval_size=5000").eval_rows) == 1319
    assert len(build("data.task=gsm8k").train_rows) == 7473  # dataset tasks use their whole train split
    val = build("data.task=mbpp", "data.split=validation", "data.eval_size=1000").eval_rows
    assert [r["task_id"] for r in val] == list(range(511, 601))
    assert build("data.task=mbpp", "data.train_size=0").train_rows == []
    with pytest.raises(DataError, match="gsm8k has no split `validation`"):
        build("data.task=gsm8k", "data.split=validation")


@needs_data
def test_gold_answers_of_the_text_tasks_score_full_marks():
    for name in ("gsm8k", "gsm8k-tool", "countdown"):
        t = build(f"data.task={name}", "data.eval_size=200", "data.train_size=0")
        assert t.rubric.validate(t.eval_rows, BUILTIN[name].gold, n=None).ok


def test_errors_name_the_problem(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="unknown task `poetry` .*gsm8k-tool"):
        build("data.task=poetry")
    with pytest.raises(ConfigError, match="humaneval has no training split"):
        build("data.task=humaneval")
    with pytest.raises(ConfigError, match="data.bad_rows must be one of error, skip; got `maybe`"):
        build("data.bad_rows=maybe")
    with pytest.raises(ConfigError, match="data.split must be"):
        build("data.split=dev")
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q"}\n')
    (tmp_path / "gsm8k" / "train.jsonl").write_text('{"question": "q", "answer": "#### 1"}\n')
    monkeypatch.setenv("ACTLOOP_DATA_DIR", str(tmp_path))
    with pytest.raises(DataError, match=r"gsm8k/test.jsonl:2: field `answer`: missing"):
        build("data.task=gsm8k")
    t = build("data.task=gsm8k", "data.bad_rows=skip")
    assert len(t.eval_rows) == 1 and t.info["load"][1]["skipped"] == 1


def test_generated_splits_are_disjoint_and_seeded():
    t = build("data.task=countdown", "data.train_size=300", "data.eval_size=50")
    key = lambda r: (tuple(sorted(r["numbers"])), r["target"])  # noqa: E731
    assert not {key(r) for r in t.train_rows} & {key(r) for r in t.eval_rows}
    v = build("data.task=countdown", "data.split=validation", "data.eval_size=50").eval_rows
    assert v != t.eval_rows
    assert build("data.task=instructions", "seed=5").eval_rows != build("data.task=instructions").eval_rows


def test_custom_data_path_reads_parquet_and_skips_bad_rows(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    reward = tmp_path / "r.py"
    reward.write_text("def one(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": f"say {i}", "k": i} for i in range(10)] + [{"prompt": None, "k": -1}]),
                   path)
    over = [f"data.path={path}", f"reward.funcs=[{reward}:one]", "data.eval_size=2"]
    with pytest.raises(DataError, match=r"rows.parquet:row 11: field `prompt`"):
        build(*over)
    t = build(*over, "data.bad_rows=skip")
    assert t.name == "custom" and len(t.train_rows) + len(t.eval_rows) == 10 and len(t.eval_rows) == 2
    assert t.info["load"][0]["skipped"] == 1
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="no rows"):
        build(f"data.path={empty}", f"reward.funcs=[{reward}:one]")


def test_custom_rows_held_out_for_evaluation_are_said(tmp_path):
    """8 rows and no data.eval_path: a seeded fifth (1 row) is held out, and the task says so in
    a note the trainers print at start; with data.eval_path nothing is held out of data.path."""
    import json

    reward = tmp_path / "r.py"
    reward.write_text("def one(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"say {i}"}) + "\n" for i in range(8)))
    t = build(f"data.path={rows}", f"reward.funcs=[{reward}:one]")
    assert (len(t.train_rows), len(t.eval_rows)) == (7, 1)
    assert t.info["notes"] == [f"{rows}: holding out 1 of 8 rows for evaluation (a seeded fifth at most, capped at "
                               "data.eval_size); set data.eval_path to choose"]
    t = build(f"data.path={rows}", f"data.eval_path={rows}", f"reward.funcs=[{reward}:one]")
    assert (len(t.train_rows), len(t.eval_rows), t.info["notes"]) == (8, 8, [])
    mix = build(f"data.mix=[{rows}:1,calculator:1]", f"reward.funcs=[{reward}:one]", "data.eval_size=10")
    assert mix.info["notes"] == [f"{rows}: holding out 1 of 8 rows for evaluation (a seeded fifth at most, capped "
                                 "at data.eval_size); in a data.mix, data.eval_size is shared out by weight"]
