"""Failure isolation: what went wrong in a step, recorded, counted, and judged against thresholds.

Kinds (one count per trajectory and kind):

- ``env``     — the environment raised in reset/step/close (`Trajectory.error`, with traceback);
- ``engine``  — the generation engine could not serve the episode's request after its retries
  (HTTP error, timeout, dead Ray actor, out of memory: `actloop.rollout.isolation`);
- ``sandbox`` — the sandbox could not run the code (`sandbox_error` flag);
- ``judge``   — an LLM judge gave no usable score (`judge_error` flag: HTTP error, timeout, reply
  off-format);
- ``reward``  — a reward function or a hack detector raised (`reward_error` / `detector_error`,
  traceback from `Rubric.errors`);
- ``truncated`` — the last assistant turn was cut off at `rollout.max_new_tokens` (no answer yet);
- ``parse``   — the policy gave no final answer otherwise: no turn, ended on a tool call (out of
  turns), an empty reply, or a grader's `no_answer` / `empty_response` flag.

The first four are infrastructure failures: the trajectory is masked from the loss (the rubric
already marks it `masked`). ``truncated`` and ``parse`` are the policy's own doing: the grader
scores them (0 in practice) and they are trained on, so the policy learns to answer in budget;
they are counted, not masked (`train.mask_truncated` masks truncated ones).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from actloop.config import FAILURE_KINDS, FailuresConfig
from actloop.types import Scored, Trajectory

# rubric flag -> failure kind (infrastructure: masked)
FLAG_KINDS = {"rollout_error": "env", "sandbox_error": "sandbox", "judge_error": "judge", "reward_error": "reward",
              "detector_error": "reward"}
NO_ANSWER_FLAGS = ("no_answer", "empty_response")


class RunAborted(RuntimeError):
    """Too many failures: the run stopped (after a checkpoint); the message says why and where to look."""


@dataclass(frozen=True)
class Failure:
    step: int
    kind: str
    message: str
    traceback: str | None
    index: int  # position of the trajectory in the step's batch
    row_id: str
    masked: bool


def row_id(row: dict[str, Any]) -> str:
    """A row's own id where it has one (id, task_id, ...), else a short hash of its content."""
    for key in ("id", "task_id", "problem_id", "row_id"):
        if row.get(key) is not None:
            return str(row[key])
    text = json.dumps(row, sort_keys=True, default=str)
    return "sha1:" + hashlib.sha1(text.encode()).hexdigest()[:12]


def no_answer(traj: Trajectory, flags=()) -> str | None:
    """Why the trajectory holds no final answer, or None when it has one."""
    named = [f for f in flags if str(f) in NO_ANSWER_FLAGS]
    if named:
        return f"{named[0]}: {getattr(named[0], 'evidence', '')}".rstrip(": ")
    if not traj.turns:
        return "no assistant turn"
    last = traj.turns[-1]
    if last.finish_reason == "length":
        return f"cut off at max_new_tokens ({len(last.token_ids)} tokens)"
    if last.message.tool_calls or last.malformed_tool_call:
        return "ended on a tool call (out of turns)"
    if not last.message.content.strip():
        return "empty reply"
    return None


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else text.strip()


def classify(step: int, scored: list[Scored], reward_errors: list[str] = ()) -> list[Failure]:
    """The failures of one step's scored trajectories. `reward_errors` are the tracebacks the
    rubric recorded while scoring them (`Rubric.errors` added this step)."""
    out: list[Failure] = []
    reward_tb = "\n".join(reward_errors) or None
    for i, s in enumerate(scored):
        traj, rid = s.trajectory, row_id(s.trajectory.row)
        kinds: dict[str, tuple[str, str | None]] = {}
        if traj.error:
            kind = "engine" if traj.error.startswith("engine: ") else "env"  # actloop.rollout.isolation
            kinds[kind] = (_last_line(traj.error), traj.error)
        for f in s.flags:
            kind = FLAG_KINDS.get(str(f))
            if kind is None or kind in kinds or (str(f) == "rollout_error" and traj.error):
                continue  # (the trajectory's own error is counted above, as env or engine)
            evidence = getattr(f, "evidence", "") or str(f)
            kinds[kind] = (evidence, reward_tb if kind == "reward" else None)
        for kind, (msg, tb) in kinds.items():
            out.append(Failure(step, kind, msg, tb, i, rid, s.masked))
        if not kinds and (why := no_answer(traj, s.flags)):
            kind = "truncated" if traj.turns and traj.turns[-1].finish_reason == "length" else "parse"
            out.append(Failure(step, kind, why, None, i, rid, s.masked))
        if traj.info.get("tool_raised"):  # answered to the model as an error; reported to the user here
            out.append(Failure(step, "tool", traj.info["tool_raised"][0], traj.info.get("tool_traceback"), i, rid,
                               s.masked))
    return out


def failure_metrics(failures: list[Failure], n: int, cfg: FailuresConfig) -> dict[str, float]:
    """`failures/<kind>` for every kind (0 included, so every step has the same keys),
    `failures/masked` (trajectories left out of the loss by a failure) and `failures/rate`
    (share of the step's trajectories with a failure of a kind in `failures.count`)."""
    counts = Counter(f.kind for f in failures)
    rec: dict[str, float] = {f"failures/{k}": counts.get(k, 0) for k in FAILURE_KINDS}
    rec["failures/masked"] = len({f.index for f in failures if f.masked})
    rec["failures/any"] = len({f.index for f in failures}) / n if n else 0.0  # every kind, counted or not
    counted = {f.index for f in failures if f.kind in cfg.count}
    rec["failures/rate"] = len(counted) / n if n else 0.0
    return rec


def count_kinds(counts: Counter | dict[str, int]) -> str:
    """`4 reward failures, 1 env failure`: counts by kind, most first (not `reward 4`, which reads
    like a reward value)."""
    return ", ".join(f"{v} {k} failure{'s' if v > 1 else ''}" for k, v in Counter(counts).most_common())


def masked_line(step: int, failures: list[Failure], n: int, log_path: Path) -> str | None:
    """The one line a step prints when any of its trajectories was masked: how many, of which
    kinds, the first error message, and where the tracebacks are; None when none was masked."""
    masked = [f for f in failures if f.masked]
    if not masked:
        return None
    counts = Counter(f.kind for f in masked)
    kinds = count_kinds(counts)
    n_masked = len({f.index for f in masked})
    return (f"step {step}: {n_masked} of {n} trajectories masked from the loss ({kinds}); first: "
            f"{masked[0].message[:200]} -- tracebacks in {log_path}")


def tool_line(step: int, failures: list[Failure], n: int, log_path: Path) -> str | None:
    """The line a step prints when a tool raised in at least half of its episodes (a tool that
    raises on a bad call now and then is the model's business; one that raises on most is likely
    broken); None otherwise. The model saw each as an `Error: ...` tool message."""
    tool = [f for f in failures if f.kind == "tool"]
    episodes = len({f.index for f in tool})
    if not tool or episodes * 2 < n:
        return None
    return (f"step {step}: a tool raised in {episodes} of {n} episodes (the model was shown the error); first: "
            f"{tool[0].message[:200]} -- tracebacks in {log_path}")


class FailureLog:
    """RUN_DIR/failures.jsonl: one line per failure (step, kind, message, traceback, row id)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.touch()  # there, empty, when nothing failed: what docs/runs.md says a run holds
        self._f = None

    def write(self, failures: list[Failure]) -> None:
        if not failures:
            return
        if self._f is None:
            self._f = self.path.open("a")
        for f in failures:
            self._f.write(json.dumps(asdict(f)) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


@dataclass
class FailureGuard:
    """Stops a run after `max_bad_steps` consecutive steps whose failure rate exceeds `max_rate`."""

    cfg: FailuresConfig
    bad_steps: int = 0  # consecutive, up to the last step seen

    def check(self, step: int, failures: list[Failure], n: int, run_dir: Path) -> str | None:
        """None, or the message the run stops with."""
        rate = failure_metrics(failures, n, self.cfg)["failures/rate"]
        self.bad_steps = self.bad_steps + 1 if rate > self.cfg.max_rate else 0
        if not self.cfg.max_bad_steps or self.bad_steps < self.cfg.max_bad_steps:
            return None
        counts = Counter(f.kind for f in failures if f.kind in self.cfg.count)
        kinds = count_kinds(counts)
        return (f"stopping at step {step}: {self.bad_steps} consecutive steps with more than "
                f"{self.cfg.max_rate:.0%} of trajectories failed (last step: {rate:.0%}; {kinds}). "
                f"Tracebacks are in {run_dir / 'failures.jsonl'}. Raise failures.max_rate or "
                f"failures.max_bad_steps, or fix the cause and resume with `actloop train resume={run_dir}`.")

    def state_dict(self) -> dict[str, int]:
        return {"bad_steps": self.bad_steps}

    def load_state_dict(self, d: dict[str, int]) -> None:
        self.bad_steps = int(d["bad_steps"])
