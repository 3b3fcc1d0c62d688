"""Tasks: an environment, a rubric and data, bundled under a name (see docs/tasks.md).

| task | episode | reward |
|---|---|---|
| `calculator` | tool calls to a calculator, then "The answer is N" (the demo) | last number == target |
| `gsm8k` | one turn of chain of thought ending in `#### N` | maths grader |
| `gsm8k-tool` | reasoning interleaved with Python calls (a persistent session per episode) | maths grader |
| `mbpp` | write code, run the visible tests (a tool), revise | tests passed / tests (+ held-out) |
| `humaneval` | complete a function (evaluation only) | asserts passed / asserts |
| `instructions` | a writing task with 1-3 verifiable constraints (generated) | constraints met / constraints |
| `countdown` | reach a target with + - * / from given numbers (generated) | 1 if exact, else 0 |

`custom` is what `data.path=rows.jsonl` gives: the row's chat prompt, one assistant turn, and
the reward functions named in `reward.funcs`. `data.mix` mixes any of these by weight (see
`actloop.data.mix`). Every built-in row carries a `source` column (its task's name), except the
calculator demo's, which is kept exactly as it was.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from actloop.config import Config, ConfigError
from actloop.data.jsonl import DataError
from actloop.data.mix import MixedEnv, MixedRubric, allocate, mix_rows, parse_mix, tag
from actloop.data.sources import chat_row, is_hub_id, load_dataset_rows, read_rows
from actloop.envs.base import ChatEnv, Env
from actloop.envs.calculator import CalculatorEnv, make_splits
from actloop.rewards.base import load_reward_func
from actloop.rewards.calculator import correct_answer, malformed_calls, used_tool
from actloop.rewards.rubric import RewardTerm, Rubric

Row = dict[str, Any]


@dataclass
class Task:
    name: str
    make_env: Callable[[], Env]
    rubric: Rubric
    train_rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]
    info: dict[str, Any] = field(default_factory=dict)  # load reports: rows read and skipped per source


def _user_terms(cfg: Config) -> list[RewardTerm]:
    weights = cfg.reward.weights or [1.0] * len(cfg.reward.funcs)
    return [RewardTerm(spec.rsplit(":", 1)[-1], load_reward_func(spec), w) for spec, w in zip(cfg.reward.funcs, weights)]


# ------------------------------------------------------------------------------ built-in tasks


@dataclass(frozen=True)
class TaskDef:
    """A built-in task: its environment factory, its rubric's terms, and its rows per split."""

    name: str
    env: Callable[[], Env]
    terms: Callable[[], list[RewardTerm]]
    rows: Callable[[Config, str, int], tuple[list[Row], dict[str, Any]]]  # (cfg, split, n or -1 = all)
    success: str
    detectors: tuple = ()
    policies: tuple[tuple[str, str], ...] = ()  # flag -> policy, over the defaults


def _dataset(name: str) -> Callable[[Config, str, int], tuple[list[Row], dict[str, Any]]]:
    def rows(cfg: Config, split: str, n: int) -> tuple[list[Row], dict[str, Any]]:
        if name == "humaneval" and split == "train":
            raise ConfigError("humaneval has no training split (it is an evaluation set): evaluate with "
                              "`actloop eval --task humaneval`, or train on mbpp")
        got, report = load_dataset_rows(name, split, cfg.data.dir, cfg.data.bad_rows)
        return (got if n < 0 else got[:n]), report.to_dict()
    return rows


def _generated(make: Callable[..., tuple[list[Row], list[Row]]]) -> Callable[[Config, str, int], tuple[list[Row], dict]]:
    def rows(cfg: Config, split: str, n: int) -> tuple[list[Row], dict[str, Any]]:
        if split == "train":
            got = make(n if n >= 0 else cfg.data.train_size, 0, cfg.seed)[0]
        elif split in ("test", "validation"):
            got = make(0, n if n >= 0 else cfg.data.eval_size, cfg.seed, split)[1]
        else:
            raise ConfigError(f"generated tasks have splits train, test and validation; got `{split}`")
        return got, {"source": "generated", "rows": len(got), "skipped": 0}
    return rows


def _gsm8k_terms() -> list[RewardTerm]:
    from actloop.envs.gsm8k import final_math, hash_format

    return [RewardTerm("correct", final_math), RewardTerm("format", hash_format, 0.0)]


def _gsm8k_tool_terms() -> list[RewardTerm]:
    from actloop.envs.gsm8k import final_math, hash_format, tool_errors
    from actloop.envs.gsm8k import used_tool as used_python

    return [RewardTerm("correct", final_math), RewardTerm("format", hash_format, 0.0),
            RewardTerm("used_tool", used_python, 0.0), RewardTerm("tool_errors", tool_errors, 0.0)]


def _mbpp_terms() -> list[RewardTerm]:
    from actloop.envs.code import test_runs
    from actloop.rewards.code import CodeGrader

    return [RewardTerm("tests", CodeGrader()), RewardTerm("test_runs", test_runs, 0.0)]


def _humaneval_terms() -> list[RewardTerm]:
    from actloop.envs.code import HumanEvalGrader

    return [RewardTerm("tests", HumanEvalGrader())]


def _instructions_terms() -> list[RewardTerm]:
    from actloop.rewards.instructions import instructions_reward

    return [RewardTerm("instructions", instructions_reward())]


def _countdown_terms() -> list[RewardTerm]:
    from actloop.envs.countdown import answer_format, countdown_reward

    return [RewardTerm("correct", countdown_reward), RewardTerm("format", answer_format, 0.0)]


def _code_detectors() -> tuple:
    from actloop.rewards.hacking import CODE_DETECTORS

    return tuple(CODE_DETECTORS)


def _builtin() -> dict[str, TaskDef]:
    from actloop.envs import code, countdown, gsm8k, instructions

    return {
        "gsm8k": TaskDef("gsm8k", gsm8k.cot_env, _gsm8k_terms, _dataset("gsm8k"), "correct"),
        "gsm8k-tool": TaskDef("gsm8k-tool", gsm8k.GSM8KToolEnv, _gsm8k_tool_terms, _dataset("gsm8k"), "correct"),
        "mbpp": TaskDef("mbpp", code.MBPPEnv, _mbpp_terms, _dataset("mbpp"), "tests", _code_detectors()),
        # evaluation only: a detector flag is reported, not scored, so pass@k stays HumanEval's own
        # (two canonical solutions trip `special_casing` with their base cases: HumanEval/63, /66)
        "humaneval": TaskDef("humaneval", code.humaneval_env, _humaneval_terms, _dataset("humaneval"), "tests",
                             _code_detectors(), (("special_casing", "log"),)),
        "instructions": TaskDef("instructions", instructions.env, _instructions_terms,
                                _generated(instructions.make_splits), "instructions"),
        "countdown": TaskDef("countdown", countdown.env, _countdown_terms, _generated(countdown.make_splits), "correct"),
    }


TASK_NAMES = ("calculator", "gsm8k", "gsm8k-tool", "mbpp", "humaneval", "instructions", "countdown")
GENERATED = ("calculator", "instructions", "countdown")


def _rubric(d: TaskDef, cfg: Config, user_terms: list[RewardTerm]) -> Rubric:
    return Rubric(d.terms() + user_terms, completion=cfg.reward.completion, success_component=d.success,
                  success_threshold=1.0, detectors=d.detectors, policies=dict(d.policies))


def _calculator_rubric(cfg: Config, user_terms: list[RewardTerm]) -> Rubric:
    terms = [
        RewardTerm("correct", correct_answer, 1.0),
        RewardTerm("used_tool", used_tool, 0.0),
        RewardTerm("malformed", malformed_calls, 0.0),
    ] + user_terms
    return Rubric(terms, completion=cfg.reward.completion, success_component="correct", success_threshold=1.0)


def _check_data_keys(cfg: Config) -> None:
    if cfg.data.bad_rows not in ("error", "skip"):
        raise ConfigError(f"data.bad_rows must be error or skip; got `{cfg.data.bad_rows}`")
    if cfg.data.split not in ("train", "test", "validation"):
        raise ConfigError(f"data.split must be train, test or validation; got `{cfg.data.split}`")


def build_task(cfg: Config) -> Task:
    _check_data_keys(cfg)
    user_terms = _user_terms(cfg)
    if cfg.data.mix:
        return _build_mix(cfg, user_terms)
    if cfg.data.path:
        rows, info = _custom_rows(cfg.data.path, cfg)
        if cfg.data.eval_path:
            eval_rows, eval_info = _custom_rows(cfg.data.eval_path, cfg)
        else:  # hold out a seeded slice of the file
            rng = random.Random(cfg.seed)
            rows = rows[:]
            rng.shuffle(rows)
            n_eval = min(cfg.data.eval_size, len(rows) // 5)
            eval_rows, rows = rows[:n_eval], rows[n_eval:]
        if not user_terms:
            raise ConfigError("data.path needs reward.funcs: name at least one reward function")
        rubric = Rubric(user_terms, completion=cfg.reward.completion, success_threshold=cfg.reward.success_threshold)
        return Task("custom", ChatEnv, rubric, rows, eval_rows,
                    info={"load": [info] + ([eval_info] if cfg.data.eval_path else [])})
    if cfg.data.task == "calculator":
        if cfg.data.split == "validation":
            raise ConfigError("calculator has splits train and test (its held-out problems)")
        train, held = make_splits(cfg.data.train_size, cfg.data.eval_size, cfg.seed)
        rubric = _calculator_rubric(cfg, user_terms)
        return Task("calculator", CalculatorEnv, rubric, train, train[: cfg.data.eval_size] if cfg.data.split == "train"
                    else held)
    defs = _builtin()
    if cfg.data.task not in defs:
        raise ConfigError(f"unknown task `{cfg.data.task}` (available: {', '.join(TASK_NAMES)}; or set data.path "
                          "or data.mix)")
    d = defs[cfg.data.task]
    train, train_info = _rows(d, cfg, "train", -1 if d.name not in GENERATED else cfg.data.train_size)
    held, held_info = d.rows(cfg, cfg.data.split, cfg.data.eval_size)
    return Task(d.name, d.env, _rubric(d, cfg, user_terms), tag(train, d.name), tag(held, d.name),
                info={"load": [i for i in (train_info, held_info) if i]})


def _rows(d: TaskDef, cfg: Config, split: str, n: int) -> tuple[list[Row], dict[str, Any]]:
    if cfg.data.train_size <= 0:
        return [], {}
    return d.rows(cfg, split, n)


# ------------------------------------------------------------------------------------ mixtures


def _custom_rows(spec: str, cfg: Config) -> tuple[list[Row], dict[str, Any]]:
    """Custom rows (JSONL, gzipped JSONL, Parquet or a Hub id): a chat-format `prompt` each."""
    rows, report = read_rows(spec, chat_row, cfg.data.bad_rows)
    if not rows:
        raise DataError(f"{spec}: no rows" + (f" ({report.skipped} skipped as bad)" if report.skipped else ""))
    return rows, report.to_dict()


def _custom_source(spec: str, cfg: Config) -> tuple[str, list[Row], dict[str, Any]]:
    """A custom file (or Hub id) in a mixture: chat-format rows, graded by reward.funcs."""
    rows, info = _custom_rows(spec, cfg)
    name = spec if is_hub_id(spec) else Path(spec).name.split(".")[0]
    return name, rows, info


def _build_mix(cfg: Config, user_terms: list[RewardTerm]) -> Task:
    weights = parse_mix(cfg.data.mix)
    defs = _builtin()
    envs: dict[str, Callable[[], Env]] = {}
    rubrics: dict[str, Rubric] = {}
    pools: dict[str, list[Row]] = {}
    held: list[Row] = []
    info: list[dict[str, Any]] = []
    named: dict[str, float] = {}
    eval_counts = allocate(cfg.data.eval_size, weights, min_each=1 if cfg.data.eval_size > 0 else 0)
    for spec, w in weights.items():
        n_eval = eval_counts[spec]
        if spec == "calculator":
            train, h = make_splits(cfg.data.train_size, n_eval, cfg.seed)
            name, envs[spec], rubrics[spec] = spec, CalculatorEnv, _calculator_rubric(cfg, user_terms)
        elif spec in defs:
            d = defs[spec]
            name = spec
            train, ti = _rows(d, cfg, "train", -1 if d.name not in GENERATED else cfg.data.train_size)
            h, hi = d.rows(cfg, cfg.data.split, n_eval)
            info += [i for i in (ti, hi) if i]
            envs[name], rubrics[name] = d.env, _rubric(d, cfg, user_terms)
        else:
            if not user_terms:
                raise ConfigError(f"data.mix source `{spec}` is custom data: name its reward functions in reward.funcs")
            name, rows, ri = _custom_source(spec, cfg)
            info.append(ri)
            rows = rows[:]
            random.Random(f"mix-holdout-{cfg.seed}-{name}").shuffle(rows)
            k = min(n_eval, len(rows) // 5)
            h, train = rows[:k], rows[k:]
            envs[name] = ChatEnv
            rubrics[name] = Rubric(list(user_terms), completion=cfg.reward.completion,
                                   success_threshold=cfg.reward.success_threshold)
        if name in pools:
            raise ConfigError(f"data.mix: two sources are named `{name}`")
        pools[name], named[name] = tag(train, name), w
        held += tag(h, name)
    train_rows = mix_rows(pools, named, cfg.data.train_size, cfg.seed) if cfg.data.train_size > 0 else []
    rubric = MixedRubric(terms=[], completion=cfg.reward.completion, parts=rubrics)
    return Task("mix", functools.partial(MixedEnv, envs), rubric, train_rows, held,
                info={"load": info, "mix": named})
