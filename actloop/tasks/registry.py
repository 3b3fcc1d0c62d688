"""The one task registry: what `data.task` (train, eval, grade, data.mix, compare, report) names.

    resolve("gsm8k")                       # a built-in task (`actloop tasks` lists them)
    resolve("my_pkg.tasks:TASK")           # a Task object in an importable module
    resolve("path/to/my_task.py:TASK")     # a Task object in a file
    resolve("my_pkg.agents:make_task", cfg)  # a function cfg -> Task (tasks built from the config)
    build_task(cfg)                        # -> LoadedTask: environment factory, rubric, rows

Rows: a task's own (`Task.splits` generates them, `Task.dataset` reads a built-in dataset), or
`data.path` (a JSONL / Parquet file or Hub id) with the task's environment and rubric. With the
default task and `data.path`, the rows are custom chat rows (`prompt`) answered in one turn and
graded by `reward.funcs` (`custom`). `data.mix` mixes any of these by weight. Every row gets a
`source` column: its task's name.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from pathlib import Path
from typing import Any, Callable

from actloop.config import BadRows, Config, ConfigError, Split, choice_error, choices, load_config
from actloop.data.jsonl import DataError
from actloop.data.mix import MixedEnv, MixedRubric, allocate, mix_rows, parse_mix, tag
from actloop.data.sources import DATASETS, chat_row, is_hub_id, load_dataset_rows, read_rows
from actloop.envs.base import ChatEnv, Env
from actloop.rewards import code as code_rewards
from actloop.rewards.base import RewardError, load_object, load_reward_func, required_columns
from actloop.rewards.code import CodeGrader
from actloop.rewards.differential import DiffSettings
from actloop.rewards.flags import Flag
from actloop.rewards.rubric import RewardTerm, Rubric, text_trajectory
from actloop.sandbox.base import SandboxError
from actloop.sandbox.factory import sandbox_from_config
from actloop.tasks import calculator, countdown, gsm8k, gsm8k_tool, humaneval, instructions, mbpp
from actloop.tasks.base import LoadedTask, Row, Task

BUILTIN: dict[str, Task] = {m.TASK.name: m.TASK for m in (calculator, gsm8k, gsm8k_tool, mbpp, humaneval,
                                                              instructions, countdown)}
DEFAULT_TASK = "calculator"  # data.path with this task means custom chat rows (see the module doc)


def is_task_spec(spec: str) -> bool:
    """A built-in name or `module:OBJECT` / `file.py:OBJECT` (not a data file or Hub id)."""
    return spec in BUILTIN or ":" in spec


def resolve(spec: str, cfg: Config | None = None) -> Task:
    """The `Task` that `spec` names: a built-in name, `package.module:OBJECT` or `file.py:OBJECT`.

    OBJECT is a `Task`, or a function `(cfg) -> Task` for tasks built from the configuration
    (an agent task whose entry point is a config key, say); it is called with `cfg` (the
    defaults when None)."""
    if spec in BUILTIN:
        return BUILTIN[spec]
    if ":" not in spec:
        raise ConfigError(f"unknown task `{spec}` (built-in: {', '.join(BUILTIN)}; or `module:OBJECT`, "
                          "`path/to/file.py:OBJECT`; or set data.path or data.mix)")
    try:
        obj = load_object(spec, "task", "OBJECT")
    except RewardError as e:
        raise ConfigError(str(e)) from None
    if callable(obj) and not isinstance(obj, (Task, type)):
        try:
            obj = obj(cfg if cfg is not None else load_config(None, []))
        except Exception as e:
            raise ConfigError(f"task `{spec}`: calling it with the config failed: {type(e).__name__}: {e} "
                              "(OBJECT must be a Task or a function cfg -> Task)") from e
    if not isinstance(obj, Task):
        raise ConfigError(f"`{spec}` is a {type(obj).__name__}, not an actloop Task (from actloop import Task)")
    return obj


def _user_terms(cfg: Config) -> list[RewardTerm]:
    weights = cfg.reward.weights or [1.0] * len(cfg.reward.funcs)
    return [RewardTerm(spec.rsplit(":", 1)[-1], load_reward_func(spec), w) for spec, w in zip(cfg.reward.funcs, weights)]


def _check_data_keys(cfg: Config) -> None:
    """The choices load_config checks, again for a Config built in code."""
    for key, value, tp in (("data.bad_rows", cfg.data.bad_rows, BadRows), ("data.split", cfg.data.split, Split)):
        if value not in choices(tp):
            raise choice_error(key, value, choices(tp))


def task_rows(task: Task, cfg: Config, n_eval: int) -> tuple[list[Row], list[Row], list[dict[str, Any]]]:
    """(training rows, `n_eval` held-out rows of `data.split`, load reports) of a task's own rows."""
    split, train_size = cfg.data.split, cfg.data.train_size
    if task.eval_only and train_size > 0:
        raise ConfigError(f"{task.name} has no training split (it is an evaluation set): evaluate with "
                          f"`actloop eval --task {task.name}`, or set data.train_size=0")
    if task.dataset is not None:
        info = []
        train: list[Row] = []
        if train_size > 0:
            train, report = load_dataset_rows(task.dataset, "train", cfg.data.dir, cfg.data.bad_rows)
            info.append(report.to_dict())
        held, report = load_dataset_rows(task.dataset, split, cfg.data.dir, cfg.data.bad_rows)
        info.append(report.to_dict())
        return train, held[:n_eval], info
    if task.splits is not None:
        try:
            # data.split=train: held-out rows are the first training rows (generated as for `test`)
            train, held = task.splits(max(train_size, 0), n_eval, cfg.seed, "test" if split == "train" else split)
        except ValueError as e:
            raise ConfigError(f"task {task.name}: {e}") from None
        if split == "train":
            held = train[:n_eval]
        return train, held, [{"source": "generated", "rows": len(train) + len(held), "skipped": 0}]
    raise ConfigError(f"task {task.name} has no rows of its own (no splits, no dataset): give them with data.path")


def _file_rows(spec: str, cfg: Config, validate=chat_row) -> tuple[list[Row], dict[str, Any]]:
    """Rows of a JSONL / Parquet file or Hub id (custom rows: a chat-format `prompt` each)."""
    rows, report = read_rows(spec, validate, cfg.data.bad_rows)
    if not rows:
        raise DataError(f"{spec}: no rows" + (f" ({report.skipped} skipped as bad)" if report.skipped else ""))
    return rows, report.to_dict()


def hold_out(rows: list[Row], n_eval: int, seed: int | str, source: str,
             hint: str = "set data.eval_path to choose") -> tuple[list[Row], list[Row], str]:
    """(held-out rows, training rows, the line saying so): a seeded fifth of custom rows at most,
    capped at `n_eval`, when no data.eval_path names held-out rows."""
    rows = rows[:]
    random.Random(seed).shuffle(rows)
    k = min(n_eval, len(rows) // 5)
    note = (f"{source}: holding out {k} of {len(rows)} rows for evaluation (a seeded fifth at most, capped at "
            f"data.eval_size); {hint}")
    return rows[:k], rows[k:], note


def _path_rows(cfg: Config, validate=chat_row) -> tuple[list[Row], list[Row], list[dict[str, Any]], list[str]]:
    """data.path's rows, held out by data.eval_path or a seeded fifth of the file (and the note
    that says so, printed at the start of a run)."""
    rows, info = _file_rows(cfg.data.path, cfg, validate)
    if cfg.data.eval_path:
        eval_rows, eval_info = _file_rows(cfg.data.eval_path, cfg, validate)
        return rows, eval_rows[: cfg.data.eval_size], [info, eval_info], []
    held, train, note = hold_out(rows, cfg.data.eval_size, cfg.seed, cfg.data.path)
    return train, held, [info], [note]


def _use_configured_sandbox(cfg: Config) -> None:
    """A non-default `sandbox` section becomes the process-wide sandbox the code tasks'
    graders and tools use (built now, so a missing daemon or image fails before training)."""
    sc = cfg.sandbox
    if sc.backend == "auto" and not sc.require_isolation:
        return  # the lazy default: bwrap where it works
    try:
        code_rewards._DEFAULT_SANDBOX = sandbox_from_config(sc.backend, sc.docker_image, sc.require_isolation)
    except SandboxError as e:
        raise ConfigError(f"sandbox.backend={sc.backend}: {e}") from None


def build_task(cfg: Config, definition: Task | None = None) -> LoadedTask:
    """The task `cfg` describes, resolved for a run: environment factory, a new rubric, rows.
    `definition` replaces the one `data.task` names (the gateway's agent task, built from
    `agent.entry`)."""
    _check_data_keys(cfg)
    _use_configured_sandbox(cfg)
    user_terms = _user_terms(cfg)
    if cfg.data.mix:
        return _build_mix(cfg, user_terms)
    if cfg.data.path and cfg.data.task == DEFAULT_TASK and definition is None:
        if not user_terms:
            raise ConfigError("data.path needs reward.funcs: name at least one reward function")
        train, held, info, notes = _path_rows(cfg)
        check_columns(cfg.data.path, train + held, user_terms)
        rubric = Rubric(user_terms, completion=cfg.reward.completion, success_threshold=cfg.reward.success_threshold)
        return LoadedTask("custom", ChatEnv, rubric, train, held, info={"load": info, "notes": notes})
    task = definition or resolve(cfg.data.task, cfg)
    notes: list[str] = []
    if cfg.data.path:  # the user's rows, the task's environment and rubric
        train, held, info, notes = _path_rows(cfg, validate=None)
    else:
        train, held, info = task_rows(task, cfg, cfg.data.eval_size)
    rubric = _configured(task.rubric(cfg.reward.completion, user_terms), cfg)
    # the user's rows against every reward function; the task's own rows against the user's functions
    check_columns(cfg.data.path or task.name, train + held, rubric.terms if cfg.data.path else user_terms)
    return LoadedTask(task.name, task.env, rubric,
                      tag(train, task.name),
                      tag(held, task.name), info={"load": info, "notes": notes}, rollout=task.rollout,
                      definition=task)


def check_columns(source: str, rows: list[Row], terms: list[RewardTerm]) -> None:
    """Every row holds the columns the user's reward functions name (`required_columns`), checked
    before a run directory is made: a missing one would reach the function as None."""
    for term in terms:
        need = required_columns(term.func)
        for i, row in enumerate(rows):
            missing = [c for c in need if c not in row]
            if missing:
                where = getattr(term.func, "__code__", None)
                at = f" ({where.co_filename}:{where.co_firstlineno})" if where else ""
                raise ConfigError(f"{source}: a row ({row_label(row, i)}) has no column `{missing[0]}`, which reward "
                                  f"function `{term.name}`{at} takes; its columns: {', '.join(sorted(row)) or 'none'} "
                                  f"(give the parameter a default if the column is optional)")


def row_label(row: Row, i: int) -> str:
    if "id" in row:
        return f"id {row['id']!r}"
    text = row.get("question") or row.get("prompt") or ""
    if isinstance(text, list):  # chat messages: the last one's words
        text = (text[-1] or {}).get("content", "") if isinstance(text[-1], dict) else ""
    text = " ".join(str(text).split())
    return f"row {i + 1} as loaded" + (f", {text[:60]!r}" if text else "")


def with_differential(rubric: Rubric, settings: DiffSettings | None = None, **changes: Any) -> Rubric:
    """The rubric with `settings` (or the grader's own with `changes`, e.g. ``inputs=5``) on
    each of its code graders (`Task.rubric()` gives fresh copies)."""
    for term in rubric.terms:
        if isinstance(term.func, CodeGrader):
            term.func.differential = dataclasses.replace(settings or term.func.differential, **changes)
    return rubric


def _configured(rubric: Rubric, cfg: Config) -> Rubric:
    """`reward.differential*` applied to the rubric's code graders (`auto`: each task's own mode)."""
    r = cfg.reward
    mode = {} if r.differential == "auto" else {"mode": r.differential}
    return with_differential(rubric, inputs=r.differential_inputs, seed=r.differential_seed, **mode)


def _build_mix(cfg: Config, user_terms: list[RewardTerm]) -> LoadedTask:
    weights = parse_mix(cfg.data.mix)
    envs: dict[str, Callable[[], Env]] = {}
    rubrics: dict[str, Rubric] = {}
    pools: dict[str, list[Row]] = {}
    held: list[Row] = []
    info: list[dict[str, Any]] = []
    named: dict[str, float] = {}
    notes: list[str] = []
    eval_counts = allocate(cfg.data.eval_size, weights, min_each=1 if cfg.data.eval_size > 0 else 0)
    for spec, w in weights.items():
        n_eval = eval_counts[spec]
        if is_task_spec(spec):
            task = resolve(spec, cfg)
            if task.rollout is not None:
                raise ConfigError(f"data.mix: task `{task.name}` runs its own episodes (Task.rollout) and cannot be "
                                  "mixed with others")
            name = task.name
            train, h, ti = task_rows(task, cfg, n_eval)
            info += ti
            envs[name], rubrics[name] = task.env, _configured(task.rubric(cfg.reward.completion, user_terms), cfg)
        else:
            if not user_terms:
                raise ConfigError(f"data.mix source `{spec}` is custom data: name its reward functions in reward.funcs")
            rows, ri = _file_rows(spec, cfg)
            name = spec if is_hub_id(spec) else Path(spec).name.split(".")[0]
            info.append(ri)
            h, train, note = hold_out(rows, n_eval, f"mix-holdout-{cfg.seed}-{name}", spec,
                                      "in a data.mix, data.eval_size is shared out by weight")
            notes.append(note)
            envs[name] = ChatEnv
            rubrics[name] = Rubric(list(user_terms), completion=cfg.reward.completion,
                                   success_threshold=cfg.reward.success_threshold)
        if name in pools:
            raise ConfigError(f"data.mix: two sources are named `{name}`")
        pools[name], named[name] = tag(train, name), w
        held += tag(h, name)
    train_rows = mix_rows(pools, named, cfg.data.train_size, cfg.seed) if cfg.data.train_size > 0 else []
    rubric = MixedRubric(terms=[], completion=cfg.reward.completion, parts=rubrics)
    return LoadedTask("mix", functools.partial(MixedEnv, envs), rubric, train_rows, held,
                      info={"load": info, "mix": named, "notes": notes})


# ---------------------------------------------------------------------------------- grading

GENERATED_ROWS = 1000  # generated held-out rows `actloop grade --id` chooses from (seed 0)


def grade_rows(task: Task, path: str | Path | None = None, data_dir: str | None = None) -> list[Row]:
    """The rows `actloop grade --id` looks in: `path` (validated as the task's dataset, if it has
    one), else the task's dataset (every split when rows carry an id column, else `test`), else
    its generated held-out rows (seed 0)."""
    validate = DATASETS[task.dataset].validate if task.dataset else None
    if path is not None:
        if not Path(path).exists():
            raise ConfigError(f"data file {path} does not exist")
        return read_rows(str(path), validate)[0]
    if task.dataset is not None:
        splits = DATASETS[task.dataset].splits if task.id_field else ("test",)
        seen: dict[Any, Row] = {}
        for s in splits:
            for i, r in enumerate(load_dataset_rows(task.dataset, s, data_dir)[0]):
                seen.setdefault(r.get(task.id_field, (s, i)) if task.id_field else (s, i), r)
        return list(seen.values())
    if task.splits is not None:
        return task.splits(0, GENERATED_ROWS, 0, "test")[1]
    raise ConfigError(f"task {task.name} has no rows of its own: pass --data PATH")


def find_row(task: Task, id: int, rows: list[Row]) -> Row:
    """The row `id` names: its `Task.id_field` column where it has one (MBPP's task_id), else its
    0-based index."""
    key = task.id_field
    if key and any(key in r for r in rows):
        for r in rows:
            if r.get(key) == id:
                return r
        raise ConfigError(f"no {task.name} row with {key} {id}")
    if not 0 <= id < len(rows):
        raise ConfigError(f"{task.name} has rows 0..{len(rows) - 1}; got --id {id}")
    return rows[id]


def grade_one(task: Task, row: Row, completion: str) -> dict[str, Any]:
    """Grade one completion against one row with the task's rubric, as training scores a final
    answer: a JSON-ready record ``{"reward", "components", "flags": [{name, evidence, source,
    action}], "passed", "total", "details_counted", "success", "masked", "errors", "details"}``.
    `passed` / `total` count tests (code) or constraints (instructions), `details_counted` True;
    else the one answer (1/1 or 0/1)."""
    rubric = task.rubric()
    check_columns(f"the {task.name} row", [row], rubric.terms)  # a clear error, not a masked TypeError
    details: list[dict[str, Any]] = []
    (scored,) = rubric.score([text_trajectory(completion, row)], details=details)
    info = next((i for i in details[0].values() if "passed" in i and "total" in i), None)
    passed, total = (info["passed"], info["total"]) if info else (int(scored.success), 1)
    return {
        "task": task.name,
        "reward": scored.reward,
        "components": scored.components,
        "flags": [f.to_dict() if isinstance(f, Flag) else {"name": str(f)} for f in scored.flags],
        "passed": passed,
        "total": total,
        "details_counted": info is not None,
        "success": scored.success,
        "masked": scored.masked,
        "errors": rubric.errors,
        "details": details[0],
    }
