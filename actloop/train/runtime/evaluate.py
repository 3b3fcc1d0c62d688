"""Evaluation of a policy on held-out rows of a task: greedy accuracy, or pass@k from several
samples per problem with the unbiased estimator of Chen et al. (2021).

    res = evaluate(engine, renderer, task, rows, max_new_tokens=256, max_turns=3)             # greedy
    res = evaluate(..., samples_per_problem=10, temperature=0.8, ks=(1, 5, 10))               # pass@k
    res["success"], res["pass@k"]["5"], res["per_source"]["gsm8k"]["success"], res["problems"][0]
    res["components"]["answer_from_tool"]    # the mean of each rubric component (weight-0 ones too)
"""

from __future__ import annotations

import math
import time
from typing import Any, Sequence

from actloop.tasks import LoadedTask
from actloop.monitor.metrics import mean
from actloop.rollout.engine import Engine, SamplingParams
from actloop.rollout.episodes import run_batched, task_episodes
from actloop.rollout.renderer import Renderer
from actloop.rewards.rubric import Rubric
from actloop.types import Scored, Trajectory


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k),
    computed as a product for numerical stability (Chen et al. 2021, Codex paper)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def set_grader_workers(rubric: Rubric, workers: int) -> None:
    """Let every sandboxed grader of `rubric` (and of a mixture's parts) run `workers` sandboxes at
    once (`CodeGrader.max_workers`)."""
    for part in [rubric, *getattr(rubric, "parts", {}).values()]:
        for term in part.terms:
            if hasattr(term.func, "max_workers"):
                term.func.max_workers = max(1, workers)


def row_id(row: dict[str, Any], index: int) -> Any:
    return row.get("task_id", row.get("id", index))


def evaluate(engine: Engine, renderer: Renderer, task: LoadedTask, rows: list[dict[str, Any]], max_new_tokens: int,
             max_turns: int, *, samples_per_problem: int = 1, temperature: float = 0.0, top_p: float = 1.0,
             ks: Sequence[int] | None = None, grade_workers: int | None = None,
             keep_samples: int = 3, keep_problems: bool = False, max_context: int = 4096,
             schedule: str = "auto", max_batch: int = 0) -> dict[str, Any]:
    """Success rate (greedy when `temperature` is 0), mean reward, the mean of every rubric
    component (`components`: name -> mean, logged-only terms included), tool use, and with several
    samples per problem pass@k for each k in `ks` (default 1 and `samples_per_problem`).
    `grade_workers` sandboxes grade at once; `keep_problems` adds one record per problem;
    `max_batch` episodes run at once (0 = all)."""
    k_samples = max(1, samples_per_problem)
    if k_samples > 1 and temperature <= 0:
        raise ValueError("several samples per problem need a temperature > 0 (greedy samples are identical)")
    if grade_workers:
        set_grader_workers(task.rubric, grade_workers)
    params = (SamplingParams(max_new_tokens=max_new_tokens, greedy=True) if temperature <= 0 else
              SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p))
    t0 = time.time()
    trajs = run_batched(task, engine, renderer, [r for r in rows for _ in range(k_samples)], params, max_turns,
                        max_context, max_batch, schedule)
    t_roll = time.time()
    scored = task.rubric.score(trajs)
    t_grade = time.time()
    out: dict[str, Any] = {
        "success": mean(s.success for s in scored),
        "reward": mean(s.reward for s in scored),
        "components": component_means(scored),
        "tool_calls_per_episode": mean(t.num_tool_calls for t in trajs),
        "turns_per_episode": mean(len(t.turns) for t in trajs),
        "sampled_tokens": sum(t.num_response_tokens for t in trajs),
        "malformed_rate": mean(t.num_malformed_calls > 0 for t in trajs),
        "truncated_rate": mean(t.truncated for t in trajs),
        "truncated_context": sum(t.truncated_context for t in trajs),
        "masked": sum(s.masked for s in scored),
        "masked_reason": _first_reason(scored),
        "n": len(rows),
        "samples_per_problem": k_samples,
        "temperature": temperature,
        "seconds": round(time.time() - t0, 2),
        "rollout_seconds": round(t_roll - t0, 2),
        "grading_seconds": round(t_grade - t_roll, 2),
    }
    # what a slow evaluation spent its time on: more tokens (the model wrote more) or fewer tokens a second
    out["sampled_tokens_per_second"] = round(out["sampled_tokens"] / max(t_roll - t0, 1e-9), 1)
    problems = []
    for i, row in enumerate(rows):
        group = scored[i * k_samples:(i + 1) * k_samples]
        problems.append({"id": row_id(row, i), "source": row.get("source", task.name),
                         "correct": sum(s.success for s in group), "samples": k_samples,
                         "rewards": [round(s.reward, 4) for s in group]})
    ks = sorted({k for k in (ks or (1, k_samples)) if 1 <= k <= k_samples})
    if k_samples > 1:
        out["pass@k"] = {str(k): mean(pass_at_k(k_samples, p["correct"], k) for p in problems) for k in ks}
    sources = sorted({p["source"] for p in problems})
    if len(sources) > 1:
        out["per_source"] = {src: _summary([s for s in scored if s.trajectory.row.get("source") == src],
                                           [p for p in problems if p["source"] == src], k_samples, ks)
                             for src in sources}
    if keep_problems:
        out["problems"] = problems
    out["samples"] = [{"id": row_id(s.trajectory.row, j // k_samples), "question": row_question(s.trajectory.row),
                       "transcript": s.trajectory.transcript, "reward": s.reward, "flags": [str(f) for f in s.flags]}
                      for j, s in enumerate(scored[:keep_samples * k_samples:k_samples])]
    return out


def _first_reason(scored: list[Scored]) -> str | None:
    """Why the first masked trajectory was masked: its rollout error's last line, or the evidence
    of its first flag that says (a raising reward names the user's file and line)."""
    for s in scored:
        if s.masked:
            if s.trajectory.error:
                return s.trajectory.error.strip().splitlines()[-1]
            return next((f.evidence for f in s.flags if getattr(f, "evidence", "")), "masked by a flag policy")
    return None


def eval_line(label: str, res: dict[str, Any]) -> str:
    """The line a run prints for an evaluation: greedy success, and when trajectories were masked
    (not graded: a raising reward, a failed rollout) how many and the first one's reason, so that a
    0% that graded nothing does not read as a 0% that graded everything."""
    line = f"{label}: greedy success {res['success']:.1%} on {res['n']} held-out problems ({res['seconds']:.0f}s"
    if "sampled_tokens" in res:  # a slow evaluation says whether the model wrote more or the engine ran slower
        line += f": {res['sampled_tokens']} tokens sampled at {res['sampled_tokens_per_second']:.0f}/s"
    line += ")"
    total = res["n"] * res.get("samples_per_problem", 1)
    if res.get("masked"):
        line += f"; {res['masked']} of {total} masked, not graded: {res.get('masked_reason') or '?'}"
    return line


def component_means(scored: list[Scored]) -> dict[str, float]:
    """Each rubric component's mean over the scored trajectories that have it (a term whose
    function raised has none; in a mixture, each task's terms are its own rows'), in rubric order."""
    names = dict.fromkeys(k for s in scored for k in s.components)
    return {k: mean(s.components[k] for s in scored if k in s.components) for k in names}


def _summary(scored: list[Scored], problems: list[dict[str, Any]], k_samples: int, ks: list[int]) -> dict[str, Any]:
    d: dict[str, Any] = {"n": len(problems), "success": mean(s.success for s in scored),
                         "reward": mean(s.reward for s in scored), "components": component_means(scored)}
    if k_samples > 1:
        d["pass@k"] = {str(k): mean(pass_at_k(k_samples, p["correct"], k) for p in problems) for k in ks}
    return d


def row_question(row: dict[str, Any]) -> str:
    """What a row asks, for people reading a report or a grade: its question-like column, else its
    chat prompt's last user message."""
    for key in ("question", "text", "instruction", "task_id"):
        if isinstance(row.get(key), str):
            return row[key]
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        if users and isinstance(users[-1], str):
            return users[-1]
    return str(row.get("target", ""))

