"""A single-turn environment: a system prompt, worked examples as earlier chat turns, the row's
question; the first reply ends the episode.

Small models follow an answer format when they are shown it in earlier turns, not when they are
told it in words, so every built-in task's format lives in its `shots`.
"""

from __future__ import annotations

from typing import Any, Callable

from actloop.envs.base import StepResult
from actloop.types import Message


class PromptEnv:
    def __init__(self, system: str, shots: list[Message], render: Callable[[dict[str, Any]], str]):
        self.system, self.shots, self.render = system, shots, render

    def reset(self, row: dict[str, Any]) -> tuple[list[Message], list[dict[str, Any]]]:
        return [Message("system", self.system), *self.shots, Message("user", self.render(row))], []

    def step(self, message: Message) -> StepResult:
        return StepResult(messages=[], done=True)

    def close(self) -> None:
        pass


def qa_shots(pairs: list[tuple[str, str]]) -> list[Message]:
    """[(question, answer), ...] -> alternating user / assistant turns."""
    out: list[Message] = []
    for q, a in pairs:
        out += [Message("user", q), Message("assistant", a)]
    return out
