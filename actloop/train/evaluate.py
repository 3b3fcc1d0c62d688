"""Greedy evaluation of a policy on held-out rows of a task."""

from __future__ import annotations

import time
from typing import Any

from actloop.data.tasks import Task
from actloop.monitor.metrics import mean
from actloop.rollout.engine import Engine, SamplingParams
from actloop.rollout.episodes import run_episodes
from actloop.rollout.renderer import Renderer


def evaluate(engine: Engine, renderer: Renderer, task: Task, rows: list[dict[str, Any]], max_new_tokens: int,
             max_turns: int) -> dict[str, Any]:
    """Greedy success rate, mean reward and tool use over `rows`."""
    t0 = time.time()
    trajs = run_episodes(engine, renderer, task.make_env, rows, SamplingParams(max_new_tokens=max_new_tokens, greedy=True),
                         max_turns)
    scored = task.rubric.score(trajs)
    return {
        "success": mean(s.success for s in scored),
        "reward": mean(s.reward for s in scored),
        "tool_calls_per_episode": mean(t.num_tool_calls for t in trajs),
        "malformed_rate": mean(t.num_malformed_calls > 0 for t in trajs),
        "n": len(rows),
        "seconds": round(time.time() - t0, 2),
        "samples": [
            {"question": s.trajectory.row.get("question", ""), "transcript": s.trajectory.transcript, "reward": s.reward}
            for s in scored[:3]
        ],
    }
