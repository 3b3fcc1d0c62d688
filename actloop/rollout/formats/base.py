"""What every chat format provides, and the one place text becomes token ids.

A format turns messages (+ tool schemas) into `Piece`s of text and parses sampled ids back into
an assistant `Message`. `encode_pieces` is the only tokenizer call that renders: structural
text (role headers, template markup) may hold control tokens; `literal` text (every message's
content except the assistant's own, tool output, tool schemas' descriptions are structural) is
tokenized with special tokens treated as plain text, so a tool that prints `<|im_end|>` yields
the characters `<|im_end|>`, never the control token. A piece that carries `ids` was tokenized
by the format's reference library (Harmony on gpt-oss's own vocabulary) and is used as is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

from actloop.types import Message, ToolCall


@dataclass(frozen=True)
class Piece:
    """A span of rendered text. `literal`: environment/user text — special tokens are text.
    `ids`: the span's token ids when a reference library tokenized it (then they are used, not
    the text)."""

    text: str
    literal: bool = False
    ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ParsedCalls:
    """Tool calls found in an assistant message; `error` says why a call could not be parsed,
    `name` the tool a malformed call was addressed to, when known (its error reply comes from
    that tool: Harmony cannot write a tool message without an author)."""

    calls: tuple[ToolCall, ...]
    error: str | None = None
    name: str | None = None


class Slots:
    """Stand-ins for literal contents while a template or library renders text: `slot(text)`
    returns a marker, `pieces(rendered)` cuts the rendered text back into structural pieces and
    the literal contents the markers stood for."""

    _MARK = re.compile("\u2063ACTLOOP_(\\d+)\u2063")

    def __init__(self) -> None:
        self.texts: list[str] = []

    def __call__(self, text: str) -> str:
        self.texts.append(text)
        return f"\u2063ACTLOOP_{len(self.texts) - 1}\u2063"

    def pieces(self, rendered: str) -> list[Piece]:
        out, pos = [], 0
        for m in self._MARK.finditer(rendered):
            out += [Piece(rendered[pos:m.start()]), Piece(self.texts[int(m.group(1))], literal=True)]
            pos = m.end()
        return out + [Piece(rendered[pos:])]


class ChatFormat:
    """One chat format for one tokenizer. Subclasses set `name` and implement the four methods."""

    name = ""
    stop_strings: tuple[str, ...] = ()  # strings that end generation (besides stop_ids)
    tool_call_hint = ""  # how to write a tool call, told to the model after a malformed one

    def __init__(self, tokenizer: Any, reasoning_effort: str = "medium", tool_prompt: str = ""):
        self.tokenizer = tokenizer
        self.reasoning_effort = reasoning_effort  # harmony
        # hermes with a template that cannot declare tools: `rollout.tool_prompt`, which overrides
        # the environment's own wording (the `tool_prompt` argument of prompt_pieces)
        self.tool_prompt = tool_prompt
        self.stop_ids = self._stop_ids()

    # --------------------------------------------------------------------- to implement
    @classmethod
    def matches(cls, tokenizer: Any) -> bool:
        """True when the tokenizer (vocabulary / chat template) speaks this format."""
        raise NotImplementedError

    def stop_tokens(self) -> tuple[str, ...]:
        """Token strings that end an assistant generation (those missing from the vocab are skipped)."""
        raise NotImplementedError

    def prompt_pieces(self, messages: list[Message], tools: list[dict[str, Any]], tool_prompt: str = "") -> list[Piece]:
        """The opening prompt with the assistant generation prompt appended. `tool_prompt`: the
        environment's wording of the tool prompt, for a format that writes one itself (hermes
        with a template that cannot declare tools; `self.tool_prompt` overrides it); a format
        that declares tools its own way ignores it."""
        raise NotImplementedError

    def history_pieces(self, messages: list[Message], tools: list[dict[str, Any]], tool_prompt: str = "") -> list[Piece]:
        """A whole conversation as this format writes it from messages (no generation prompt)."""
        raise NotImplementedError

    def call_prefix(self, name: str | None) -> str | None:
        """The text that opens an assistant turn as a tool call (of `name`, when given), for a
        caller that forces one (the gateway's `tool_choice`); None where this format cannot."""
        return None

    def continuation_pieces(self, env_messages: list[Message], ended_with_stop: bool) -> list[Piece]:
        """What follows a sampled assistant turn: its closing tokens when the policy did not
        sample them, the environment's messages, the next generation prompt."""
        raise NotImplementedError

    def parse(self, ids: list[int]) -> tuple[Message, ParsedCalls]:
        """Sampled ids -> the assistant message (content = final text, reasoning, tool calls)."""
        raise NotImplementedError

    def assistant_text(self, message: Message) -> tuple[str, bool]:
        """The inverse of `parse`: an assistant message as the policy would sample it after the
        generation prompt, and whether that ends on a stop token (written in the text). Offline
        data (SFT, DPO) is rendered with it, so it trains on what a rollout would sample."""
        raise NotImplementedError

    # --------------------------------------------------------------------- shared
    def _stop_ids(self) -> tuple[int, ...]:
        tok, vocab = self.tokenizer, self.tokenizer.get_vocab()
        ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        ids |= {vocab[s] for s in self.stop_tokens() if s in vocab and vocab[s] != tok.unk_token_id}
        return tuple(sorted(ids))

    def encode(self, text: str, literal: bool = False) -> list[int]:
        """Token ids of `text`; `literal=True` treats special-token strings as plain text."""
        if not text:
            return []
        return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=literal)["input_ids"])

    def encode_pieces(self, pieces: Iterable[Piece]) -> list[int]:
        ids: list[int] = []
        for p in merge_pieces(pieces):
            ids += list(p.ids) if p.ids is not None else self.encode(p.text, p.literal)
        return ids

    def decode(self, ids: list[int] | tuple[int, ...]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def strip_stop(self, ids: list[int] | tuple[int, ...]) -> list[int]:
        ids = list(ids)
        return ids[:-1] if ids and ids[-1] in self.stop_ids else ids


def merge_pieces(pieces: Iterable[Piece]) -> list[Piece]:
    """Adjacent pieces of the same kind become one (tokenized together, as a template would be;
    pieces a library tokenized join their ids)."""
    out: list[Piece] = []
    for p in pieces:
        if not p.text and not p.ids:
            continue
        last = out[-1] if out else None
        if last is not None and last.ids is not None and p.ids is not None:
            out[-1] = Piece(last.text + p.text, ids=last.ids + p.ids)
        elif last is not None and last.ids is None and p.ids is None and last.literal == p.literal:
            out[-1] = Piece(last.text + p.text, p.literal)
        else:
            out.append(p)
    return out


def function_schemas(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI tool schemas ({"type": "function", "function": {...}}) or bare function dicts ->
    the function dicts ({"name", "description", "parameters"}); a malformed one is a clear error."""
    out = []
    for t in tools:
        fn = t.get("function", t) if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f'a tool schema needs {{"type": "function", "function": {{"name": ...}}}}, got {t!r:.200}')
        out.append(fn)
    return out
