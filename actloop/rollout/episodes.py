"""Run multi-turn episodes: each episode sends its next turn to the engine as soon as it is ready.

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

import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from actloop.envs.base import Env
from actloop.rollout.engine import Engine, SamplingParams
from actloop.rollout.renderer import Renderer
from actloop.tasks.base import LoadedTask
from actloop.types import Message, Trajectory, Turn

MAX_EPISODE_THREADS = 256  # episodes in flight at once under the continuous schedule
_TOKENIZER = threading.Lock()  # fast tokenizers may refuse concurrent calls ("Already borrowed")

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


def _start(ep: _Episode, renderer: Renderer, params: SamplingParams, max_context: int) -> None:
    try:
        with _TOKENIZER:
            ep.prompt_messages, _tools, ep.prompt_ids = open_episode(renderer, ep.env, ep.row)
        ep.ids = list(ep.prompt_ids)
    except Exception:
        ep.error, ep.done = _error_text(), True
    if not ep.done and len(ep.ids) + params.max_new_tokens > max_context:
        ep.done, ep.truncated_context = True, True
        ep.error = (f"the prompt ({len(ep.ids)} tokens) + max_new_tokens ({params.max_new_tokens}) does not fit in "
                    f"max_context ({max_context})")


def _advance(ep: _Episode, comp: Any, renderer: Renderer, params: SamplingParams, last_turn: bool,
             max_context: int) -> None:
    """One sampled turn of one episode: parse it, step the environment, append the ids."""
    if getattr(comp, "error", None) is not None:  # the engine failed this prompt (retried already): it ends
        ep.error, ep.done = comp.error, True
        return
    ep.record_routing(getattr(comp, "routing", None))
    with _TOKENIZER:
        message, parsed = renderer.assistant_message(comp.token_ids)
    ended_with_eos = bool(comp.token_ids) and comp.token_ids[-1] in renderer.eos_token_ids
    malformed = parsed.error is not None
    env_messages: list[Message] = []
    turn_reward = None
    if comp.finish_reason == "length":
        ep.done = True  # cut off mid-turn: nothing sensible to feed back
    elif malformed:
        env_messages = [renderer.malformed_call_reply(parsed)]
    else:
        try:
            result = ep.env.step(message)  # a slow tool holds up this episode only (continuous schedule)
            env_messages, ep.done, turn_reward = list(result.messages), result.done, result.reward
            ep.info.update(result.info)
        except Exception:
            ep.error, ep.done = _error_text(), True
    if last_turn:
        ep.done = True
    env_ids: list[int] = []
    if not ep.done:
        try:
            with _TOKENIZER:
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
            versions=tuple(getattr(comp, "versions", ())),
        )
    )
    ep.ids += list(comp.token_ids) + env_ids


def _close(ep: _Episode) -> None:
    """Release what the environment holds (interpreter sessions), however the episode ended."""
    close = getattr(ep.env, "close", None)
    if callable(close):
        try:
            close()
        except Exception:
            ep.error = ep.error or _error_text()


SCHEDULES = ("auto", "continuous", "lockstep")


def run_episodes(
    engine: Engine,
    renderer: Renderer,
    make_env: Callable[[], Env],
    rows: list[dict[str, Any]],
    params: SamplingParams,
    max_turns: int,
    max_context: int = 4096,
    schedule: str = "auto",
) -> list[Trajectory]:
    """One episode per row (repeat rows for groups).

    continuous: every episode runs on its own thread, sending each turn to the engine as a
        request (`engine.submit`) the moment its previous tool call returns; the engine batches
        whatever requests are live, so a slow tool holds up only its own episode.
    lockstep: every active episode's turn goes to the engine as one batch, and the next turn
        starts when every tool of this one has returned (the baseline in benchmarks/).
    auto: continuous when the engine batches continuously (HFEngine, VLLMEngine, VLLMServerEngine),
        else lockstep.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}; got `{schedule}`")
    if schedule == "auto":
        schedule = "continuous" if engine.continuous_batching else "lockstep"
    episodes = [_Episode(env=make_env(), row=row) for row in rows]
    if schedule == "lockstep":
        for ep in episodes:
            _start(ep, renderer, params, max_context)
        for turn_index in range(max_turns):
            active = [ep for ep in episodes if not ep.done]
            if not active:
                break
            completions = engine.generate([ep.ids for ep in active], params)
            for ep, comp in zip(active, completions):
                _advance(ep, comp, renderer, params, turn_index == max_turns - 1, max_context)
    else:
        def episode(ep: _Episode) -> None:
            _start(ep, renderer, params, max_context)
            for turn_index in range(max_turns):
                if ep.done:
                    break
                try:
                    comp = engine.submit(ep.ids, params).result()
                except Exception:  # the engine failed this request: this episode fails
                    ep.error, ep.done = _error_text(), True
                    break
                _advance(ep, comp, renderer, params, turn_index == max_turns - 1, max_context)

        if episodes:
            with ThreadPoolExecutor(max_workers=min(len(episodes), MAX_EPISODE_THREADS),
                                    thread_name_prefix="episode") as pool:
                list(pool.map(episode, episodes))
    for ep in episodes:
        _close(ep)
    return [ep.trajectory() for ep in episodes]


# --------------------------------------------------------------- a task's episodes, in batches


def task_episodes(task: LoadedTask, engine: Engine, renderer: Renderer, rows: list[dict[str, Any]],
                  params: SamplingParams, max_turns: int, max_context: int = 4096,
                  schedule: str = "auto") -> list[Trajectory]:
    """The task's episodes for `rows`, however they run: the task's own runner (the agent task
    behind the gateway), whole episodes on the engine's workers (Ray), or the episode runner here."""
    if task.rollout is not None:
        return task.rollout(engine, renderer, task.make_env, rows, params, max_turns, max_context)
    if engine.runs_episodes:
        return engine.run_episodes(rows, params, max_turns, max_context)
    return run_episodes(engine, renderer, task.make_env, rows, params, max_turns, max_context, schedule=schedule)


def run_batched(task: LoadedTask, engine: Engine, renderer: Renderer, rows: list[dict[str, Any]],
                params: SamplingParams, max_turns: int, max_context: int, max_batch: int = 0,
                schedule: str = "auto") -> list[Trajectory]:
    """`task_episodes` for `rows` (one each, in order), at most `max_batch` at once (0 = all): the
    engine's memory grows with the episodes it runs together (rollout.max_batch)."""
    size = max_batch if max_batch > 0 else max(len(rows), 1)
    out: list[Trajectory] = []
    for start in range(0, len(rows), size):
        out += task_episodes(task, engine, renderer, rows[start : start + size], params, max_turns, max_context,
                             schedule)
    return out
