"""Chat formats, one table: `hermes`, `qwen3`, `harmony` (see docs/models.md, "Chat formats").

`detect(tokenizer)` picks the first format whose `matches` accepts the tokenizer, in the order
harmony (its control tokens are in the vocabulary), qwen3 (a ChatML template with `<think>` and
`<tool_call>`), hermes (everything else). `rollout.chat_format` overrides the detection.
"""

from __future__ import annotations

from typing import Any

from actloop.rollout.formats.base import ChatFormat, ParsedCalls, Piece
from actloop.rollout.formats.harmony import REASONING_EFFORTS, HarmonyFormat
from actloop.rollout.formats.hermes import HermesFormat, Qwen3Format

FORMATS: dict[str, type[ChatFormat]] = {"harmony": HarmonyFormat, "qwen3": Qwen3Format, "hermes": HermesFormat}
CHAT_FORMATS = ("auto", *FORMATS)

__all__ = ["CHAT_FORMATS", "FORMATS", "REASONING_EFFORTS", "ChatFormat", "ParsedCalls", "Piece", "detect",
           "make_format"]


def detect(tokenizer: Any) -> str:
    """The name of the format this tokenizer speaks."""
    return next(name for name, cls in FORMATS.items() if cls.matches(tokenizer))


def make_format(tokenizer: Any, chat_format: str = "auto", reasoning_effort: str = "medium",
                tool_prompt: str = "") -> ChatFormat:
    name = detect(tokenizer) if chat_format == "auto" else chat_format
    if name not in FORMATS:
        raise ValueError(f"rollout.chat_format must be one of {', '.join(CHAT_FORMATS)}; got `{chat_format}`")
    return FORMATS[name](tokenizer, reasoning_effort=reasoning_effort, tool_prompt=tool_prompt)
