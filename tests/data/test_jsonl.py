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


GOOD = '{"prompt": [{"role": "user", "content": "hi"}], "answer": 1}'


@pytest.mark.parametrize("bad", [
    '{"prompt": [{"role": "user", "content": "hi"}] "answer": 2}',  # missing comma
    '{"prompt": [{"role": "user", "content": "two\rlines"}], "answer": 1}',  # a raw carriage return
    '{"prompt": [{"role": "user", "content": "tab\there"}], "answer": 1}',  # a raw tab
    '{"prompt": [{"role": "user", "content": "naïve, café"}], "answer": ,}',  # non-ASCII before the error
    '{"prompt": "cut off mid-row',
    '{"prompt": "hi"} extra',  # trailing junk
])
def test_json_errors_give_the_line_and_column_pythons_parser_gives(tmp_path, bad):
    """Both JSONL readers name the file's own line and Python's column for it: a raw \\r inside a
    string no longer splits a row into a phantom next line reported at column 1."""
    import gzip
    import json

    from actloop.data.jsonl import read_jsonl_objects
    from actloop.data.sources import iter_records

    text = GOOD + "\n" + bad + "\n" + GOOD + "\n"
    try:
        json.loads(bad)
        raise AssertionError("the line should be bad JSON")
    except json.JSONDecodeError as e:
        want = f"at column {e.colno}"
    p = tmp_path / "rows.jsonl"
    p.write_bytes(text.encode("utf-8"))
    with pytest.raises(DataError) as err:
        read_jsonl_objects(p)
    assert str(err.value).startswith(f"{p}:2: not valid JSON (") and want in str(err.value), str(err.value)
    gz = tmp_path / "rows.jsonl.gz"
    gz.write_bytes(gzip.compress(text.encode("utf-8")))
    for src in (p, gz):
        records = list(iter_records(src))
        assert [w.rsplit(":", 1)[1] for w, _ in records] == ["1", "2", "3"]  # the file's three lines, no more
        assert want in str(records[1][1]), records[1][1]


def test_a_byte_order_mark_from_a_windows_editor_is_not_an_error(tmp_path):
    from actloop.data.sources import iter_records

    p = tmp_path / "rows.jsonl"
    p.write_bytes(("\ufeff" + GOOD + "\r\n" + GOOD + "\r\n").encode("utf-8"))
    assert len(load_jsonl(p)) == 2 and [r["answer"] for _, r in iter_records(p)] == [1, 1]
