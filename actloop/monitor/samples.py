"""Sample trajectories for people to read: the full multi-turn text of a few episodes per
sampled step (the best and the worst of each group in turn) with reward, components, flags
(with evidence), success and whether the episode was masked or failed. One JSON line each."""

from __future__ import annotations

import json
from typing import Any, Sequence

from actloop.types import Scored


def pick(scored: Sequence[Scored], group_size: int, k: int) -> list[tuple[int, str, Scored]]:
    """Up to `k` (group index, "best"/"worst", trajectory): group 0's best and worst, then
    group 1's, ... A group of one gives only its "best"."""
    out: list[tuple[int, str, Scored]] = []
    g = max(1, group_size)
    for gi, start in enumerate(range(0, len(scored), g)):
        members = list(scored[start : start + g])
        best = max(range(len(members)), key=lambda i: members[i].reward)
        worst = min(range(len(members)), key=lambda i: members[i].reward)
        for tag, i in (("best", best), ("worst", worst)):
            if len(out) >= k or (tag == "worst" and i == best):
                continue
            out.append((gi, tag, members[i]))
        if len(out) >= k:
            break
    return out


def _flag(f: Any) -> dict[str, str]:
    return f.to_dict() if hasattr(f, "to_dict") else {"name": str(f)}


def _jsonable(v: Any) -> Any:
    try:
        json.dumps(v)
        return v
    except (TypeError, ValueError):
        return str(v)


def sample_record(step: int, group: int, tag: str, s: Scored, max_chars: int = 20000) -> dict[str, Any]:
    """One sample as a JSON-able dict: every message (prompt ones marked `prompt: true`)."""
    t = s.trajectory
    n_prompt = len(t.prompt_messages)
    messages = []
    for i, m in enumerate(t.messages):
        d: dict[str, Any] = {"role": m.role, "content": m.content[:max_chars]}
        if m.name:
            d["name"] = m.name
        if m.reasoning:
            d["reasoning"] = m.reasoning[:max_chars]
        if m.tool_calls:
            d["tool_calls"] = [{"name": c.name, "arguments": _jsonable(c.arguments)} for c in m.tool_calls]
        if i < n_prompt:
            d["prompt"] = True
        messages.append(d)
    return {
        "step": step,
        "group": group,
        "pick": tag,
        "reward": s.reward,
        "components": dict(s.components),
        "flags": [_flag(f) for f in s.flags],
        "success": bool(s.success),
        "masked": bool(s.masked),
        "error": t.error,
        "response_tokens": t.num_response_tokens,
        "tool_calls": t.num_tool_calls,
        "truncated": t.truncated,
        "truncated_context": t.truncated_context,
        "messages": messages,
        "row": {k: _jsonable(v) for k, v in t.row.items() if k != "prompt"},
        **_versions(t),
    }


def _versions(t: Any) -> dict[str, Any]:
    """The policy versions of the trajectory's tokens (oldest, newest) and, running ahead of training
    (rollout.max_staleness), its group's id and staleness at the update that trained it."""
    out: dict[str, Any] = {}
    span = t.version_span
    if span is not None:
        out["version_first"], out["version_last"] = span
    policy = t.info.get("policy") or {}
    if "staleness" in policy:
        out["staleness"], out["group_id"] = policy["staleness"], policy["group_id"]
    return out
