"""Run multi-turn episodes: every active episode generates its next turn in one engine batch.

    prompt ids ──► engine ──► sampled ids ──► renderer.parse ──► env.step ──► env messages
        ▲                                                                        │
        └──────────── ids += sampled ids (mask 1) + continuation ids (mask 0) ◄──┘

A failure inside one episode (an environment that raises, a reset on a bad row, a generation
request the engine could not serve) is recorded on that trajectory as `error` and the others go
on; the trainer masks it from the loss.

The tool schemas `Env.reset` returns go to the renderer with the prompt (the chat format
declares them), with the environment's own `tool_prompt` wording where it has one
(`open_episode`, which `actloop render` uses too). An episode whose next turn would not fit in
`max_context` (ids so far + the environment's answer + `max_new_tokens`) is ended there and
marked `truncated_context` (counted per step, written to samples.jsonl); a prompt that does not
fit at all is a recorded error.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from actloop.envs.base import Env
from actloop.rollout.engine import Engine, SamplingParams
from actloop.rollout.renderer import Renderer
from actloop.types import Message, Trajectory, Turn



@dataclass
class _Episode:
    env: Env
    row: dict[str, Any]
    prompt_messages: list[Message] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    done: bool = False
    error: str | None = None
    routing: list[Any] = field(default_factory=list)  # MoE: per-position expert ids, as first computed
    truncated_context: bool = False

    def trajectory(self) -> Trajectory:
        return Trajectory(
            prompt_messages=tuple(self.prompt_messages),
            prompt_ids=tuple(self.prompt_ids),
            turns=tuple(self.turns),
            row=self.row,
            info=self.info,
            error=self.error,
            routing=_cat(self.routing),
            truncated_context=self.truncated_context,
        )

    def record_routing(self, routing: Any) -> None:
        """Keep the routing of the positions this engine call computed first (the earlier ones
        were recorded by the call that sampled them)."""
        if routing is not None:
            seen = sum(len(r) for r in self.routing)
            if len(routing) > seen:
                self.routing.append(routing[seen:])


def _cat(parts: list[Any]) -> Any:
    if not parts:
        return None
    import torch

    return torch.cat(parts)


def _error_text() -> str:
    return traceback.format_exc(limit=8)


def open_episode(renderer: Renderer, env: Env,
                 row: dict[str, Any]) -> tuple[list[Message], list[dict[str, Any]], list[int]]:
    """An episode's opening: `env.reset(row)` -> (messages, tool schemas, prompt ids). The tools
    are declared by the chat format, in the wording of the environment's optional `tool_prompt`
    attribute (a template for chat templates that cannot declare tools; `rollout.tool_prompt`
    overrides it)."""
    messages, tools = env.reset(row)
    tools = list(tools or ())
    return list(messages), tools, renderer.prompt_ids(messages, tools, getattr(env, "tool_prompt", "") or "")


def run_episodes(
    engine: Engine,
    renderer: Renderer,
    make_env: Callable[[], Env],
    rows: list[dict[str, Any]],
    params: SamplingParams,
    max_turns: int,
    max_context: int = 4096,
) -> list[Trajectory]:
    """One episode per row (repeat rows for groups), all advanced in lock-step turns."""
    episodes = []
    for row in rows:
        ep = _Episode(env=make_env(), row=row)
        try:
            ep.prompt_messages, _tools, ep.prompt_ids = open_episode(renderer, ep.env, row)
            ep.ids = list(ep.prompt_ids)
        except Exception:
            ep.error, ep.done = _error_text(), True
        if not ep.done and len(ep.ids) + params.max_new_tokens > max_context:
            ep.done, ep.truncated_context = True, True
            ep.error = (f"the prompt ({len(ep.ids)} tokens) + max_new_tokens ({params.max_new_tokens}) does not fit in "
                        f"max_context ({max_context})")
        episodes.append(ep)

    for turn_index in range(max_turns):
        active = [ep for ep in episodes if not ep.done]
        if not active:
            break
        completions = engine.generate([ep.ids for ep in active], params)
        last_turn = turn_index == max_turns - 1
        for ep, comp in zip(active, completions):
            if comp.error is not None:  # the engine failed this prompt (retried already): the episode ends
                ep.error, ep.done = comp.error, True
                continue
            ep.record_routing(getattr(comp, "routing", None))
            message, parsed = renderer.assistant_message(comp.token_ids)
            ended_with_eos = bool(comp.token_ids) and comp.token_ids[-1] in renderer.eos_token_ids
            malformed = parsed.error is not None
            env_messages: list[Message] = []
            turn_reward = None
            if comp.finish_reason == "length":
                ep.done = True  # cut off mid-turn: nothing sensible to feed back
            elif malformed:
                env_messages = [Message("tool", f"Error: {parsed.error}. {renderer.tool_call_hint}")]
            else:
                try:
                    result = ep.env.step(message)
                    env_messages, ep.done, turn_reward = list(result.messages), result.done, result.reward
                    ep.info.update(result.info)
                except Exception:
                    ep.error, ep.done = _error_text(), True
            if last_turn:
                ep.done = True
            env_ids: list[int] = []
            if not ep.done:
                try:
                    env_ids = renderer.continuation_ids(env_messages, ended_with_eos)
                except Exception:  # the environment answered with something that cannot be rendered
                    ep.error, ep.done, env_messages = _error_text(), True, []
                if len(ep.ids) + len(comp.token_ids) + len(env_ids) + params.max_new_tokens > max_context:
                    ep.done, ep.truncated_context, env_ids = True, True, []
            finish = "length" if comp.finish_reason == "length" else (
                "tool_call" if (message.tool_calls or malformed) else "stop")
            ep.turns.append(
                Turn(
                    message=message,
                    token_ids=comp.token_ids,
                    logprobs=comp.logprobs,
                    finish_reason=finish,
                    env_messages=tuple(env_messages) if env_ids else (),
                    env_ids=tuple(env_ids),
                    malformed_tool_call=malformed,
                    reward=turn_reward,
                )
            )
            ep.ids += list(comp.token_ids) + env_ids
    for ep in episodes:  # release what environments hold (interpreter sessions), however they ended
        close = getattr(ep.env, "close", None)
        if callable(close):
            try:
                close()
            except Exception:
                ep.error = ep.error or _error_text()
    return [ep.trajectory() for ep in episodes]
