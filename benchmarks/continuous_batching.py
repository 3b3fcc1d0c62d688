"""Continuous batching vs the lock-step runner: 16 episodes whose tool sleeps 0.5 s.

    python benchmarks/continuous_batching.py [--episodes 16] [--turns 3] [--tool-s 0.5] [--max-new-tokens 32]

Three runs on one HFEngine (the embedded model, its bf16 copy), same rows and budgets:
  lockstep    run_episodes(schedule="lockstep"): every episode's turn in one engine batch, then
              every tool, one after another, before the next turn (the runner before issue 14)
  continuous  run_episodes(schedule="continuous"): each episode sends its next turn when its own
              tool returns; the engine admits it into the live decode batch
  gateway     the same episodes as agent code (openai.AsyncOpenAI, asyncio.sleep tool) through
              the gateway, `agent.concurrency` = episodes

Every assistant turn counts as a tool call here (the tool sleeps, then answers), so each episode
runs all its turns whatever the model writes. Prints wall seconds, generated tokens, tokens/s and
the speed-up over lockstep, as JSON lines. Timings on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from actloop.envs.base import StepResult  # noqa: E402
from actloop.types import Message  # noqa: E402

QUESTION = "Name one fruit. Answer in one or two words."


class SlowToolEnv:
    """Every turn 'calls' a tool that takes `tool_s` seconds; the episode ends after `turns` turns."""

    def __init__(self, tool_s: float, turns: int):
        self.tool_s, self.turns, self.n = tool_s, turns, 0

    def reset(self, row):
        return [Message("user", row["question"])], []

    def step(self, message):
        self.n += 1
        time.sleep(self.tool_s)
        return StepResult([Message("tool", f"tool result {self.n}: ok. Name another one.")], done=self.n >= self.turns)


def make_agent(tool_s: float, turns: int, max_new: int):
    async def run(client, row):
        messages = [{"role": "user", "content": row["question"]}]
        for k in range(turns):
            r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=max_new)
            messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})
            if r.choices[0].finish_reason == "length":  # as the runner: a turn cut off ends the episode
                break
            await asyncio.sleep(tool_s)  # the tool
            messages.append({"role": "tool", "content": f"tool result {k + 1}: ok. Name another one."})
        return 0.0
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tool-s", type=float, default=0.5)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    ap.add_argument("--skip-gateway", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from actloop.gateway.agent import AgentSpec, run_agent_episodes
    from actloop.models import load_models
    from actloop.rollout.engine import HFEngine, SamplingParams
    from actloop.rollout.episodes import run_episodes
    from actloop.rollout.renderer import Renderer

    models = load_models("smollm2-135m-instruct")
    renderer = Renderer(models.tokenizer)
    engine = HFEngine(models.policy, models.tokenizer, renderer.eos_token_ids, renderer.stop_strings)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)
    rows = [{"question": f"{QUESTION} ({i})"} for i in range(args.episodes)]
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))  # warm up the decode thread

    results = {}

    def measure(name, fn):
        engine.sleep()  # empty the prefix cache: every run starts cold
        torch.manual_seed(0)
        tok0, t0 = engine.generated_tokens, time.time()
        trajs = fn()
        wall = time.time() - t0
        toks = engine.generated_tokens - tok0
        rec = {"run": name, "episodes": len(trajs), "turns": sum(len(t.turns) for t in trajs),
               "wall_s": round(wall, 2), "generated_tokens": toks, "tokens_per_s": round(toks / wall, 1),
               "errors": sum(t.error is not None for t in trajs)}
        if name != "lockstep":
            base = results["lockstep"]
            rec["speedup_wall"] = round(base["wall_s"] / wall, 2)
            rec["speedup_tokens_per_s"] = round(rec["tokens_per_s"] / base["tokens_per_s"], 2)
        results[name] = rec
        print(json.dumps(rec), flush=True)

    env = lambda: SlowToolEnv(args.tool_s, args.turns)  # noqa: E731
    for schedule in ("lockstep", "continuous"):
        measure(schedule, lambda: run_episodes(engine, renderer, env, rows, params, args.turns, schedule=schedule))
    if not args.skip_gateway:
        spec = AgentSpec("bench", make_agent(args.tool_s, args.turns, args.max_new_tokens), args.episodes, 600.0,
                         "policy", 0, 0)
        measure("gateway", lambda: run_agent_episodes(spec, engine, renderer, rows, params))
    print(json.dumps({"engine": engine.stats, "threads": args.threads, "episodes": args.episodes,
                      "turns": args.turns, "tool_s": args.tool_s, "max_new_tokens": args.max_new_tokens}))
    engine.close()


if __name__ == "__main__":
    main()
