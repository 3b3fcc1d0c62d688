"""The renderer owns tokens: chat messages (+ tool schemas) <-> token ids + loss mask.

    r = Renderer(tokenizer)                      # chat format detected; or chat_format="harmony"
    ids = r.prompt_ids(messages, tools)          # the opening prompt, generation prompt appended
    ids = r.prompt_ids(messages, tools, env.tool_prompt)   # with the environment's tool-prompt wording
    msg, parsed = r.assistant_message(sampled)   # content (final text), reasoning, tool_calls
    ids += sampled + r.continuation_ids(env_messages, ended_with_eos)   # the next prompt
    r.eos_token_ids, r.stop_strings              # where the engine stops sampling

Tokens in, tokens out: the ids the engine sampled for an assistant turn are kept exactly as
sampled. Everything the environment adds after a turn (the turn's closing tokens when the policy
did not sample them, tool results, the next generation prompt) is rendered in the model's chat
format, tokenized on its own, and appended with loss mask 0. Nothing the policy sampled is ever
decoded and re-tokenized. Message contents from the environment (tool output, user replies,
prompts) are tokenized with special tokens treated as text: they cannot forge control tokens.

The formats themselves (`hermes`, `qwen3`, `harmony`) live in `actloop.rollout.formats`.
"""

from __future__ import annotations

from typing import Any

from actloop.rollout.formats import ChatFormat, ParsedCalls, Piece, make_format
from actloop.rollout.formats.base import merge_pieces
from actloop.rollout.formats.hermes import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, parse_tool_calls
from actloop.types import Message

__all__ = ["ParsedCalls", "Renderer", "TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "parse_tool_calls"]


class Renderer:
    """Chat format <-> token ids for one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer: Any, chat_format: str = "auto", reasoning_effort: str = "medium",
                 tool_prompt: str = ""):
        self.tokenizer = tokenizer
        self.format: ChatFormat = make_format(tokenizer, chat_format, reasoning_effort, tool_prompt)
        self.format_name = self.format.name
        self.eos_token_ids = self.format.stop_ids
        self.stop_strings = self.format.stop_strings
        self.tool_call_hint = self.format.tool_call_hint

    @classmethod
    def from_config(cls, tokenizer: Any, cfg: Any) -> "Renderer":
        """The renderer `cfg.rollout` asks for (`chat_format`, `reasoning_effort`, `tool_prompt`)."""
        return cls(tokenizer, cfg.rollout.chat_format, cfg.rollout.reasoning_effort, cfg.rollout.tool_prompt)

    def encode(self, text: str, literal: bool = False) -> list[int]:
        return self.format.encode(text, literal)

    def decode(self, ids: list[int] | tuple[int, ...]) -> str:
        return self.format.decode(ids)

    def prompt_pieces(self, messages: list[Message], tools: list[dict[str, Any]] | tuple = (),
                      tool_prompt: str = "") -> list[Piece]:
        """`tool_prompt`: the environment's wording of the tool prompt, used by a format that writes
        one itself (hermes with a template that cannot declare tools) unless `rollout.tool_prompt`
        is set (see `formats.hermes.tool_system_prompt`)."""
        return merge_pieces(self.format.prompt_pieces(list(messages), list(tools), tool_prompt))

    def prompt_ids(self, messages: list[Message], tools: list[dict[str, Any]] | tuple = (),
                   tool_prompt: str = "") -> list[int]:
        return self.format.encode_pieces(self.prompt_pieces(messages, tools, tool_prompt))

    def prompt_text(self, messages: list[Message], tools: list[dict[str, Any]] | tuple = (),
                    tool_prompt: str = "") -> str:
        return "".join(p.text for p in self.prompt_pieces(messages, tools, tool_prompt))

    def history_text(self, messages: list[Message], tools: list[dict[str, Any]] | tuple = (),
                     tool_prompt: str = "") -> str:
        """A whole conversation rendered from its messages (what a chat template would print)."""
        return "".join(p.text for p in self.format.history_pieces(list(messages), list(tools), tool_prompt))

    def continuation_pieces(self, env_messages: list[Message], ended_with_eos: bool) -> list[Piece]:
        return merge_pieces(self.format.continuation_pieces(list(env_messages), ended_with_eos))

    def continuation_text(self, env_messages: list[Message], ended_with_eos: bool) -> str:
        return "".join(p.text for p in self.continuation_pieces(env_messages, ended_with_eos))

    def continuation_ids(self, env_messages: list[Message], ended_with_eos: bool) -> list[int]:
        return self.format.encode_pieces(self.continuation_pieces(env_messages, ended_with_eos))

    def assistant_text(self, message: Message) -> tuple[str, bool]:
        """An assistant message as the policy would sample it (tool calls in this format's
        spelling), and whether it ends on a stop token; `encode(text)` gives the sampled ids."""
        return self.format.assistant_text(message)

    def malformed_call_reply(self, parsed: ParsedCalls) -> Message:
        """The environment's answer to a turn whose tool call could not be parsed: the error and
        how to write a call, from the tool the call was addressed to when known (a Harmony tool
        message needs an author)."""
        return Message("tool", f"Error: {parsed.error}. {self.tool_call_hint}", name=parsed.name)

    def assistant_message(self, ids: list[int] | tuple[int, ...]) -> tuple[Message, ParsedCalls]:
        """Sampled ids -> the assistant's message (content, reasoning, tool calls) and the parse
        result (`error` set for a malformed tool call)."""
        return self.format.parse(list(ids))
