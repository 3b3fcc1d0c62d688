"""A Rubric: weighted reward functions -> per-trajectory total, components and flags.

Weight 0 makes a function a logged metric only. A function that raises does not crash the
step: every trajectory of that batch is masked (left out of the loss), and the error is counted
and kept — never a silent zero.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field

from actloop.rewards.base import RewardFunc, call_reward_func
from actloop.types import Scored, Trajectory


@dataclass(frozen=True)
class RewardTerm:
    name: str
    func: RewardFunc
    weight: float = 1.0


@dataclass
class Rubric:
    terms: list[RewardTerm]
    completion: str = "final"  # what `completions` holds: `final` or `transcript`
    success_component: str | None = None  # success = this component >= threshold; else total >= threshold
    success_threshold: float = 0.5
    errors: list[str] = field(default_factory=list)

    def score(self, trajectories: list[Trajectory]) -> list[Scored]:
        values: dict[str, list[float | None]] = {}
        failed = False
        for term in self.terms:
            try:
                values[term.name] = call_reward_func(term.func, trajectories, self.completion)
            except Exception:
                self.errors.append(f"{term.name}: {traceback.format_exc(limit=4)}")
                failed = True
                values[term.name] = [None] * len(trajectories)
        out = []
        for i, traj in enumerate(trajectories):
            components = {k: v[i] for k, v in values.items() if v[i] is not None}
            total = sum(t.weight * components[t.name] for t in self.terms if t.name in components)
            key = components.get(self.success_component) if self.success_component else total
            success = key is not None and key >= self.success_threshold and traj.error is None
            flags = ("rollout_error",) if traj.error else ()
            flags += ("reward_error",) if failed else ()
            out.append(
                Scored(
                    trajectory=traj,
                    reward=total if traj.error is None else 0.0,
                    components=components,
                    flags=flags,
                    success=success,
                    masked=failed or traj.error is not None,
                )
            )
        return out
