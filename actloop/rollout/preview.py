"""`actloop render`: how one episode of a task looks to a model, token by token.

    preview_episode(renderer, env, row, replies) -> {"format", "prompt_text", "prompt_tokens",
                                                     "spans": [...], "replies": [...]}

The prompt is rendered exactly as a rollout renders it (`episodes.open_episode`: the tool
schemas `env.reset` returns, in the environment's `tool_prompt` wording where it has one). Each
reply is a hypothetical assistant turn, written in the format's own spelling; it is tokenized as
the policy would have sampled it (control tokens allowed, a stop token appended when it ends on
none), parsed, answered by the environment, and the environment's answer rendered as the rollout
loop renders it. `spans` lists the episode as runs of tokens with their loss mask (1 = trained:
the assistant's tokens only).
"""

from __future__ import annotations

from typing import Any

from actloop.rollout.episodes import open_episode
from actloop.rollout.renderer import Renderer


def _span(renderer: Renderer, kind: str, ids: list[int], mask: int) -> dict[str, Any]:
    return {"kind": kind, "mask": mask, "tokens": len(ids), "text": renderer.decode(ids)}


def reply_ids(renderer: Renderer, text: str) -> tuple[list[int], bool]:
    """A reply as the engine would have sampled it, and whether it ended on a stop token."""
    ids = renderer.encode(text)
    if ids and ids[-1] in renderer.eos_token_ids:
        return ids, True
    if any(text.endswith(s) for s in renderer.stop_strings):
        return ids, False  # the engine stops on the string: no stop token sampled
    tok = renderer.tokenizer
    stop = tok.eos_token_id if tok.eos_token_id in renderer.eos_token_ids else renderer.eos_token_ids[0]
    return ids + [stop], True


def preview_episode(renderer: Renderer, env: Any, row: dict[str, Any], replies: list[str]) -> dict[str, Any]:
    _messages, tools, prompt_ids = open_episode(renderer, env, row)
    spans = [_span(renderer, "prompt", prompt_ids, 0)]
    out: dict[str, Any] = {
        "format": renderer.format_name,
        "stop_ids": list(renderer.eos_token_ids),
        "stop_strings": list(renderer.stop_strings),
        "tools": [t.get("function", t).get("name") for t in tools],
        "prompt_text": renderer.decode(prompt_ids),
        "prompt_tokens": len(prompt_ids),
        "replies": [],
    }
    done = False
    for text in replies:
        if done:
            out["replies"].append({"reply": text, "skipped": "the episode already ended"})
            continue
        ids, ended = reply_ids(renderer, text)
        message, parsed = renderer.assistant_message(ids)
        spans.append(_span(renderer, "assistant", ids, 1))
        if parsed.error:
            env_messages = [renderer.malformed_call_reply(parsed)]
        else:
            result = env.step(message)
            env_messages, done = list(result.messages), result.done
        entry = {
            "reply": text,
            "reply_tokens": len(ids),
            "content": message.content,
            "reasoning": message.reasoning,
            "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in message.tool_calls],
            "parse_error": parsed.error,
            "env_reply": "\n".join(m.content for m in env_messages),
            "env_messages": [m.to_dict() for m in env_messages],
            "done": done,
        }
        if not done:
            env_ids = renderer.continuation_ids(env_messages, ended)
            spans.append(_span(renderer, "environment", env_ids, 0))
            entry["env_tokens"] = len(env_ids)
        out["replies"].append(entry)
    close = getattr(env, "close", None)
    if callable(close):
        close()
    out["spans"] = spans
    return out
