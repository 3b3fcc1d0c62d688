"""Token-exact capture of one episode's calls: what the agent sent, what the engine sampled.

An agent re-sends its whole conversation on every call. When the new request is the previous
request + the reply we returned + new messages (tool results, a user turn), the call EXTENDS the
segment: the prompt is the previous prompt ids + the sampled ids, verbatim, + only the new
messages rendered (loss mask 0). The conversation is never re-tokenized, so the ids the trainer
scores are the ids the engine sampled. If re-rendering the whole conversation would have given
other ids (the template closes a turn differently, the tool-call JSON is re-serialised), that
is DRIFT: counted, and the sampled ids win.

A request that does not extend (the agent edited, dropped or summarised its history, changed
its tools) starts a new SEGMENT from its own rendered prompt. A token-level check catches the
case where the message-level one fails but the rendered prompt still starts with the segment's
ids. Every segment of an episode is trained with the episode's reward.

    cap = EpisodeCapture(fmt)
    plan = cap.prepare(messages, tools)          # -> plan.prompt_ids to sample from
    cap.record(plan, completion, parsed)         # after sampling
    trajs = cap.trajectories(row)                # one Trajectory per segment
"""

from __future__ import annotations

import dataclasses
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from actloop.gateway.chat import ChatFormat, Parsed
from actloop.types import Message, Trajectory, Turn


def _key(m: Message) -> tuple:
    """What must match for two messages to count as the same (whitespace at the ends aside)."""
    calls = tuple((c.name, json.dumps(c.arguments, sort_keys=True)) for c in m.tool_calls)
    return (m.role, m.content.strip(), calls, m.name if m.role == "tool" else None)


def _tools_key(tools: list[dict[str, Any]]) -> str:
    return json.dumps(tools, sort_keys=True)


@dataclass
class _Turn:
    message: Message
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    malformed: bool
    env_messages: tuple[Message, ...] = ()
    env_ids: tuple[int, ...] = ()
    versions: tuple[int, ...] = ()  # the policy version of each sampled token (Completion.versions)


@dataclass
class Segment:
    prompt_messages: list[Message]
    prompt_ids: list[int]
    tools: str
    turns: list[_Turn] = field(default_factory=list)
    request_keys: list[tuple] = field(default_factory=list)  # the last request's messages
    reply_key: tuple | None = None  # the assistant message we returned for it

    @property
    def ids(self) -> list[int]:
        out = list(self.prompt_ids)
        for t in self.turns:
            out += t.token_ids
            out += t.env_ids
        return out

    def trajectory(self, row: dict[str, Any], info: dict[str, Any]) -> Trajectory:
        finish = {"length": "length", "tool_calls": "tool_call"}
        turns = tuple(Turn(message=t.message, token_ids=t.token_ids, logprobs=t.logprobs,
                           finish_reason=finish.get(t.finish_reason, "stop"), env_messages=t.env_messages,
                           env_ids=t.env_ids, malformed_tool_call=t.malformed, versions=t.versions)
                      for t in self.turns)
        return Trajectory(tuple(self.prompt_messages), tuple(self.prompt_ids), turns, row=row, info=info)


@dataclass
class Plan:
    """What `prepare` decided for one call."""

    prompt_ids: list[int]
    segment: Segment
    extends: bool
    version: int  # the segment's turn count when planned (a concurrent call may have moved it)
    messages: list[Message]
    env_messages: tuple[Message, ...] = ()
    env_ids: tuple[int, ...] = ()


class EpisodeCapture:
    def __init__(self, fmt: ChatFormat):
        self.fmt = fmt
        self.segments: list[Segment] = []
        self.calls = self.extensions = self.drift = 0
        self.token_extensions = 0  # extensions found only by the token-level check
        self._lock = threading.Lock()

    def prepare(self, messages: list[Message], tools: list[dict[str, Any]]) -> Plan:
        with self._lock:
            return self._prepare(messages, tools)

    def _prepare(self, messages: list[Message], tools: list[dict[str, Any]]) -> Plan:
        seg = self.segments[-1] if self.segments else None
        keys = [_key(m) for m in messages]
        tk = _tools_key(tools)
        if seg is not None and seg.turns and seg.tools == tk and seg.reply_key is not None:
            n = len(seg.request_keys)
            if len(keys) > n and keys[:n] == seg.request_keys and keys[n] == seg.reply_key:
                new = messages[n + 1:]
                last = seg.turns[-1]
                ended_eos = bool(last.token_ids) and last.token_ids[-1] in self.fmt.eos_token_ids
                env_ids = self.fmt.continuation_ids(new, ended_eos)
                prompt = seg.ids + env_ids
                if self.fmt.prompt_ids(messages, tools) != prompt:
                    self.drift += 1  # re-rendering would have changed ids; the sampled ones are kept
                return Plan(prompt, seg, True, len(seg.turns), messages, tuple(new), tuple(env_ids))
        full = self.fmt.prompt_ids(messages, tools)
        if seg is not None and seg.turns and seg.tools == tk:
            have = seg.ids
            if len(full) > len(have) and full[: len(have)] == have:
                self.token_extensions += 1
                return Plan(full, seg, True, len(seg.turns), messages, (), tuple(full[len(have):]))
        return Plan(full, Segment(list(messages), full, tk), False, 0, messages)

    def prepare_ids(self, prompt: list[int]) -> Plan:
        """A /v1/completions call: raw ids extend the segment when they start with its ids."""
        with self._lock:
            seg = self.segments[-1] if self.segments else None
            if seg is not None and seg.turns and seg.tools == "ids":
                have = seg.ids
                if len(prompt) > len(have) and prompt[: len(have)] == have:
                    return Plan(list(prompt), seg, True, len(seg.turns), [], (), tuple(prompt[len(have):]))
            return Plan(list(prompt), Segment([], list(prompt), "ids"), False, 0, [])

    def record(self, plan: Plan, token_ids: tuple[int, ...], logprobs: tuple[float, ...], finish_reason: str,
               parsed: Parsed, reply: Message, versions: tuple[int, ...] = ()) -> None:
        """Add the sampled turn. A call planned as an extension whose segment moved on meanwhile
        (two calls of one episode in flight at once) becomes a segment of its own."""
        with self._lock:
            self.calls += 1
            seg = plan.segment
            if plan.extends and len(seg.turns) == plan.version and seg is self.segments[-1]:
                self.extensions += 1
                last = seg.turns[-1]
                last.env_messages, last.env_ids = plan.env_messages, plan.env_ids
            else:
                if plan.extends:  # stale: a segment of its own, from the ids it was sampled against
                    seg = Segment(list(plan.messages), list(plan.prompt_ids), seg.tools)
                else:
                    seg = plan.segment
                self.segments.append(seg)
            seg.turns.append(_Turn(reply, tuple(token_ids), tuple(logprobs), finish_reason, parsed.error is not None,
                                   versions=tuple(versions)))
            seg.request_keys = [_key(m) for m in plan.messages]
            seg.reply_key = _key(reply)

    def stats(self) -> dict[str, int]:
        return {"calls": self.calls, "extensions": self.extensions, "segments": len(self.segments),
                "new_segments": max(len(self.segments) - 1, 0), "drift": self.drift,
                "token_extensions": self.token_extensions}

    def trajectories(self, row: dict[str, Any], info: dict[str, Any] | None = None) -> list[Trajectory]:
        info = dict(info or {}, gateway=self.stats())
        return [s.trajectory(row, info) for s in self.segments]


def episode_trajectory(segments: list[Trajectory], row: dict[str, Any], info: dict[str, Any],
                       error: str | None) -> Trajectory:
    """One Trajectory for the episode: its last segment, carrying the earlier ones in `segments`
    (they share its reward). No call at all gives an empty trajectory (no turns)."""
    if not segments:
        return Trajectory((), (), (), row=row, info=info, error=error)
    *earlier, last = segments
    return dataclasses.replace(last, info=info, error=error, segments=tuple(earlier))
