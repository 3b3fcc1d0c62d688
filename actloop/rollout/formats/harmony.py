"""Harmony, gpt-oss's format (openai/harmony `docs/format.md`), written out here token by token.

    <|start|>system<|message|>... Reasoning: medium ...<|end|>
    <|start|>developer<|message|># Instructions\\n\\n{system}\\n\\n# Tools\\n\\n## functions\\n\\nnamespace functions {...}<|end|>
    <|start|>user<|message|>{question}<|end|>
    <|start|>assistant                                                 <- generation prompt
      <|channel|>analysis<|message|>{reasoning}<|end|>                 <- sampled
      <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{args}<|call|>
    <|start|>functions.NAME to=assistant<|channel|>commentary<|message|>{output}<|end|>
    <|start|>assistant                                                 <- next generation prompt
      <|channel|>final<|message|>{answer}<|return|>

Generation stops on `<|return|>`, `<|call|>` or `<|endoftext|>`. A tool call may be spelled
with the recipient after the channel or in the role header, with or without `<|constrain|>`;
all three parse. A recipient written in the `analysis` channel is reasoning, never executed.
Sampled ids are kept as sampled (a final `<|return|>` included: the trainer scores what was
sampled); when history is rendered from messages, a final answer closes with `<|end|>` and
analysis before the last final answer is dropped, as the format prescribes.
"""

from __future__ import annotations

import json
import re
from typing import Any

from actloop.rollout.formats.base import ChatFormat, ParsedCalls, Piece, function_schemas
from actloop.types import Message, ToolCall

REASONING_EFFORTS = ("low", "medium", "high")
HARMONY_HINT = ("Write a tool call as <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json"
                "<|message|>{...}<|call|> with the arguments as a JSON object.")
_TERMINATORS = re.compile(r"<\|end\|>|<\|call\|>|<\|return\|>")


def _ts_type(schema: dict[str, Any]) -> str:
    """A JSON schema as harmony's TypeScript-like type."""
    if "enum" in schema:
        return " | ".join(json.dumps(v) for v in schema["enum"])
    t = schema.get("type", "any")
    if isinstance(t, list):
        return " | ".join(_ts_type({**schema, "type": x}) for x in t)
    if t == "array":
        return f"{_ts_type(schema.get('items') or {})}[]"
    if t == "object" and schema.get("properties"):
        return "{\n" + _ts_fields(schema) + "}"
    return {"integer": "number", "number": "number", "string": "string", "boolean": "boolean", "null": "null",
            "object": "object"}.get(t, "any")


def _ts_fields(schema: dict[str, Any]) -> str:
    required = set(schema.get("required") or [])
    out = ""
    for name, prop in (schema.get("properties") or {}).items():
        if prop.get("description"):
            out += f"// {prop['description']}\n"
        default = f" // default: {prop['default']}" if "default" in prop else ""
        out += f"{name}{'' if name in required else '?'}: {_ts_type(prop)},{default}\n"
    return out


def tools_namespace(tools: list[dict[str, Any]]) -> str:
    """OpenAI tool schemas -> harmony's `namespace functions { ... }` block."""
    out = "## functions\n\nnamespace functions {\n\n"
    for fn in function_schemas(tools):
        if fn.get("description"):
            out += f"// {fn['description']}\n"
        params = fn.get("parameters") or {}
        if params.get("properties"):
            out += f"type {fn['name']} = (_: {{\n{_ts_fields(params)}}}) => any;\n\n"
        else:
            out += f"type {fn['name']} = () => any;\n\n"
    return out + "} // namespace functions"


class HarmonyFormat(ChatFormat):
    name = "harmony"
    tool_call_hint = HARMONY_HINT

    def __init__(self, tokenizer: Any, reasoning_effort: str = "medium", tool_prompt: str = ""):
        if reasoning_effort not in REASONING_EFFORTS:
            raise ValueError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}; got `{reasoning_effort}`")
        super().__init__(tokenizer, reasoning_effort, tool_prompt)

    @classmethod
    def matches(cls, tokenizer: Any) -> bool:
        vocab = tokenizer.get_vocab()
        return all(t in vocab for t in ("<|start|>", "<|channel|>", "<|message|>", "<|call|>"))

    def stop_tokens(self) -> tuple[str, ...]:
        return ("<|return|>", "<|call|>", "<|endoftext|>")

    def _stop_ids(self) -> tuple[int, ...]:  # not the tokenizer's eos: gpt-oss's is <|return|> anyway
        vocab = self.tokenizer.get_vocab()
        return tuple(sorted(vocab[s] for s in self.stop_tokens() if s in vocab))

    # ------------------------------------------------------------------ rendering
    def system_text(self, with_tools: bool) -> str:
        text = ("You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n\n"
                f"Reasoning: {self.reasoning_effort}\n\n"
                "# Valid channels: analysis, commentary, final. Channel must be included for every message.")
        if with_tools:
            text += "\nCalls to these tools must go to the commentary channel: 'functions'."
        return text

    def _message(self, m: Message, keep_analysis: bool) -> list[Piece]:
        if m.role == "user":
            return [Piece("<|start|>user<|message|>"), Piece(m.content, True), Piece("<|end|>")]
        if m.role == "tool":
            who = f"functions.{m.name}" if m.name else "functions"
            return [Piece(f"<|start|>{who} to=assistant<|channel|>commentary<|message|>"), Piece(m.content, True),
                    Piece("<|end|>")]
        if m.role == "system":  # a later system message: shown as a developer message
            return [Piece("<|start|>developer<|message|>"), Piece(m.content, True), Piece("<|end|>")]
        out = []
        if m.reasoning and keep_analysis:
            out.append(Piece(f"<|start|>assistant<|channel|>analysis<|message|>{m.reasoning}<|end|>"))
        if m.tool_calls:
            if m.content:
                out.append(Piece(f"<|start|>assistant<|channel|>commentary<|message|>{m.content}<|end|>"))
            for c in m.tool_calls:
                out.append(Piece(f"<|start|>assistant<|channel|>commentary to=functions.{c.name} <|constrain|>json"
                                 f"<|message|>{json.dumps(c.arguments)}<|call|>"))
        else:
            out.append(Piece(f"<|start|>assistant<|channel|>final<|message|>{m.content}<|end|>"))
        return out

    def prompt_pieces(self, messages: list[Message], tools: list[dict[str, Any]], tool_prompt: str = "") -> list[Piece]:
        # tool_prompt is not used: harmony declares tools in its own `# Tools` section
        messages = list(messages)
        pieces = [Piece(f"<|start|>system<|message|>{self.system_text(bool(tools))}<|end|>")]
        instructions = messages.pop(0).content if messages and messages[0].role == "system" else ""
        if instructions or tools:
            pieces.append(Piece("<|start|>developer<|message|>"))
            if instructions:
                pieces += [Piece("# Instructions\n\n"), Piece(instructions, True)]
            if tools:
                pieces.append(Piece(("\n\n" if instructions else "") + "# Tools\n\n" + tools_namespace(tools)))
            pieces.append(Piece("<|end|>"))
        # analysis is kept only after the last final answer (a tool-calling chain in progress)
        last_final = max((i for i, m in enumerate(messages) if m.role == "assistant" and not m.tool_calls), default=-1)
        for i, m in enumerate(messages):
            pieces += self._message(m, keep_analysis=i > last_final)
        return pieces + [Piece("<|start|>assistant")]

    def history_pieces(self, messages: list[Message], tools: list[dict[str, Any]], tool_prompt: str = "") -> list[Piece]:
        return self.prompt_pieces(messages, tools)[:-1]

    def continuation_pieces(self, env_messages: list[Message], ended_with_stop: bool) -> list[Piece]:
        pieces = [] if ended_with_stop else [Piece("<|end|>")]
        for m in env_messages:
            pieces += self._message(m, keep_analysis=True)
        return pieces + [Piece("<|start|>assistant")]

    def assistant_text(self, message: Message) -> tuple[str, bool]:
        text = "".join(p.text for p in self._message(message, keep_analysis=True))
        text = text[len("<|start|>assistant"):]  # the generation prompt wrote it
        if not message.tool_calls:  # a final answer is sampled with <|return|> (history shows <|end|>)
            text = text[:-len("<|end|>")] + "<|return|>"
        return text, True

    # ------------------------------------------------------------------ parsing
    def parse(self, ids: list[int]) -> tuple[Message, ParsedCalls]:
        text = "<|start|>assistant" + self.decode(ids).replace("<|endoftext|>", "")
        reasoning, final, preamble, calls, error = [], [], [], [], None
        for chunk in text.split("<|start|>")[1:]:
            if "<|message|>" not in chunk:
                continue  # a header cut off before its message: nothing said
            header, body = chunk.split("<|message|>", 1)
            end = _TERMINATORS.search(body)
            closed = end.group(0) if end else None
            body = body[:end.start()] if end else body
            channel = re.search(r"<\|channel\|>\s*(\w+)", header)
            channel = channel.group(1) if channel else ""
            recipient = re.search(r"to=([^\s<]+)", header)
            recipient = recipient.group(1) if recipient else None
            if channel == "analysis":
                reasoning.append(body)  # a call written here is thought, not action
            elif recipient is not None:
                if error:
                    continue
                if not recipient.startswith("functions."):
                    error = f"tool call to `{recipient}`: only functions.NAME tools are available"
                elif closed != "<|call|>":
                    error = "tool call is not closed with <|call|>"
                else:
                    try:
                        args = json.loads(body) if body.strip() else {}
                    except json.JSONDecodeError as e:
                        error = f"tool call arguments are not valid JSON ({e.msg} at column {e.colno})"
                        continue
                    if not isinstance(args, dict):
                        error = "tool call arguments must be a JSON object"
                        continue
                    calls.append(ToolCall(name=recipient[len("functions."):], arguments=args, raw=body))
            elif channel == "final":
                final.append(body)
            else:
                preamble.append(body)
        content = "".join(final) if final else "\n".join(preamble)
        parsed = ParsedCalls(tuple(calls), error)
        return Message("assistant", content, tool_calls=parsed.calls, reasoning="\n".join(reasoning)), parsed
