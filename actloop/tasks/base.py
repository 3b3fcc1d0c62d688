"""`Task`: everything train, eval and grade need to know about one task, in one object.

    TASK = Task(
        name="calculator",
        env=CalculatorEnv,                                   # a new environment per episode
        rewards=[RewardTerm("correct", correct_answer),      # or plain TRL-style functions
                 RewardTerm("used_tool", used_tool, 0.0)],   # weight 0 = logged only
        splits=make_splits,                                  # generated rows (or dataset="gsm8k")
        success="correct", gold=gold_completion, gold_trace=gold_trace,
        description="one line for `actloop tasks`",
    )

A task's module lives anywhere: `data.task` names a built-in (`actloop tasks` lists them), a
`package.module:OBJECT` or a `path/to/file.py:OBJECT` (see `actloop.tasks.registry`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from actloop.envs.base import Env
from actloop.rewards.flags import Detector
from actloop.rewards.rubric import RewardTerm, Rubric
from actloop.types import Message

Row = dict[str, Any]
# (train_size, eval_size, seed, split) -> (training rows, held-out rows of `split`), disjoint
Splits = Callable[[int, int, int, str], tuple[list[Row], list[Row]]]
# the episode runner's signature (`actloop.rollout.episodes.run_episodes`):
# (engine, renderer, make_env, rows, params, max_turns, max_context) -> trajectories
Rollout = Callable[..., list]


@dataclass(frozen=True)
class Task:
    """A task definition. Only `name`, `env` and `rewards` are required.

    name: what runs, samples and reports call it (rows get it as their `source` column).
    env: a zero-argument factory (a class is one) of an `Env`; one environment per episode.
    rewards: the rubric's terms: `RewardTerm(name, func, weight)`, or a plain TRL-style reward
        function (`func(prompts, completions, **columns) -> list[float | Grade | None]`), which
        counts with weight 1 under its `__name__`. `reward.funcs` adds terms to every task.
    splits: generated rows, `splits(train_size, eval_size, seed, split) -> (train, held_out)`;
        held-out rows of `split` ("test" or "validation") must not appear in training.
    dataset: instead of `splits`, a built-in dataset (`gsm8k`, `mbpp`, `humaneval`) whose
        rows `data.dir` holds. With neither, rows come only from `data.path`.
    success: the component that decides success (>= `success_threshold`); None: the total.
    detectors / policies: hack detectors run on every scored trajectory, and what each flag
        does (`zero`, `log`, ...: see docs/rewards.md).
    gold: row -> a reference completion that scores full marks (`Rubric.validate`, tests).
    gold_trace: row -> the reference episode as messages, everything after the environment's
        prompt (assistant turns with their `tool_calls`, the `tool` results the environment would
        answer, the final answer), or None for a row that has none. `algo=sft` without
        `data.path` trains on these (`actloop.train.offline.pairs.gold_sequences`); None: no gold traces.
    description: one line for `actloop tasks`.
    id_field: the column `actloop grade --id` looks rows up by (else the row's index).
    eval_only: no training split (an evaluation set).
    rollout: a custom episode runner with `run_episodes`' signature, for tasks that produce
        trajectories their own way (an agent behind a gateway); None = the standard loop.
    """

    name: str
    env: Callable[[], Env]
    rewards: Sequence[RewardTerm | Callable[..., Any]]
    splits: Splits | None = None
    dataset: str | None = None
    success: str | None = None
    success_threshold: float = 1.0
    detectors: Sequence[Detector] = ()
    policies: Mapping[str, str] = field(default_factory=dict)
    gold: Callable[[Row], str] | None = None
    gold_trace: Callable[[Row], list[Message] | None] | None = None
    description: str = ""
    id_field: str | None = None
    eval_only: bool = False
    rollout: Rollout | None = None

    def terms(self) -> list[RewardTerm]:
        """The reward terms, each function a fresh copy (graders hold settings such as workers)."""
        out = []
        for r in self.rewards:
            term = r if isinstance(r, RewardTerm) else RewardTerm(getattr(r, "__name__", type(r).__name__), r)
            out.append(RewardTerm(term.name, _fresh(term.func), term.weight))
        return out

    def rubric(self, completion: str = "final", extra: Sequence[RewardTerm] = ()) -> Rubric:
        """A new rubric (rubrics count errors and flags, so each run gets its own)."""
        return Rubric(self.terms() + list(extra), completion=completion, success_component=self.success,
                      success_threshold=self.success_threshold, detectors=tuple(self.detectors),
                      policies=dict(self.policies))


def _fresh(func: Callable[..., Any]) -> Callable[..., Any]:
    return func if callable(func) and hasattr(func, "__code__") else copy.copy(func)


@dataclass
class LoadedTask:
    """A task resolved for one run: its environment factory, a rubric and the rows."""

    name: str
    make_env: Callable[[], Env]
    rubric: Rubric
    train_rows: list[Row]
    eval_rows: list[Row]
    # load reports (rows read, skipped); notes: lines the trainers print at the start
    info: dict[str, Any] = field(default_factory=dict)
    rollout: Rollout | None = None  # the task's own episode runner; None = the standard loop
    definition: Task | None = None  # None for custom rows and mixtures
