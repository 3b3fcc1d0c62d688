"""Core data types shared by every package: messages, tool calls, turns, trajectories, groups;
and `user_error`, how an exception raised in a user's code (a reward, a tool) is reported.

All are frozen dataclasses (or plain lists of them) so that a trajectory recorded during a
rollout cannot be mutated behind the trainer's back. Token-level fields are plain Python lists;
the trainer turns them into tensors.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

# frames that are not the user's: actloop's own, the standard library's, installed packages'
_NOT_THEIRS = tuple({str(Path(__file__).resolve().parent) + os.sep,
                     *(str(Path(sysconfig.get_paths()[k]).resolve()) + os.sep
                       for k in ("stdlib", "purelib", "platlib"))})


def user_error(what: str) -> tuple[str, str]:
    """In an `except` block around a user's function (`what`: "reward `f`", "tool `calc`"): one
    line for the user, the exception and the innermost frame of their own code (not actloop's, the
    standard library's or an installed package's: their file and line), and the traceback from
    the first such frame on (Rubric.errors, failures.jsonl), so that it does not stop inside
    actloop's wrappers."""
    etype, exc, tb = sys.exc_info()
    frames = traceback.extract_tb(tb)
    theirs = [i for i, f in enumerate(frames) if not str(Path(f.filename).resolve()).startswith(_NOT_THEIRS)]
    where = f" ({frames[theirs[-1]].filename}:{frames[theirs[-1]].lineno})" if theirs else ""
    line = f"{what} raised {etype.__name__ if etype else 'an error'}: {exc}{where}"
    start = theirs[0] if theirs else max(0, len(frames) - 4)
    text = "Traceback (most recent call last):\n" + "".join(traceback.format_list(frames[start:]))
    return line, text + "".join(traceback.format_exception_only(etype, exc))

Role = Literal["system", "user", "assistant", "tool"]


_PLACEHOLDER = {"string": "...", "number": 0, "integer": 0, "boolean": False, "array": [], "object": {}}


def example_arguments(parameters: dict[str, Any], keys: list[str] | None = None) -> dict[str, Any]:
    """Placeholder arguments for a tool's JSON-schema `parameters` (what a prompt or an error
    message shows as an example call): `"..."` for a string, 0 for a number, false, [], {}; `keys`
    (default: every property) picks which."""
    props = parameters.get("properties") or {}
    out = {}
    for k in (keys if keys is not None else list(props)):
        kind = (props.get(k) or {}).get("type")
        kind = next((t for t in kind if t != "null"), None) if isinstance(kind, list) else kind
        out[k] = _PLACEHOLDER.get(kind, "...")
    return out


@dataclass(frozen=True)
class ToolCall:
    """A tool call parsed from an assistant message.

    `arguments` is the decoded JSON object. `raw` is the exact text between the tags.
    """

    name: str
    arguments: dict[str, Any]
    raw: str = ""


@dataclass(frozen=True)
class Message:
    """One chat message. `tool_calls` is filled by the renderer's parser for assistant messages;
    `name` names the tool for a `tool` message. `reasoning` is an assistant's chain of thought
    (Qwen3 `<think>`, Harmony `analysis`), kept apart from `content` (the answer it gives)."""

    role: Role
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    name: str | None = None
    reasoning: str = ""

    def to_dict(self) -> dict[str, Any]:
        """OpenAI / chat-template style; `tool_calls` as ``[{"type": "function", "function":
        {"name", "arguments": {...}}}]`` when there are any (worked examples carry their calls
        there, not in `content`)."""
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name:
            d["name"] = self.name
        if self.tool_calls:
            d["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                               for c in self.tool_calls]
        return d


@dataclass(frozen=True)
class Turn:
    """One assistant turn and what the environment answered.

    token_ids / logprobs: what the engine sampled, exactly ([T_turn]); these are trained on.
    env_ids: tokens the renderer appended after this turn (closing tags, tool results, the next
        generation prompt) — masked from the loss ([E_turn]).
    """

    message: Message
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: Literal["stop", "length", "tool_call"]
    env_messages: tuple[Message, ...] = ()
    env_ids: tuple[int, ...] = ()
    malformed_tool_call: bool = False
    reward: float | None = None  # per-turn reward from the environment, when it gives one
    # [T_turn] the policy version (weight syncs so far) that sampled each token; () = not counted by the
    # engine. Several versions in one turn: the engine's weights were updated in flight (rollout.max_staleness)
    versions: tuple[int, ...] = ()


@dataclass(frozen=True)
class Trajectory:
    """A whole episode, tokens in and tokens out.

    input_ids = prompt_ids + for each turn (turn.token_ids + turn.env_ids)      [L]
    loss_mask = 0 on prompt and env tokens, 1 on sampled tokens                  [L]
    logprobs  = engine log-probs on sampled tokens, 0.0 elsewhere                [L]
    """

    prompt_messages: tuple[Message, ...]
    prompt_ids: tuple[int, ...]
    turns: tuple[Turn, ...]
    row: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # a failed rollout is recorded and masked, never raised
    # MoE engines: the experts the engine routed each input position to, [<= L - 1, MoE layers, k]
    # (the first computation of each position; routing replay, actloop/models/routing.py); else None
    routing: Any = None
    truncated_context: bool = False  # ended because the next turn would not fit in max_context
    # earlier segments of the same episode (an agent behind the gateway that rewrote its history):
    # each is a Trajectory of its own token sequence, trained with this episode's reward
    segments: tuple["Trajectory", ...] = ()

    @property
    def input_ids(self) -> list[int]:
        ids = list(self.prompt_ids)
        for t in self.turns:
            ids += t.token_ids
            ids += t.env_ids
        return ids

    @property
    def loss_mask(self) -> list[int]:
        m = [0] * len(self.prompt_ids)
        for t in self.turns:
            m += [1] * len(t.token_ids)
            m += [0] * len(t.env_ids)
        return m

    @property
    def logprobs(self) -> list[float]:
        lp = [0.0] * len(self.prompt_ids)
        for t in self.turns:
            lp += list(t.logprobs)
            lp += [0.0] * len(t.env_ids)
        return lp

    @property
    def messages(self) -> list[Message]:
        out = list(self.prompt_messages)
        for t in self.turns:
            out.append(t.message)
            out += t.env_messages
        return out

    @property
    def final_text(self) -> str:
        """The last assistant message's text ('' when the episode has no turn)."""
        return self.turns[-1].message.content if self.turns else ""

    @property
    def reasoning(self) -> str:
        """Every assistant turn's reasoning (chain of thought), turns separated by blank lines."""
        return "\n\n".join(t.message.reasoning for t in self.turns if t.message.reasoning)

    @property
    def transcript(self) -> str:
        """Every message after the prompt, as 'role: content' lines."""
        return "\n".join(f"{m.role}: {m.content}" for m in self.messages[len(self.prompt_messages):])

    @property
    def versions(self) -> list[int]:
        """[sampled tokens] the policy version of each sampled token, in order ([] when the engine counts
        none). An episode spans versions when weights changed between or inside its turns."""
        return [v for t in self.turns for v in t.versions]

    @property
    def version_span(self) -> tuple[int, int] | None:
        """(oldest, newest) policy version of the sampled tokens; None when not counted."""
        vs = self.versions
        return (min(vs), max(vs)) if vs else None

    @property
    def num_response_tokens(self) -> int:
        return sum(len(t.token_ids) for t in self.turns)

    @property
    def num_env_tokens(self) -> int:
        return sum(len(t.env_ids) for t in self.turns)

    @property
    def num_tool_calls(self) -> int:
        return sum(len(t.message.tool_calls) for t in self.turns)

    @property
    def num_malformed_calls(self) -> int:
        return sum(t.malformed_tool_call for t in self.turns)

    @property
    def truncated(self) -> bool:
        return bool(self.turns) and self.turns[-1].finish_reason == "length"


@dataclass(frozen=True)
class Scored:
    """A trajectory with its reward: the total, each named component, and flags with evidence."""

    trajectory: Trajectory
    reward: float
    components: dict[str, float]
    flags: tuple[str, ...] = ()
    success: bool = False
    masked: bool = False  # excluded from the loss (failed rollout, failed grader)


@dataclass(frozen=True)
class Group:
    """G scored trajectories sampled from the same prompt (the unit of GRPO's baseline)."""

    prompt_index: int
    members: tuple[Scored, ...]

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.members]
