"""The renderer owns tokens: chat messages <-> token ids + loss mask, and tool-call parsing.

Tokens in, tokens out: the ids the engine sampled for an assistant turn are kept exactly as
sampled. Everything the environment adds after a turn (the turn's closing tag when generation
stopped on a stop string, tool results, the next generation prompt) is rendered with the model's
own chat template, tokenized on its own, and appended with loss mask 0. Nothing the policy
sampled is ever decoded and re-tokenized.

Tool-call format (Hermes style, as Qwen and others use)::

    <tool_call>{"name": "calculator", "arguments": {"expression": "23 * 17"}}</tool_call>

Tool results go back as a `tool` message when the chat template knows a tool role. A template
with no tool role (SmolLM2's, for one) gets them as a user turn::

    <tool_response>
    391
    </tool_response>
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from actloop.types import Message, ToolCall

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_TOOL_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|$)", re.S)
_SENTINEL = "\u2063ACTLOOP_SENTINEL\u2063"


@dataclass(frozen=True)
class ParsedCalls:
    """Tool calls found in an assistant message; `error` says why a call could not be parsed."""

    calls: tuple[ToolCall, ...]
    error: str | None = None


def parse_tool_calls(text: str) -> ParsedCalls:
    """Find Hermes-style tool calls. A malformed one is reported in `error`, never raised."""
    calls = []
    for m in _TOOL_CALL_RE.finditer(text):
        raw = m.group(1).strip()
        if not m.group(0).endswith(TOOL_CALL_CLOSE):
            return ParsedCalls(tuple(calls), f"tool call is not closed with {TOOL_CALL_CLOSE}")
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            return ParsedCalls(tuple(calls), f"tool call is not valid JSON ({e.msg} at column {e.colno})")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return ParsedCalls(tuple(calls), 'tool call must be a JSON object with a string "name"')
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models emit arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return ParsedCalls(tuple(calls), '"arguments" must be a JSON object')
        if not isinstance(args, dict):
            return ParsedCalls(tuple(calls), '"arguments" must be a JSON object')
        calls.append(ToolCall(name=obj["name"], arguments=args, raw=raw))
    return ParsedCalls(tuple(calls))


class Renderer:
    """Chat template <-> token ids for one tokenizer.

    `prompt_ids(messages)` renders the opening prompt with the generation prompt appended.
    `continuation_ids(env_messages, ended_with_eos)` renders what follows a sampled assistant
    turn: the turn's closing tokens if the policy did not sample them, the environment's
    messages, and the next assistant generation prompt.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        template = tokenizer.chat_template or ""
        if not template:
            raise ValueError("tokenizer has no chat template; actloop needs a chat model")
        self.has_tool_role = "tool" in template
        self.eos_token_ids = self._eos_ids()
        self.eos_text = tokenizer.eos_token or ""
        self.stop_strings = (TOOL_CALL_CLOSE,)

    def _eos_ids(self) -> tuple[int, ...]:
        tok = self.tokenizer
        ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        for special in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<end_of_turn>"):
            i = tok.convert_tokens_to_ids(special)
            if isinstance(i, int) and i != tok.unk_token_id and i >= 0 and special in tok.get_vocab():
                ids.add(i)
        return tuple(sorted(ids))

    def as_template_message(self, m: Message) -> dict[str, Any]:
        """A message as the chat template sees it: tool results become a user turn when the
        template has no tool role."""
        if m.role == "tool" and not self.has_tool_role:
            return {"role": "user", "content": f"<tool_response>\n{m.content}\n</tool_response>"}
        return m.to_dict()

    def _template(self, messages: list[Message], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            [self.as_template_message(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int] | tuple[int, ...]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        return self.encode(self._template(messages, add_generation_prompt=True))

    def continuation_text(self, env_messages: list[Message], ended_with_eos: bool) -> str:
        base = [Message("user", "x"), Message("assistant", _SENTINEL)]
        full = self._template(base + list(env_messages), add_generation_prompt=True)
        text = full[full.index(_SENTINEL) + len(_SENTINEL):]
        if ended_with_eos and self.eos_text and text.startswith(self.eos_text):
            text = text[len(self.eos_text):]
        return text

    def continuation_ids(self, env_messages: list[Message], ended_with_eos: bool) -> list[int]:
        return self.encode(self.continuation_text(env_messages, ended_with_eos))

    def assistant_message(self, ids: list[int] | tuple[int, ...]) -> tuple[Message, ParsedCalls]:
        """Decode sampled ids into the assistant's message (without its EOS) and parse tool calls."""
        ids = list(ids)
        if ids and ids[-1] in self.eos_token_ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        parsed = parse_tool_calls(text)
        return Message("assistant", text, tool_calls=parsed.calls), parsed
