"""A `verifiers` (v1) environment — a taskset whose task is scored by a `@vf.reward` — run through the gateway.

    actloop train agent.entry=examples/agents/verifiers_env.py:run data.path=examples/agents/rows.jsonl

verifiers runs the episode itself: its `Env` plays the task, every model call goes through its
interception server (which records the trace) to the OpenAI endpoint it is given, and the task's
own reward scores the trace; actloop captures the calls token by token and trains on that reward.

verifiers >= 0.4 (`verifiers.v1`; the `ToolEnv`/`Rubric` API of 0.3 is gone) runs a harness
program in a runtime. Its built-in chat harnesses are scripts that `uv` provisions; this harness
runs its tool loop in-process instead, which the `Harness.launch` contract allows as long as every
model call goes through the interception endpoint, and the runtime is a local subprocess one.
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import verifiers.v1 as vf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from openai_tool_loop import MODEL, TOOLS, calculator, score  # noqa: E402

SYSTEM = ("Use the calculator tool for arithmetic: write "
          '<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}'
          "</tool_call>. Then reply: The answer is N.")
# verifiers loads tasksets and harnesses by id, importing the module of that name (registered below)
ID = "actloop_verifiers_calculator"
KEY_VAR = "ACTLOOP_VERIFIERS_GATEWAY_KEY"  # verifiers reads the endpoint's key from an env var


class CalculatorData(vf.TaskData):
    answer: float


class CalculatorTask(vf.Task[CalculatorData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        """The last reply's last number against the answer."""
        return score(trace.last_reply or "", self.data.answer)


class CalculatorTaskset(vf.Taskset[CalculatorTask, vf.TasksetConfig]):
    def load(self) -> list[CalculatorTask]:
        return []  # the rows come from actloop (data.path), one task per episode


class CalculatorHarness(vf.Harness[vf.HarnessConfig]):
    """A tool loop with a calculator, at most 3 model calls, each through the interception."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_) -> vf.ProgramResult:
        import openai

        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        messages += [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt or [])
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            for _ in range(3):
                resp = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS)
                msg = resp.choices[0].message
                messages.append(msg.model_dump(exclude_none=True))
                if not msg.tool_calls:
                    break
                for call in msg.tool_calls:
                    try:
                        result = calculator(json.loads(call.function.arguments).get("expression", ""))
                    except Exception as e:
                        result = f"error: {e}"
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


# the module verifiers imports for the id: it exports the taskset and its default harness
_plugin = types.ModuleType(ID)
_plugin.CalculatorTaskset, _plugin.CalculatorHarness = CalculatorTaskset, CalculatorHarness
_plugin.__all__ = ["CalculatorTaskset", "CalculatorHarness"]
sys.modules[ID] = _plugin


async def run(client, row: dict) -> dict:
    os.environ[KEY_VAR] = client.api_key
    # one Env per episode: its serving resources (the interception server) live in this event loop
    env = vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset={"id": ID}, agent={"runtime": {"type": "subprocess"}}))
    task = CalculatorTask(CalculatorData(prompt=row["question"], system_prompt=SYSTEM, answer=float(row["answer"])))
    ctx = vf.ModelContext(model=MODEL, client=vf.EvalClientConfig(base_url=str(client.base_url), api_key_var=KEY_VAR),
                          sampling=vf.SamplingConfig(max_tokens=48))
    async with env.serving():
        episode = await env.run_episode(task, ctx)
    errors = [e for t in episode.traces for e in t.errors] + list(episode.errors)
    if errors or not episode.traces:
        raise RuntimeError(f"verifiers episode failed: {errors[-1].message if errors else 'no trace'}")
    trace = episode.traces[0]
    return {"reward": float(trace.reward), **{k: float(v) for k, v in trace.metrics.items() if v is not None}}
