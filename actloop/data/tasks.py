"""Tasks: an environment, a rubric and data, bundled under a name.

`calculator` is the demo: multi-step word problems answered through a calculator tool.
`custom` is what `data.path=rows.jsonl` gives: the row's chat prompt, one assistant turn, and
the reward functions named in `reward.funcs`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

from actloop.config import Config, ConfigError
from actloop.data.jsonl import load_jsonl
from actloop.envs.base import ChatEnv, Env
from actloop.envs.calculator import CalculatorEnv, make_splits
from actloop.rewards.base import load_reward_func
from actloop.rewards.calculator import correct_answer, malformed_calls, used_tool
from actloop.rewards.rubric import RewardTerm, Rubric


@dataclass
class Task:
    name: str
    make_env: Callable[[], Env]
    rubric: Rubric
    train_rows: list[dict[str, Any]]
    eval_rows: list[dict[str, Any]]


def _user_terms(cfg: Config) -> list[RewardTerm]:
    weights = cfg.reward.weights or [1.0] * len(cfg.reward.funcs)
    return [RewardTerm(spec.rsplit(":", 1)[-1], load_reward_func(spec), w) for spec, w in zip(cfg.reward.funcs, weights)]


def build_task(cfg: Config) -> Task:
    user_terms = _user_terms(cfg)
    if cfg.data.path:
        rows = load_jsonl(cfg.data.path)
        if cfg.data.eval_path:
            eval_rows = load_jsonl(cfg.data.eval_path)
        else:  # hold out a seeded slice of the file
            rng = random.Random(cfg.seed)
            rows = rows[:]
            rng.shuffle(rows)
            n_eval = min(cfg.data.eval_size, len(rows) // 5)
            eval_rows, rows = rows[:n_eval], rows[n_eval:]
        if not user_terms:
            raise ConfigError("data.path needs reward.funcs: name at least one reward function")
        rubric = Rubric(user_terms, completion=cfg.reward.completion, success_threshold=cfg.reward.success_threshold)
        return Task("custom", ChatEnv, rubric, rows, eval_rows)
    if cfg.data.task == "calculator":
        train, held = make_splits(cfg.data.train_size, cfg.data.eval_size, cfg.seed)
        terms = [
            RewardTerm("correct", correct_answer, 1.0),
            RewardTerm("used_tool", used_tool, 0.0),
            RewardTerm("malformed", malformed_calls, 0.0),
        ] + user_terms
        rubric = Rubric(terms, completion=cfg.reward.completion, success_component="correct", success_threshold=1.0)
        return Task("calculator", CalculatorEnv, rubric, train, held)
    raise ConfigError(f"unknown task `{cfg.data.task}` (available: calculator; or set data.path)")
