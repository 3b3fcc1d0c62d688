"""Custom data: JSONL rows with a chat-format `prompt` plus any extra columns.

    {"prompt": [{"role": "user", "content": "..."}], "answer_keys": "42"}

A malformed row fails with its file and line number.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROLES = {"system", "user", "assistant", "tool"}


class DataError(ValueError):
    """A dataset row or file that cannot be used; the message gives file and line."""


def json_error(e: json.JSONDecodeError) -> str:
    """A JSON line's error with the column Python's parser gives (1-based, in characters). The
    files are read with `newline="\\n"`: a raw carriage return inside a string stays in its line
    (reported here at its own column) instead of splitting the row into two phantom lines."""
    msg = e.msg.removesuffix(" at")  # "Invalid control character at" -> "... character"
    hint = " (escape it: \\t, \\r or \\n inside a string)" if msg == "Invalid control character" else ""
    return f"not valid JSON ({msg} at column {e.colno}){hint}"


def validate_row(row: Any, where: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    prompt = row.get("prompt")
    if isinstance(prompt, str):  # a bare string is a single user turn
        row = {**row, "prompt": [{"role": "user", "content": prompt}]}
        prompt = row["prompt"]
    if not isinstance(prompt, list) or not prompt:
        raise DataError(f"{where}: field `prompt` must be a non-empty list of {{role, content}} messages")
    for j, m in enumerate(prompt):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(
                f"{where}: prompt[{j}] must be {{\"role\": one of {sorted(ROLES)}, \"content\": string}}, got {m!r:.120}"
            )
    return row


def read_jsonl_objects(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """(where, row) for every non-empty line, where = "file:line"; bad JSON fails with file:line."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"data file {path} does not exist")
    rows = []
    with path.open(encoding="utf-8-sig", newline="\n") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line.rstrip("\r\n"))  # a cut-off row: "Unterminated string", as Python says
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: {json_error(e)}") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
            rows.append((where, row))
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def load_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Chat-format rows (validated), each failure naming its file and line."""
    return [validate_row(row, where) for where, row in read_jsonl_objects(path)]
