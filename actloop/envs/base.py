"""The environment protocol. Environments speak messages; they never see token ids.

    env = make_env()
    messages, tools = env.reset(row)          # opening conversation + tool schemas
    result = env.step(assistant_message)      # -> StepResult(messages, done, info, reward)
    env.close()                               # release what the episode holds (always called)

`tools` are OpenAI function schemas, ``{"type": "function", "function": {"name", "description",
"parameters": <JSON schema>}}``; the renderer shows them to the model, each chat format its own
way, so an environment never writes a tool-call spelling into its prompt: worked examples are
assistant messages with `tool_calls` (and `tool` result messages). `ToolEnv`
(`actloop.envs.tools`) builds the schemas from typed Python functions. An environment may have
a `tool_prompt` attribute: its wording of the tool prompt for chat templates that cannot declare
tools (see `ToolEnv.tool_prompt`). `assistant_message.tool_calls`
has already been parsed by the renderer. A malformed tool call never reaches `step`: the rollout
loop answers it with an error message and counts it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from actloop.types import Message


@dataclass(frozen=True)
class StepResult:
    messages: list[Message]  # what the environment says next (tool results, feedback)
    done: bool
    info: dict[str, Any] = field(default_factory=dict)  # merged into the trajectory's info
    reward: float | None = None  # optional per-turn reward (turn-level credit)


@runtime_checkable
class Env(Protocol):
    def reset(self, row: dict[str, Any]) -> tuple[list[Message], list[dict[str, Any]]]: ...

    def step(self, message: Message) -> StepResult: ...

    def close(self) -> None: ...


class ChatEnv:
    """Single-turn environment for custom data: the row's chat-format `prompt`, one answer."""

    def reset(self, row: dict[str, Any]) -> tuple[list[Message], list[dict[str, Any]]]:
        return [Message(m["role"], m["content"]) for m in row["prompt"]], []

    def step(self, message: Message) -> StepResult:
        return StepResult(messages=[], done=True)

    def close(self) -> None:
        pass
