import pytest

from actloop.data.jsonl import DataError, load_jsonl


def test_rows_load_with_extra_columns(tmp_path):
    p = tmp_path / "rows.jsonl"
    p.write_text('{"prompt": [{"role": "user", "content": "hi"}], "answer_keys": "4"}\n\n{"prompt": "bare", "k": 1}\n')
    rows = load_jsonl(p)
    assert rows[0]["answer_keys"] == "4" and rows[1]["prompt"] == [{"role": "user", "content": "bare"}]


@pytest.mark.parametrize("line,msg", [
    ("{not json", "rows.jsonl:2: not valid JSON"),
    ("[1, 2]", "rows.jsonl:2: a row must be a JSON object"),
    ('{"text": "no prompt"}', "rows.jsonl:2: field `prompt`"),
    ('{"prompt": [{"role": "robot", "content": "x"}]}', "rows.jsonl:2: prompt[0]"),
    ('{"prompt": [{"role": "user", "content": 5}]}', "rows.jsonl:2: prompt[0]"),
])
def test_malformed_row_fails_with_file_and_line(tmp_path, line, msg):
    p = tmp_path / "rows.jsonl"
    p.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(DataError) as e:
        load_jsonl(p)
    assert msg in str(e.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_jsonl(tmp_path / "nope.jsonl")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no rows"):
        load_jsonl(tmp_path / "e.jsonl")
