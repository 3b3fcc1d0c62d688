"""A Rubric: weighted reward functions -> per-trajectory total, components and flags.

Weight 0 makes a function a logged metric only. A function that raises does not crash the
step: every trajectory of that batch is masked (left out of the loss), and the error is counted
and kept — never a silent zero.

Reward functions may return `Grade`s (a score plus flags with evidence) instead of floats, and
`detectors` (pure functions `(completion, row) -> flags`) run on every scored trajectory (a
term's function may bring its own in a `detectors` attribute: a judge brings
`grader_injection`). Each flag then meets its policy (`flags.apply_policies`): zero the reward,
subtract a penalty, only log it, or mask the trajectory. `validate()` checks that gold answers score full marks.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from actloop.rewards.base import RewardFunc, completion_text
from actloop.rewards.flags import Detector, Flag, Policy, apply_policies, as_flag, call_graded
from actloop.types import Message, Scored, Trajectory, Turn, user_error


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
    detectors: Sequence[Detector] = ()  # hack detectors run on every scored trajectory
    policies: Mapping[str, Policy | str] = field(default_factory=dict)  # flag name -> policy
    default_policy: Policy | str = "zero"  # for flags not named in `policies`
    flag_counts: Counter = field(default_factory=Counter)  # flag name -> times raised, all batches

    def __post_init__(self) -> None:
        # a term brings the detectors its grader needs (a Judge or JudgePanel: grader_injection)
        found: list[Detector] = []
        for det in [*self.detectors, *(d for t in self.terms for d in getattr(t.func, "detectors", ()))]:
            if not any(det is d for d in found):
                found.append(det)
        self.detectors = tuple(found)

    def score(self, trajectories: list[Trajectory], details: list[dict[str, Any]] | None = None) -> list[Scored]:
        """Score a batch. Pass a list as `details` to receive, per trajectory, each term's
        `Grade.info` (pass counts, per-test results, ...)."""
        values: dict[str, list[float | None]] = {}
        term_flags: list[list[Flag]] = [[] for _ in trajectories]
        infos: list[dict[str, Any]] = [{} for _ in trajectories]
        extra: list[dict[str, float]] = [{} for _ in trajectories]  # a Grade's own sub-scores (logged)
        failed = ""  # the first raising term's line
        for term in self.terms:
            try:
                values[term.name], grades = call_graded(term.func, trajectories, self.completion)
                for i, g in enumerate(grades):
                    if g is not None:
                        term_flags[i] += [as_flag(f, term.name) for f in g.flags]
                        infos[i][term.name] = dict(g.info)
                        extra[i].update(g.components)
            except Exception:
                line, text = user_error(f"reward `{term.name}`")
                self.errors.append(f"{line}\n{text}")
                failed = failed or line
                values[term.name] = [None] * len(trajectories)
        out = []
        for i, traj in enumerate(trajectories):
            components = {k: v[i] for k, v in values.items() if v[i] is not None}
            components.update({k: x for k, x in extra[i].items() if k not in values})
            total = sum(t.weight * components[t.name] for t in self.terms if t.name in components)
            flags: list[Flag] = [Flag("rollout_error", traj.error or "")] if traj.error else []
            flags += [Flag("reward_error", failed)] if failed else []
            flags += term_flags[i] + self._detect(traj)
            applied = apply_policies(total, flags, self.policies, self.default_policy)
            self.flag_counts.update(str(f) for f in applied.flags)
            key = components.get(self.success_component) if self.success_component else applied.reward
            success = (key is not None and key >= self.success_threshold and traj.error is None
                       and not applied.zeroed and not applied.masked)
            out.append(
                Scored(
                    trajectory=traj,
                    reward=applied.reward if traj.error is None else 0.0,
                    components=components,
                    flags=applied.flags,
                    success=success,
                    masked=bool(failed) or traj.error is not None or applied.masked,
                )
            )
        if details is not None:
            details[:] = infos
        return out

    def _detect(self, traj: Trajectory) -> list[Flag]:
        if not self.detectors or traj.error:
            return []
        text = completion_text(traj, self.completion)
        found: list[Flag] = []
        for det in self.detectors:
            name = getattr(det, "__name__", repr(det))
            try:
                found += [as_flag(f, name) for f in det(text, traj.row)]
            except Exception:  # a broken detector must not pass a hack silently
                line, tb = user_error(f"detector `{name}`")
                self.errors.append(f"{line}\n{tb}")
                found.append(Flag("detector_error", line, name))
        return found

    def validate(
        self,
        rows: Sequence[Mapping[str, Any]],
        gold: Callable[[Mapping[str, Any]], str],
        n: int | None = 50,
        seed: int = 0,
        full: float = 1.0,
    ) -> ValidationReport:
        """Score the gold answer of `n` sampled rows (all rows when `n` is None): each must earn
        at least `full` with no flag. A failure means the grader (or the data) is wrong."""
        idx = list(range(len(rows)))
        if n is not None and n < len(idx):
            idx = sorted(random.Random(seed).sample(idx, n))
        scored = self.score([text_trajectory(gold(rows[i]), rows[i]) for i in idx])
        bad = [(i, s.reward, [f.to_dict() for f in s.flags if isinstance(f, Flag)] or list(s.flags))
               for i, s in zip(idx, scored) if s.reward < full or s.flags or s.masked]
        return ValidationReport(checked=len(idx), failures=bad)


@dataclass(frozen=True)
class ValidationReport:
    checked: int
    failures: list[tuple[int, float, list[Any]]]  # (row index, reward, flags)

    @property
    def ok(self) -> bool:
        return not self.failures

    def __str__(self) -> str:
        head = f"{self.checked - len(self.failures)}/{self.checked} gold answers score full marks"
        return head + "".join(f"\n  row {i}: reward {r:g} flags {f}" for i, r, f in self.failures[:20])


def text_trajectory(completion: str, row: Mapping[str, Any] | None = None, prompt: str = "") -> Trajectory:
    """A one-turn trajectory holding `completion` as the assistant's answer (no token ids):
    for grading text that did not come from a rollout (gold answers, the `grade` command)."""
    return Trajectory(prompt_messages=(Message("user", prompt),), prompt_ids=(),
                      turns=(Turn(Message("assistant", completion), (), (), "stop"),), row=dict(row or {}))
