"""Synthetic scored trajectories and runs for the monitor tests (no model needed)."""

from __future__ import annotations

import pytest

from actloop.config import load_config
from actloop.rewards.flags import Flag
from actloop.types import Message, Scored, ToolCall, Trajectory, Turn


def make_scored(reward: float, flags=(), success=None, n_tokens: int = 5, text: str = "answer",
                truncated: bool = False, masked: bool = False, error: str | None = None) -> Scored:
    call = Message("assistant", "<tool_call>calc</tool_call>", (ToolCall("calculator", {"expr": "2+2"}),))
    turns = (
        Turn(call, tuple(range(n_tokens)), (-0.1,) * n_tokens, "tool_call",
             env_messages=(Message("tool", "4", name="calculator"),), env_ids=(7, 8, 9)),
        Turn(Message("assistant", text), tuple(range(n_tokens)), (-0.2,) * n_tokens,
             "length" if truncated else "stop"),
    )
    traj = Trajectory((Message("system", "You are helpful."), Message("user", "What is 2+2?")), (1, 2, 3), turns,
                      row={"answer": 4, "prompt": "dropped"}, error=error)
    return Scored(traj, reward, {"correct": reward}, tuple(flags), reward > 0.5 if success is None else success,
                  masked)


def make_batch(rewards, flags_per=None):
    flags_per = flags_per or [()] * len(rewards)
    return [make_scored(r, f) for r, f in zip(rewards, flags_per)]


@pytest.fixture
def cfg(tmp_path):
    return load_config(None, [f"output_dir={tmp_path}", "train.group_size=2", "monitor.sample_every=2",
                              "monitor.samples_per_step=3"])


def record(step: int, **kw):
    base = {"step": step, "reward_mean": 0.5, "reward_std": 0.1, "success": 0.5, "zero_variance_groups": 0.0,
            "response_tokens": 40, "tool_tokens": 12, "truncated_rate": 0.0, "kl": 0.01, "entropy": 1.0,
            "grad_norm": 1.0, "rollout_s": 2.0, "scoring_s": 0.5, "update_s": 1.5, "step_s": 4.0}
    base.update(kw)
    return base


__all__ = ["make_scored", "make_batch", "record", "Flag"]
