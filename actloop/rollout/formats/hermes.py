"""Hermes tool calls through the model's own chat template; `qwen3` adds `<think>` reasoning.

Tool call (Hermes style, as Qwen, SmolLM2's demo and others use)::

    <tool_call>{"name": "calculator", "arguments": {"expression": "23 * 17"}}</tool_call>

Prompts are rendered by the tokenizer's chat template with placeholders in place of message
contents; the template's markup is tokenized as the template wrote it and the contents as
literal text (no control tokens). Tool schemas go to `apply_chat_template(tools=...)` when the
template knows `tools`; otherwise the system message becomes `tool_system_prompt`: a template
filled from the schemas (by default the task's system message, then a line per tool and how to
call one). An environment may word that template itself (`ToolEnv.tool_prompt`); the
`rollout.tool_prompt` setting overrides both. Worked examples in a prompt are assistant messages
with `tool_calls`, written in the spelling of the format (Hermes text, or the template's own).
Tool results go back as a `tool` message when the template has a tool role, else as a user turn
`<tool_response>\\n...\\n</tool_response>`.

`qwen3`: the reply may open with `<think>...</think>` (reasoning, never searched for tool
calls); Qwen3's template drops earlier `<think>` blocks when it re-renders history, which never
happens here: sampled ids are appended as sampled, only what follows them is rendered.
"""

from __future__ import annotations

import json
import re
from typing import Any

from actloop.rollout.formats.base import ChatFormat, ParsedCalls, Piece, Slots, function_schemas
from actloop.types import Message, ToolCall, example_arguments

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_TOOL_CALL_RE = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CALL_CLOSE) + r"|$)", re.S)
_TURN = "\u2063ACTLOOP_TURN\u2063"  # stands for a sampled assistant turn when rendering what follows it
HERMES_HINT = 'Write a tool call exactly as <tool_call>{"name": "...", "arguments": {...}}</tool_call>.'


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


def hermes_call_text(call: ToolCall) -> str:
    return f"{TOOL_CALL_OPEN}{json.dumps({'name': call.name, 'arguments': call.arguments})}{TOOL_CALL_CLOSE}"


def _signature(fn: dict[str, Any]) -> str:
    props = (fn.get("parameters") or {}).get("properties") or {}
    required = set((fn.get("parameters") or {}).get("required") or [])
    args = ", ".join(f"{k}{'' if k in required else '?'}: {v.get('type', 'any')}" for k, v in props.items())
    return f"{fn['name']}({args})"


DEFAULT_TOOL_PROMPT = "{system}\n\nYou can call these tools:\n{tools}\nCall a tool as {call} and wait for its result."


def tool_system_prompt(system: str, tools: list[dict[str, Any]], template: str = "") -> str:
    """The system message for a chat template without tool support (SmolLM2's): `template`
    (`rollout.tool_prompt`, else the environment's `tool_prompt`; empty = DEFAULT_TOOL_PROMPT)
    with `{system}` = the task's system message, `{tools}` = a line per tool, `{call}` = a call
    of the first tool spelled out (`{tools}` and `{call}` optional; a template without `{system}`
    is refused when there is a system message to place), e.g. with the default

        <the task's system message>

        You can call these tools:
        - calculator(expression: string): Evaluate an arithmetic expression ...
        Call a tool as <tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call> and wait for its result.
    """
    template = template or DEFAULT_TOOL_PROMPT
    if system.strip() and "{system}" not in template:
        raise ValueError(f"the tool prompt {template!r:.120} has no {{system}}: the task's system message would be lost")
    fns = function_schemas(tools)
    lines = "\n".join(f"- {_signature(fn)}: {fn.get('description', '').strip()}".rstrip(": ") for fn in fns)
    params = fns[0].get("parameters") or {}
    example_args = example_arguments(params, params.get("required") or list(params.get("properties") or {})[:1])
    call = f"{TOOL_CALL_OPEN}{json.dumps({'name': fns[0]['name'], 'arguments': example_args})}{TOOL_CALL_CLOSE}"
    text = template.replace("{tools}", lines).replace("{call}", call)
    return text.replace("{system}", system).strip()


class HermesFormat(ChatFormat):
    name = "hermes"

    def call_prefix(self, name: str | None) -> str | None:
        return TOOL_CALL_OPEN + _call_opening(name)  # as `hermes_call_text` writes a call
    stop_strings = (TOOL_CALL_CLOSE,)
    tool_call_hint = HERMES_HINT

    def __init__(self, tokenizer: Any, reasoning_effort: str = "medium", tool_prompt: str = ""):
        template = tokenizer.chat_template or ""
        if not template:
            raise ValueError("tokenizer has no chat template; actloop needs a chat model")
        self.has_tool_role = "tool" in template
        self.template_tools = "tools" in template  # the template renders `tools=` itself
        super().__init__(tokenizer, reasoning_effort, tool_prompt)

    @classmethod
    def matches(cls, tokenizer: Any) -> bool:
        return True  # the fallback

    def stop_tokens(self) -> tuple[str, ...]:
        return ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<end_of_turn>")

    # ------------------------------------------------------------------ rendering
    def _template_messages(self, messages: list[Message], tools: list[dict[str, Any]],
                           tool_prompt: str = "") -> tuple[list[dict], Slots]:
        """Messages as the chat template sees them, each non-assistant content replaced by a slot."""
        slot = Slots()
        messages = list(messages)
        if tools and not self.template_tools:  # the template cannot declare tools: our one tool prompt
            system = messages.pop(0).content if messages and messages[0].role == "system" else ""
            messages.insert(0, Message("system", tool_system_prompt(system, tools, self.tool_prompt or tool_prompt)))
        out = []
        for m in messages:
            if m.role == "assistant":
                out.append(self._assistant_dict(m))
            elif m.role == "tool" and not self.has_tool_role:
                out.append({"role": "user", "content": f"<tool_response>\n{slot(m.content)}\n</tool_response>"})
            else:
                d: dict[str, Any] = {"role": m.role, "content": slot(m.content)}
                if m.name:
                    d["name"] = m.name
                out.append(d)
        return out, slot

    def _assistant_dict(self, m: Message) -> dict[str, Any]:
        if m.content == _TURN:
            return {"role": "assistant", "content": _TURN}
        d: dict[str, Any] = {"role": "assistant", "content": m.content}
        if m.tool_calls:
            if self.template_tools:
                d["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                   for c in m.tool_calls]
            else:
                d["content"] = m.content + "".join(hermes_call_text(c) for c in m.tool_calls)
        if m.reasoning:
            d["reasoning_content"] = m.reasoning
        return d

    def _render(self, messages: list[Message], tools: list[dict[str, Any]], add_generation_prompt: bool,
                tool_prompt: str = "") -> list[Piece]:
        dicts, slots = self._template_messages(messages, tools, tool_prompt)
        kwargs: dict[str, Any] = {}
        if tools and self.template_tools:
            kwargs["tools"] = tools
        text = self.tokenizer.apply_chat_template(dicts, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  **kwargs)
        return slots.pieces(text)

    def prompt_pieces(self, messages: list[Message], tools: list[dict[str, Any]], tool_prompt: str = "") -> list[Piece]:
        return self._render(messages, tools, add_generation_prompt=True, tool_prompt=tool_prompt)

    def history_pieces(self, messages: list[Message], tools: list[dict[str, Any]], tool_prompt: str = "") -> list[Piece]:
        return self._render(messages, tools, add_generation_prompt=False, tool_prompt=tool_prompt)

    def continuation_pieces(self, env_messages: list[Message], ended_with_stop: bool) -> list[Piece]:
        base = [Message("user", "x"), Message("assistant", _TURN)]
        pieces = self._render(base + list(env_messages), [], add_generation_prompt=True)
        # keep what follows the assistant placeholder
        for i, p in enumerate(pieces):
            if not p.literal and _TURN in p.text:
                pieces = [Piece(p.text[p.text.index(_TURN) + len(_TURN):])] + pieces[i + 1:]
                break
        closing = self.tokenizer.eos_token or ""
        if ended_with_stop and closing and pieces and pieces[0].text.startswith(closing):
            pieces[0] = Piece(pieces[0].text[len(closing):])  # the policy sampled the turn's end itself
        return pieces

    def assistant_text(self, message: Message) -> tuple[str, bool]:
        text = message.content  # a parsed message's content already spells its calls
        if TOOL_CALL_OPEN not in text:
            text += "".join(hermes_call_text(c) for c in message.tool_calls)
        if text.rstrip().endswith(TOOL_CALL_CLOSE):
            return text, False  # generation stops on the string: the renderer closes the turn
        closing = "".join(p.text for p in self.continuation_pieces([], ended_with_stop=False))
        eos = self.tokenizer.eos_token or ""
        if eos and closing.startswith(eos):  # the turn's end is the EOS token: the policy samples it
            return text + eos, True
        return text, False

    # ------------------------------------------------------------------ parsing
    def parse(self, ids: list[int]) -> tuple[Message, ParsedCalls]:
        text = self.tokenizer.decode(self.strip_stop(ids), skip_special_tokens=True)
        parsed = parse_tool_calls(text)
        return Message("assistant", text, tool_calls=parsed.calls), parsed


_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


def _call_opening(name: str | None) -> str:
    """`{"name": "NAME", "arguments": ` (a call's JSON up to its arguments), or nothing."""
    return json.dumps({"name": name})[:-1] + ', "arguments": ' if name else ""


class Qwen3Format(HermesFormat):
    name = "qwen3"
    stop_strings = ()  # Qwen3 closes its tool calls with <|im_end|> itself (parallel calls stay possible)

    @classmethod
    def matches(cls, tokenizer: Any) -> bool:
        template = tokenizer.chat_template or ""
        return _THINK_OPEN in template and "<|im_start|>" in template and TOOL_CALL_OPEN in template

    def stop_tokens(self) -> tuple[str, ...]:
        return ("<|im_end|>", "<|endoftext|>")

    def call_prefix(self, name: str | None) -> str | None:
        return f"{TOOL_CALL_OPEN}\n{_call_opening(name)}"  # as Qwen3's template writes a call

    def assistant_text(self, message: Message) -> tuple[str, bool]:
        think = f"{_THINK_OPEN}\n{message.reasoning.strip()}\n{_THINK_CLOSE}\n\n" if message.reasoning else ""
        calls = "" if TOOL_CALL_OPEN in message.content else "\n".join(
            f"{TOOL_CALL_OPEN}\n{json.dumps({'name': c.name, 'arguments': c.arguments})}\n{TOOL_CALL_CLOSE}"
            for c in message.tool_calls)
        body = "\n\n".join(t for t in (message.content.strip(), calls) if t)
        return f"{think}{body}<|im_end|>", True

    def parse(self, ids: list[int]) -> tuple[Message, ParsedCalls]:
        text = self.decode(self.strip_stop(ids))
        for special in ("<|im_end|>", "<|endoftext|>"):
            text = text.replace(special, "")
        reasoning = ""
        if _THINK_CLOSE in text:
            reasoning, text = text.split(_THINK_CLOSE, 1)
            reasoning = reasoning.replace(_THINK_OPEN, "", 1).strip()
        elif text.lstrip().startswith(_THINK_OPEN):  # cut inside its reasoning: nothing to execute
            reasoning, text = text.lstrip()[len(_THINK_OPEN):].strip(), ""
        text = text.strip()
        parsed = parse_tool_calls(text)  # never inside <think>
        return Message("assistant", text, tool_calls=parsed.calls, reasoning=reasoning), parsed
