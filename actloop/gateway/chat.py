"""OpenAI chat requests <-> the renderer: the one seam between the gateway and the chat format.

    messages = to_messages(body["messages"])          # validated; RequestError on bad input
    tools = check_tools(body.get("tools"))
    ids = fmt.prompt_ids(messages, tools)             # the prompt the engine continues
    ids += fmt.continuation_ids(new_messages, eos)    # what follows sampled ids (mask 0)
    content, reasoning, calls, error = fmt.parse(sampled_ids)

Everything format-specific (tool-call syntax, how tools are announced, reasoning, EOS
handling) is the renderer's chat format (hermes, qwen3, harmony); `ChatFormat` is the thin seam.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from actloop.rollout.renderer import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, Renderer
from actloop.types import Message, ToolCall

ROLES = ("system", "developer", "user", "assistant", "tool")
_CALL_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r".*?" + re.escape(TOOL_CALL_CLOSE), re.S)  # Hermes / Qwen3


class RequestError(ValueError):
    """A request the server refuses: becomes an OpenAI-style error body with this status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.type = message, param, status, code, type_

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _text(content: Any, where: str) -> str:
    """OpenAI content: a string, null, or a list of {"type": "text", "text": ...} parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text") \
                    or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}.content[{k}]: only text parts are supported", f"{where}.content")
            out.append(part["text"])
        return "".join(out)
    raise RequestError(f"{where}.content must be a string, null or a list of text parts", f"{where}.content")


def _tool_call(tc: Any, where: str) -> ToolCall:
    fn = tc.get("function") if isinstance(tc, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(f"{where}: a tool call needs function.name", where)
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise RequestError(f"{where}.function.arguments is not valid JSON", where) from None
    if not isinstance(args, dict):
        raise RequestError(f"{where}.function.arguments must be a JSON object", where)
    return ToolCall(name=fn["name"], arguments=args)


def to_messages(raw: Any) -> list[Message]:
    """Validate OpenAI `messages` and convert them (developer -> system; assistant tool calls are
    kept as ToolCall objects)."""
    if not isinstance(raw, list) or not raw:
        raise RequestError("`messages` must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{where} must be an object", where)
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}", f"{where}.role")
        if "content" not in m and not (role == "assistant" and m.get("tool_calls")):
            raise RequestError(f"{where} has no content", f"{where}.content")
        text = _text(m.get("content"), where)
        calls: tuple[ToolCall, ...] = ()
        if role == "assistant" and m.get("tool_calls"):
            if not isinstance(m["tool_calls"], list):
                raise RequestError(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
            calls = tuple(_tool_call(tc, f"{where}.tool_calls[{k}]") for k, tc in enumerate(m["tool_calls"]))
        name = m.get("name") if isinstance(m.get("name"), str) else None
        out.append(Message("system" if role == "developer" else role, text, tool_calls=calls, name=name))
    return out


def check_tools(raw: Any) -> list[dict[str, Any]]:
    """Validate `tools` (function tools with a name and a JSON-schema object of parameters)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise RequestError("`tools` must be a list", "tools")
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise RequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", f"tools[{i}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"tools[{i}].function.name must be a non-empty string", f"tools[{i}].function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise RequestError(f"tools[{i}].function.parameters must be a JSON schema of type object",
                               f"tools[{i}].function.parameters")
    return raw


def forced_call(choice: Any, tools: list[dict[str, Any]]) -> tuple[bool, str | None]:
    """Whether `tool_choice` forces a tool call (`required`, or a named function), and the name it
    forces (None: any of the tools). A call is forced by starting the reply with the format's
    call opening (`ChatFormat.call_prefix`)."""
    if choice == "required" and tools:
        return True, None
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        return True, choice["function"].get("name")
    return False, None


def tool_choice_tools(tools: list[dict[str, Any]], choice: Any) -> list[dict[str, Any]]:
    """Apply `tool_choice` to the declared tools: none hides them; a named function keeps only
    that one; auto and required keep them all (`forced_call` then makes the reply a call)."""
    if choice in (None, "auto", "required"):
        return tools
    if choice == "none":
        return []
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        kept = [t for t in tools if t["function"]["name"] == name]
        if not kept:
            raise RequestError(f"tool_choice names `{name}`, which is not in `tools`", "tool_choice")
        return kept
    raise RequestError("tool_choice must be none, auto, required or {\"type\": \"function\", ...}", "tool_choice")


@dataclass(frozen=True)
class Parsed:
    content: str  # the text outside tool calls
    reasoning: str | None
    tool_calls: tuple[ToolCall, ...]
    error: str | None  # a malformed tool call (the text stays in `content`)


class ChatFormat:
    """The gateway's view of the chat format: the renderer's (`actloop.rollout.formats`), which
    declares tools in the model's own way (a template's `tools`, or the Hermes system prompt for
    one without) and parses content, reasoning and tool calls out of sampled ids."""

    def __init__(self, renderer: Renderer):
        self.renderer = renderer
        self.tokenizer = renderer.tokenizer
        self.eos_token_ids = renderer.eos_token_ids
        self.stop_strings = renderer.stop_strings

    def prompt_ids(self, messages: list[Message], tools: list[dict[str, Any]]) -> list[int]:
        return self.renderer.prompt_ids(messages, tools)

    def continuation_ids(self, messages: list[Message], ended_with_eos: bool) -> list[int]:
        return self.renderer.continuation_ids(messages, ended_with_eos)

    def encode(self, text: str) -> list[int]:
        return self.renderer.encode(text)

    def decode(self, ids) -> str:
        return self.renderer.decode(ids)

    def call_prefix(self, name: str | None) -> str | None:
        return self.renderer.format.call_prefix(name)

    def parse(self, ids: list[int] | tuple[int, ...]) -> Parsed:
        """Content (the text around well-formed tool calls, which go to `tool_calls` as in
        OpenAI's shape), reasoning, tool calls, and the parse error of a malformed call (its text
        then stays in the content)."""
        message, parsed = self.renderer.assistant_message(ids)
        content = message.content
        if message.tool_calls and parsed.error is None:
            content = _CALL_BLOCK.sub("", content).strip()
        return Parsed(content=content, reasoning=message.reasoning or None, tool_calls=message.tool_calls,
                      error=parsed.error)
