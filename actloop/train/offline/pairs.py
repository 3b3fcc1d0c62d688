"""Offline data for the DPO and SFT trainers: conversations rendered to token ids + loss mask.

A conversation is rendered exactly as a rollout of it would be (tokens in, tokens out):

    prompt messages ─► Renderer.prompt_ids                                          mask 0
    assistant turn  ─► encode(Renderer.assistant_text(message)): content, reasoning and  mask 1
                       tool calls as sampled, with the stop token the policy samples
    tool / user     ─► Renderer.continuation_ids (closing tags, tool results, next   mask 0
                       generation prompt), as the renderer does for the template

so the loss covers the assistant turns only, and (Hermes) an assistant turn that ends with
`</tool_call>` is not followed by a trained end-of-turn token (the engine stops on that string;
the renderer closes the turn with mask 0). `tests/train/test_sft.py` checks that a task's gold
trace (`Task.gold_trace`: calculator, gsm8k-tool) rendered here has the very ids and mask that a
rollout of the same turns produces.

Row formats (JSONL, one object per line; a malformed row fails with its file and line):

    preference (DPO)  {"prompt": [{role, content}...] | "text",
                       "chosen": "assistant text" | [assistant/tool messages...],
                       "rejected": same as chosen}
    supervised (SFT)  {"messages": [{role, content}...]}   (the prompt is everything before the
                       first assistant message; every assistant message is trained on)
                      or {"prompt": ..., "completion": "text" | [messages...]}

Assistant messages may carry OpenAI-style `tool_calls` ([{"function": {"name", "arguments"}}])
and `reasoning_content`; the renderer writes them in the model's chat format (Hermes, Qwen3,
Harmony: `Renderer.assistant_text`), as the policy would sample them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from actloop.data.jsonl import ROLES, DataError, read_jsonl_objects, validate_row
from actloop.envs.base import Env
from actloop.rollout.renderer import Renderer
from actloop.types import Message, ToolCall

GoldTrace = Callable[[dict[str, Any]], list[Message] | None]  # `Task.gold_trace`: row -> completion messages


@dataclass(frozen=True)
class Sequence:
    """A rendered conversation: ids [L] and loss mask [L] (1 on assistant tokens)."""

    ids: tuple[int, ...]
    mask: tuple[int, ...]

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.mask)


@dataclass(frozen=True)
class Pair:
    """A preference pair: the same prompt, a chosen and a rejected continuation."""

    chosen: Sequence
    rejected: Sequence
    row: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------ rendering


def _tool_calls(calls: Any, where: str) -> tuple[ToolCall, ...]:
    """OpenAI-style tool_calls -> ToolCalls (the renderer spells them in the model's format)."""
    out = []
    for c in calls:
        fn = c.get("function", c) if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise DataError(f"{where}: a tool call needs a `name` (or `function.name`), got {c!r:.120}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                raise DataError(f"{where}: tool call arguments are not valid JSON: {args!r:.120}") from None
        if not isinstance(args, dict):
            raise DataError(f"{where}: tool call arguments must be a JSON object, got {args!r:.120}")
        out.append(ToolCall(fn["name"], args))
    return tuple(out)


def to_messages(items: Any, where: str) -> list[Message]:
    """A JSON list of {role, content[, name, tool_calls]} -> Messages, validated."""
    if not isinstance(items, list) or not items:
        raise DataError(f"{where}: expected a non-empty list of {{role, content}} messages")
    out = []
    for j, m in enumerate(items):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise DataError(f"{where}: message {j} must be {{\"role\": one of {sorted(ROLES)}, \"content\": string}}, "
                            f"got {m!r:.120}")
        content = m.get("content")
        if content is None and m.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            raise DataError(f"{where}: message {j} has no string `content`: {m!r:.120}")
        calls: tuple[ToolCall, ...] = ()
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = _tool_calls(m["tool_calls"], f"{where}: message {j}")
        reasoning = m.get("reasoning_content") or m.get("reasoning") or ""
        out.append(Message(m["role"], content, tool_calls=calls, name=m.get("name"),
                           reasoning=reasoning if isinstance(reasoning, str) else ""))
    return out


def render_conversation(renderer: Renderer, prompt: list[Message], completion: list[Message],
                        tools: list[dict[str, Any]] | tuple = (), tool_prompt: str = "") -> Sequence:
    """prompt (ends before the first assistant turn) + completion (starts with an assistant turn)
    -> ids and a mask that is 1 exactly on the assistant turns (and their end-of-turn token).
    `tools`: the tool schemas declared in the prompt, as the environment's `reset` returns them;
    `tool_prompt`: the environment's tool-prompt wording (`ToolEnv.tool_prompt`), as a rollout
    renders it."""
    if not completion or completion[0].role != "assistant":
        raise ValueError("a completion must start with an assistant message")
    turns: list[tuple[Message, list[Message]]] = []
    for m in completion:
        if m.role == "assistant":
            turns.append((m, []))
        else:
            turns[-1][1].append(m)
    ids = renderer.prompt_ids(prompt, tools, tool_prompt)
    mask = [0] * len(ids)
    for k, (msg, env) in enumerate(turns):
        text, ended_with_eos = renderer.assistant_text(msg)  # as the policy samples it, in the model's format
        turn_ids = renderer.encode(text)
        ids += turn_ids
        mask += [1] * len(turn_ids)
        if k < len(turns) - 1:  # what follows is rendered as the rollout loop renders env messages
            cont = renderer.continuation_ids(env, ended_with_eos)
            ids += cont
            mask += [0] * len(cont)
    return Sequence(tuple(ids), tuple(mask))


def masked_spans(ids, mask) -> list[list[int]]:
    """The maximal runs of loss-masked tokens (one per assistant turn)."""
    spans, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    return spans


# -------------------------------------------------------------------------------------- loading


def _completion(value: Any, where: str, key: str) -> list[Message]:
    if isinstance(value, str):
        return [Message("assistant", value)]
    msgs = to_messages(value, f"{where}: `{key}`")
    if msgs[0].role != "assistant":
        raise DataError(f"{where}: `{key}` must start with an assistant message")
    return msgs


def _prompt(row: dict[str, Any], where: str) -> list[Message]:
    row = validate_row(row, where)  # a string prompt becomes one user turn
    msgs = to_messages(row["prompt"], f"{where}: `prompt`")
    return msgs


def parse_preference_row(row: dict[str, Any], where: str) -> tuple[list[Message], list[Message], list[Message]]:
    for key in ("prompt", "chosen", "rejected"):
        if key not in row:
            raise DataError(f"{where}: a preference row needs `prompt`, `chosen` and `rejected`; `{key}` is missing")
    return _prompt(row, where), _completion(row["chosen"], where, "chosen"), _completion(row["rejected"], where, "rejected")


def check_rows(path: str | Path, parse) -> int:
    """Parse every row of `path` with `parse(row, where)` (DataError naming file and line on the
    first bad one); the row count. Run before a run directory is made."""
    rows = read_jsonl_objects(path)
    for where, row in rows:
        parse(row, where)
    return len(rows)


def load_preference_pairs(path: str | Path, renderer: Renderer) -> list[Pair]:
    pairs = []
    for where, row in read_jsonl_objects(path):
        prompt, chosen, rejected = parse_preference_row(row, where)
        pairs.append(Pair(render_conversation(renderer, prompt, chosen), render_conversation(renderer, prompt, rejected),
                          row))
    return pairs


def parse_sft_row(row: dict[str, Any], where: str) -> tuple[list[Message], list[Message]]:
    if "messages" in row:
        msgs = to_messages(row["messages"], f"{where}: `messages`")
        first = next((i for i, m in enumerate(msgs) if m.role == "assistant"), None)
        if first is None:
            raise DataError(f"{where}: `messages` has no assistant message to train on")
        if first == 0:
            raise DataError(f"{where}: `messages` needs at least one message before the first assistant turn")
        return msgs[:first], msgs[first:]
    if "prompt" in row and "completion" in row:
        return _prompt(row, where), _completion(row["completion"], where, "completion")
    raise DataError(f"{where}: an SFT row needs `messages` (or `prompt` and `completion`)")


def load_sft_sequences(path: str | Path, renderer: Renderer) -> list[Sequence]:
    return [render_conversation(renderer, *parse_sft_row(row, where)) for where, row in read_jsonl_objects(path)]


# ------------------------------------------------------------------------------ gold traces


def gold_conversation(gold_trace: GoldTrace, make_env: Callable[[], Env], row: dict[str, Any]
                      ) -> tuple[list[Message], list[Message], list[dict[str, Any]], str] | None:
    """A task's gold episode of `row` as a rollout of it opens: (the environment's own prompt
    messages, the gold completion `gold_trace(row)`, the tool schemas `reset` declares, the
    environment's `tool_prompt` wording), or None when the row has no gold trace."""
    completion = gold_trace(row)
    if completion is None:
        return None
    env = make_env()
    try:
        prompt, tools = env.reset(row)
    finally:
        env.close()
    return list(prompt), list(completion), list(tools or ()), getattr(env, "tool_prompt", "") or ""


def gold_sequences(gold_trace: GoldTrace, make_env: Callable[[], Env], rows: list[dict[str, Any]],
                   renderer: Renderer) -> tuple[list[Sequence], int]:
    """The ReTool-style cold-start data of a task (`Task.gold_trace`): each row's gold episode
    rendered exactly as a rollout of the same turns renders it (tools declared as the environment
    declares them; `tests/train/test_sft.py` checks ids and mask against a rollout). Returns
    (sequences, number of rows skipped for having no gold trace)."""
    seqs, skipped = [], 0
    for row in rows:
        conv = gold_conversation(gold_trace, make_env, row)
        if conv is None:
            skipped += 1
            continue
        prompt, completion, tools, tool_prompt = conv
        seqs.append(render_conversation(renderer, prompt, completion, tools=tools, tool_prompt=tool_prompt))
    return seqs, skipped


def messages_json(messages) -> list[dict[str, Any]]:
    return [m.to_dict() for m in messages]
