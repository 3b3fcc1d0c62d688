"""The agent task: unmodified agent code run behind the gateway, one session per episode.

    actloop train agent.entry=examples/agents/openai_tool_loop.py:run data.path=rows.jsonl
    task = build_run_task(cfg)      # the registry's build_task, with the agent task when agent.entry is set
    trajs = run_agent_episodes(spec, engine, renderer, rows, params)

`run(client, row)` is `async def run(client: openai.AsyncOpenAI, row: dict) -> float | dict | None`.
Each episode gets `openai.AsyncOpenAI(base_url=<its session URL>)` and its row; at most
`spec.concurrency` run at once, each for at most `spec.timeout_s`. What the agent returns: a
number (the reward), a dict with `reward` (its other numeric keys are kept in
`info["agent"]`), or None (reward.funcs score the transcript). An agent that raises, hangs past
the timeout, returns garbage or makes no call at all is recorded as the trajectory's `error`
(failures.jsonl) and masked; the other episodes go on.

The agent task is an ordinary `Task` of the registry whose `rollout` is `AgentRollout`: it
composes with `actloop eval --agent` and `actloop report` like any task. The gateway is started
once per engine (on 127.0.0.1, `agent.port` or a free port) and kept for the run.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import traceback
import weakref
from dataclasses import dataclass
from typing import Any, Callable

from actloop.config import Config, ConfigError
from actloop.gateway.capture import episode_trajectory
from actloop.gateway.chat import ChatFormat
from actloop.gateway.server import Gateway, SamplingPolicy
from actloop.rewards.base import RewardError, load_reward_func
from actloop.rewards.rubric import RewardTerm
from actloop.rollout.engine import SamplingParams
from actloop.rollout.renderer import Renderer
from actloop.tasks.base import LoadedTask, Task
from actloop.tasks.registry import build_task
from actloop.types import Trajectory


@dataclass(frozen=True)
class AgentSpec:
    entry: str
    run: Callable[..., Any]  # async def run(client, row) -> float | dict | None
    concurrency: int
    timeout_s: float
    model_name: str
    port: int
    max_context: int


def load_agent(cfg: Config) -> AgentSpec:
    a = cfg.agent
    try:
        fn = load_reward_func(a.entry)  # the same `file.py:name` / `module:name` resolution
    except RewardError as e:
        raise ConfigError(f"agent.entry: {e}".replace("reward function", "agent")) from None
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"agent.entry `{a.entry}` must be an `async def run(client, row)` function")
    return AgentSpec(a.entry, fn, a.concurrency, a.timeout_s, a.model_name, a.port, a.max_context)


def agent_reward(prompts: list[Any], completions: list[Any], trajectories: list[Trajectory], **_: Any) -> list[Any]:
    """The reward each episode's agent returned (None where it returned none)."""
    return [(t.info.get("agent") or {}).get("reward") for t in trajectories]


def _no_env() -> Any:
    raise ConfigError("the agent task has no Env: its episodes run through the gateway (AgentRollout)")


class AgentRollout:
    """`Task.rollout` of the agent task: the episode runner's signature, agent code inside."""

    def __init__(self, spec: AgentSpec):
        self.spec = spec

    def __call__(self, engine: Any, renderer: Renderer, make_env: Any, rows: list[dict[str, Any]],
                 params: SamplingParams, max_turns: int, *_: Any, **__: Any) -> list[Trajectory]:
        return run_agent_episodes(self.spec, engine, renderer, rows, params)


def agent_task(cfg: Config) -> Task:
    spec = load_agent(cfg)
    return Task(name="agent", env=_no_env, rewards=[RewardTerm("agent", agent_reward, 1.0)],
                success_threshold=cfg.reward.success_threshold, rollout=AgentRollout(spec),
                description=f"agent code {spec.entry} behind the gateway")


def build_run_task(cfg: Config) -> LoadedTask:
    """The registry's `build_task`; with `agent.entry`, the agent task on data.path's rows."""
    if not cfg.agent.entry:
        return build_task(cfg)
    if cfg.data.mix:
        raise ConfigError("agent.entry with data.mix is not supported yet: give the agent its rows in data.path")
    if not cfg.data.path:
        raise ConfigError("agent.entry needs data.path: a JSONL file of rows, each handed to the agent as `row`")
    return build_task(cfg, definition=agent_task(cfg))


_GATEWAYS: "weakref.WeakKeyDictionary[Any, Gateway]" = weakref.WeakKeyDictionary()


def model_context(engine: Any, default: int = 4096) -> int:
    return int(getattr(engine, "context_length", None) or default)


def gateway_for(engine: Any, renderer: Renderer, spec: Any) -> Gateway:
    gw = _GATEWAYS.get(engine)
    if gw is None:
        gw = Gateway(engine, ChatFormat(renderer), (spec.model_name,), spec.max_context or model_context(engine),
                     SamplingPolicy(fixed=True))
        gw.start(port=spec.port)
        _GATEWAYS[engine] = gw
    return gw


def _reward(value: Any) -> tuple[float | None, dict[str, Any]]:
    """The agent's return value -> (reward or None, extra metrics); ValueError for garbage."""
    if value is None:
        return None, {}
    if isinstance(value, dict):
        if "reward" not in value:
            raise ValueError(f"the agent returned a dict without `reward`: {str(value)[:200]}")
        reward, extra = value["reward"], {k: v for k, v in value.items() if k != "reward"}
    else:
        reward, extra = value, {}
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ValueError(f"the agent returned {str(value)[:200]!r}; expected a finite number, a dict with `reward`, "
                         "or None")
    return float(reward), extra


async def _episode(gw: Gateway, spec: Any, row: dict[str, Any], sem: asyncio.Semaphore) -> Trajectory:
    import httpx
    import openai

    async with sem:
        sid, base_url = gw.open_session()
        info: dict[str, Any] = {}
        error = None
        client = openai.AsyncOpenAI(base_url=base_url, api_key="actloop", max_retries=0,
                                    timeout=spec.timeout_s, http_client=httpx.AsyncClient(timeout=spec.timeout_s))
        try:
            value = await asyncio.wait_for(spec.run(client, dict(row)), spec.timeout_s)
            reward, extra = _reward(value)
            info["agent"] = {"reward": reward, **extra}
        except asyncio.TimeoutError:
            error = f"agent timed out after {spec.timeout_s:g} s (agent.timeout_s)"
        except Exception:
            error = "agent raised:\n" + traceback.format_exc(limit=6)
        finally:
            try:
                await client.close()
            except Exception:
                pass
        capture = gw.close_session(sid)
        segments = capture.trajectories(row)
        info["gateway"] = capture.stats()
        if error is None and not segments:
            error = "the agent made no model call through the gateway"
        return episode_trajectory(segments, row, info, error)


def run_agent_episodes(spec: Any, engine: Any, renderer: Renderer, rows: list[dict[str, Any]],
                       params: SamplingParams) -> list[Trajectory]:
    """One agent episode per row (repeat rows for groups), trajectories in row order."""
    gw = gateway_for(engine, renderer, spec)
    gw.sampling = SamplingPolicy(params.temperature, params.top_p, params.max_new_tokens, fixed=True)
    if params.greedy:  # evaluation: greedy decoding whatever the client asks
        gw.sampling.temperature = 0.0

    async def main() -> list[Trajectory]:
        sem = asyncio.Semaphore(spec.concurrency)
        return list(await asyncio.gather(*(_episode(gw, spec, r, sem) for r in rows)))

    return asyncio.run(main())
