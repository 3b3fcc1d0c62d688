"""Rewards of the calculator task (TRL signature)."""

from __future__ import annotations

from actloop.envs.calculator import final_number


def correct_answer(prompts, completions, answer, trajectories=None, **kwargs) -> list[float]:
    """1.0 when the last number of the final answer equals the row's `answer`. A final turn that
    is itself a tool call (the episode ran out of turns) is no answer."""
    out = []
    for i, (text, target) in enumerate(zip(completions, answer)):
        last = trajectories[i].turns[-1] if trajectories is not None and trajectories[i].turns else None
        if last is not None and (last.message.tool_calls or last.malformed_tool_call):
            out.append(0.0)
            continue
        got = final_number(text)
        out.append(1.0 if got is not None and abs(got - float(target)) < 1e-6 else 0.0)
    return out


def used_tool(prompts, completions, trajectories, **kwargs) -> list[float]:
    """1.0 when the episode made at least one well-formed tool call (logged, weight 0)."""
    return [1.0 if t.num_tool_calls > 0 else 0.0 for t in trajectories]


def malformed_calls(prompts, completions, trajectories, **kwargs) -> list[float]:
    """Number of malformed tool calls in the episode (logged, weight 0)."""
    return [float(t.num_malformed_calls) for t in trajectories]
