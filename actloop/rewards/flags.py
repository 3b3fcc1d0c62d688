"""Flags with evidence, grades that carry them, and what a flag does to a reward (its policy).

A reward function keeps TRL's signature and may return, per completion, a float, `None`
("not applicable"), or a `Grade`: a score plus flags and details. A hack detector is a pure
function `detector(completion, row) -> list[Flag]`. The `Rubric` gathers both and applies
each flag's `Policy`:

- ``zero``    — the reward becomes 0 (a reward that was already negative stays as it is);
- ``penalty`` — subtract `Policy.penalty` (once per distinct flag name);
- ``log``     — counted and kept, the reward is unchanged;
- ``mask``    — the trajectory leaves the loss (the grader could not tell: a judge that
  failed, a sandbox that did not start). Counted, never a silent 0.

`Flag` is a `str` (its name) so that `"reward_error" in scored.flags` and JSON logs of names
keep working; the evidence rides along as attributes.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from actloop.rewards.base import RewardError, RewardFunc, call_reward_func
from actloop.types import Trajectory

Action = Literal["zero", "penalty", "log", "mask"]
ACTIONS = ("zero", "penalty", "log", "mask")


class Flag(str):
    """A named flag with its evidence (`"line 3: sys.exit(0)"`), the term or detector that
    raised it (`source`), and, once a rubric applied its policy, the `action` taken.
    `default` is the policy its grader asks for when the rubric names none for it (a
    `JudgePanel` built with `on_disagreement="mask"`); empty: `DEFAULT_POLICIES`."""

    evidence: str
    source: str
    action: str
    default: str

    def __new__(cls, name: str, evidence: str = "", source: str = "", action: str = "", default: str = "") -> Flag:
        obj = super().__new__(cls, name)
        obj.evidence = evidence
        obj.source = source
        obj.action = action
        obj.default = default
        return obj

    @property
    def name(self) -> str:
        return str(self)

    def replace(self, **kw: str) -> Flag:
        d = {"name": str(self), "evidence": self.evidence, "source": self.source, "action": self.action,
             "default": self.default} | kw
        return Flag(**d)

    def to_dict(self) -> dict[str, str]:
        return {"name": str(self), "evidence": self.evidence, "source": self.source, "action": self.action}

    def __reduce__(self):  # pickling (multiprocessing, checkpoints) keeps the evidence
        return (Flag, (str(self), self.evidence, self.source, self.action, self.default))

    def __repr__(self) -> str:
        return f"Flag({str(self)!r}, {self.evidence!r})"


def as_flag(f: str | Flag, source: str = "") -> Flag:
    if isinstance(f, Flag):
        return f if f.source or not source else f.replace(source=source)
    return Flag(f, "", source)


@dataclass(frozen=True)
class Grade:
    """One completion's grade: `score` (None = not applicable / could not grade), flags with
    evidence, and details for logs (`passed`, `total`, per-test results, ...)."""

    score: float | None
    flags: tuple[Flag, ...] = ()
    info: Mapping[str, Any] = field(default_factory=dict)
    components: Mapping[str, float] = field(default_factory=dict)  # sub-scores, logged (not weighted)

    def __float__(self) -> float:  # TRL-style callers that coerce get the score
        if self.score is None:
            raise TypeError("this Grade has no score (None: not applicable or ungradable)")
        return float(self.score)


@dataclass(frozen=True)
class Policy:
    """What a flag does to the reward: ``zero``, ``penalty`` (subtract `penalty`), ``log``
    or ``mask``. Written in configs as ``"zero"``, ``"log"``, ``"mask"`` or ``"penalty:0.5"``."""

    action: Action = "zero"
    penalty: float = 0.0

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise RewardError(f"unknown flag policy {self.action!r}; choose from {ACTIONS} (or 'penalty:X')")
        if self.action == "penalty" and not self.penalty > 0:
            raise RewardError("a penalty policy needs a positive amount, e.g. 'penalty:0.5'")

    @classmethod
    def parse(cls, spec: Policy | str) -> Policy:
        if isinstance(spec, Policy):
            return spec
        if spec.startswith("penalty:"):
            try:
                return cls("penalty", float(spec.split(":", 1)[1]))
            except ValueError:
                raise RewardError(f"bad penalty policy {spec!r}; write e.g. 'penalty:0.5'") from None
        return cls(spec)  # type: ignore[arg-type]


# Defaults for the flags the graders and detectors of this package raise. Anything a hack
# detector raises defaults to `zero`; flags that say "we could not grade" mask.
DEFAULT_POLICIES: dict[str, str] = {
    "rollout_error": "mask",
    "reward_error": "mask",
    "detector_error": "mask",
    "judge_error": "mask",
    "sandbox_error": "mask",
    "judge_disagreement": "log",
    "judge_position_bias": "log",
    "grader_injection": "zero",  # text aimed at the judge (actloop.rewards.injection); zero like any hack flag
    "heldout_gap": "log",  # the failing held-out tests already cost reward; honest code can miss edge cases
    "differential_mismatch": "log",  # the code grader already applied `reward.differential` to its score
}


@dataclass(frozen=True)
class Applied:
    reward: float
    masked: bool
    zeroed: bool
    flags: tuple[Flag, ...]


def apply_policies(
    total: float,
    flags: Sequence[Flag],
    policies: Mapping[str, Policy | str] | None = None,
    default: Policy | str = "zero",
) -> Applied:
    """The reward after the flags' policies, and the flags annotated with the action taken.

    A flag's policy is the rubric's (`policies`), else the one its grader asked for
    (`Flag.default`), else `DEFAULT_POLICIES`, else `default`. Zero wins over penalties;
    penalties of distinct flag names add up; a flag raised twice (two tests, two detectors) is
    penalised once."""
    chosen = policies or {}
    masked = zeroed = False
    penalty = 0.0
    seen: set[str] = set()
    out = []
    for f in flags:
        name = str(f)
        pol = Policy.parse(chosen.get(name) or getattr(f, "default", "") or DEFAULT_POLICIES.get(name) or default)
        out.append(f.replace(action=pol.action if pol.action != "penalty" else f"penalty:{pol.penalty:g}"))
        if pol.action == "zero":
            zeroed = True
        elif pol.action == "mask":
            masked = True
        elif pol.action == "penalty" and str(f) not in seen:
            penalty += pol.penalty
        seen.add(str(f))
    reward = min(total, 0.0) if zeroed else total - penalty
    return Applied(reward, masked, zeroed, tuple(out))


def call_graded(
    fn: RewardFunc, trajectories: list[Trajectory], mode: str = "final"
) -> tuple[list[float | None], list[Grade | None]]:
    """`call_reward_func`, but items may be `Grade`s: returns (scores, the Grade of each
    completion, None where the function returned a plain number).

    The function is called exactly as TRL would call it (same columns, same signature
    inspection, async allowed); its `Grade`s are unpacked on the way out."""
    got: list[Any] = []

    def unpack(out: Any) -> Any:
        if isinstance(out, (list, tuple)):
            got[:] = list(out)
            return [v.score if isinstance(v, Grade) else v for v in out]
        return out  # call_reward_func reports what is wrong with it

    @functools.wraps(fn)
    def shim(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if inspect.isawaitable(out):
            async def later() -> Any:
                return unpack(await out)

            return later()
        return unpack(out)

    scores = call_reward_func(shim, trajectories, mode)
    return scores, [v if isinstance(v, Grade) else None for v in got]


Detector = Callable[[str, Mapping[str, Any]], list[Flag]]
"""A pure function `(completion, row) -> flags`. It must not run the completion."""
