"""Rollouts on Ray actors (`rollout.engine=ray`): `RolloutWorker` actors each hold an engine (their
own vLLM engine, or a copy of the policy and an HF engine: `ray.worker_engine`), a renderer and
the task's environment factory; `RayEngine` is the
driver-side object, an `Engine` like the others, so the training loop is the same loop.

    driver (trainer, envs, rewards)                 Ray actors (any node)
    run_episodes ── generate(prompts) ──shard──►  RolloutWorker.generate ─► VLLMEngine or HFEngine
                 ◄─ completions, in order ◄─────
    update ──── sync_weights: ray.put(state dict) once ──► every RolloutWorker.load_weights

`RayEngine.run_episodes` runs whole episodes (environments included) on the workers instead, a
shard of rows each — for environments worth spreading across nodes.

The workers sample from their own copies of the weights (`weights = "copy"`), so the trainer's IS
correction is on by default, as for HFEngine's bf16 copy. Each actor uses
max(1, int(ray.cpus_per_worker)) torch threads. The single-process `hf` engine stays the
default; under Ray a `breakpoint()` inside an actor needs `ray debug`.

A rollout actor that dies (killed, its node lost, out of memory) is replaced: `RayEngine` starts a
new actor in its place, loads it with the last synced weights and runs its shard again, once. A
shard that fails again raises from `generate` (which `IsolatedEngine` retries, then records per
trajectory) and, in `run_episodes`, comes back as trajectories with `error` set (masked, kind
`engine` in failures.jsonl); the other shards' results are kept either way.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import torch

import actloop.rewards.code as code_rewards
from actloop.config import Config, RayConfig
from actloop.models import load_models, load_tokenizer, resolve_model
from actloop.rollout.engine import Completion, EngineBase, HFEngine, SamplingParams
from actloop.rollout.episodes import run_episodes
from actloop.rollout.isolation import describe
from actloop.rollout.renderer import Renderer
from actloop.rollout.vllm_engine import VLLMEngine  # imports vLLM only when built
from actloop.sandbox.ray_pool import RaySandbox, ray_module
from actloop.tasks import build_task
from actloop.types import Trajectory


def shard_bounds(n: int, k: int) -> list[tuple[int, int]]:
    """Split range(n) into k contiguous [start, end) shards whose sizes differ by at most one
    (the first n % k are one longer). Contiguous keeps a prompt's group — and its shared prefix
    — on one worker."""
    if k < 1:
        raise ValueError("need at least one shard")
    base, extra = divmod(n, k)
    out, start = [], 0
    for i in range(k):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def init_ray(rc: RayConfig) -> bool:
    """Connect to (or start) Ray as `ray.address` says; a session already started is reused.
    Returns True when this call started it."""
    ray = ray_module()
    if ray.is_initialized():
        return False
    if rc.address == "local":
        need = rc.num_rollout_workers * rc.cpus_per_worker + rc.num_sandbox_workers * rc.cpus_per_sandbox
        ray.init(num_cpus=max(1, math.ceil(need)), include_dashboard=False)
    else:  # a cluster: ship this package to the workers
        ray.init(address=rc.address, runtime_env={"py_modules": [str(Path(__file__).resolve().parents[1])]})
    return True


class RolloutWorker:
    """One rollout actor's state (wrapped with `ray.remote` by `RayEngine`; plain Python here).

    `engine="hf"`: a copy of the policy and an HFEngine. `engine="vllm"`: a VLLMEngine of its own
    (in this actor's process, its engine core in-process); the actor holds no policy of its own for
    full weights (the broadcast state dict goes straight into vLLM's in-place reload), only the
    peft model whose adapter it saves with LoRA."""

    def __init__(self, cfg: Config, index: int, threads: int = 1, device: str = "cpu", engine: str = "hf"):
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
        torch.manual_seed(cfg.seed + 1000 * (index + 1))  # workers must not draw the same samples
        self.cfg, self.kind = cfg, engine
        self.models = None
        if engine == "hf" or cfg.lora.enabled:
            self.models = load_models(cfg.model, lora=cfg.lora, need_reference=False)
            self.models.policy.to(device)
        tokenizer = self.models.tokenizer if self.models else load_tokenizer(resolve_model(cfg.model))
        self.renderer = Renderer.from_config(tokenizer, cfg)
        if engine == "vllm":
            # a seed per actor (vLLM's sampling draws from it), adapters in a folder per actor
            cfg = dataclasses.replace(cfg, seed=cfg.seed + 1000 * (index + 1))
            self.engine = VLLMEngine.from_config(cfg, self.renderer, lora=cfg.lora.enabled, threads=threads,
                                                 adapter_dir=_adapter_dir(cfg, index))
        else:
            self.engine = HFEngine(self.models.policy, tokenizer, self.renderer.eos_token_ids,
                                   self.renderer.stop_strings, precision=cfg.train.precision,
                                   weights="copy")  # LoRA: merged into the bf16 copy at each sync
        self._task = None

    def ready(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "threads": torch.get_num_threads()}

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return self.engine.generate(prompts, params)

    def load_weights(self, state: dict[str, Any]) -> int:
        """Load the broadcast state dict (the whole model, or a LoRA adapter's tensors) into the
        policy, then refresh the engine's copy (vLLM, full weights: straight into its in-place
        reload). Returns how many tensors were loaded."""
        if self.models is None:
            self.engine.load_weights(state.items())
            return len(state)
        missing, unexpected = self.models.policy.load_state_dict(state, strict=False)
        if unexpected:
            raise ValueError(f"weights the worker's model does not have: {unexpected[:5]}")
        if missing and not self.models.lora:
            raise ValueError(f"weights missing from the broadcast: {missing[:5]}")
        self.engine.sync_weights(self.models.policy)
        return len(state)

    def run_episodes(self, rows: list[dict[str, Any]], params: SamplingParams, max_turns: int,
                     max_context: int = 4096) -> list[Trajectory]:
        if self._task is None:
            self._task = build_task(self.cfg)
        return (self._task.rollout or run_episodes)(self.engine, self.renderer, self._task.make_env, rows, params, max_turns, max_context)

    def generated_tokens(self) -> int:
        return self.engine.generated_tokens


class RayEngine(EngineBase):
    """The driver's handle on the rollout actors: the `Engine` interface, sharded."""

    weights = "copy"
    runs_episodes = True  # whole episodes, environment steps too, run on the workers

    def __init__(self, workers: list[Any], lora: bool = False, sandbox: Any = None, spawn: Any = None):
        if not workers:
            raise ValueError("RayEngine needs at least one worker")
        self.workers, self.lora, self.sandbox = workers, lora, sandbox
        self.spawn = spawn  # index -> a new actor handle (replaces a dead one); None: no replacement
        self.generated_tokens = 0
        self.replaced_workers = 0
        self._weights = None  # the object ref of the last sync, loaded into replacement actors

    @classmethod
    def from_config(cls, cfg: Config, engine: str = "hf") -> RayEngine:
        """`engine`: what each actor samples with, `hf` or `vllm` (the factory resolves `ray.worker_engine`)."""
        ray = ray_module()
        rc = cfg.ray
        init_ray(rc)
        threads = max(1, int(rc.cpus_per_worker))
        device = "cuda" if rc.gpus_per_worker > 0 else "cpu"
        actor = ray.remote(RolloutWorker).options(num_cpus=rc.cpus_per_worker, num_gpus=rc.gpus_per_worker)
        def spawn(i: int) -> Any:
            return actor.remote(cfg, i, threads, device, engine)

        workers = [spawn(i) for i in range(rc.num_rollout_workers)]
        ray.get([w.ready.remote() for w in workers])  # fail here, not in the first step
        sandbox = None
        if rc.num_sandbox_workers:
            sandbox = RaySandbox(rc.num_sandbox_workers, cpus_per_worker=rc.cpus_per_sandbox)
            use_as_default(sandbox)
        return cls(workers, lora=bool(cfg.lora.enabled), sandbox=sandbox, spawn=spawn)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        parts = self._sharded(len(prompts), lambda w, a, b: w.generate.remote(prompts[a:b], params))
        for part in parts:
            if isinstance(part, Exception):
                raise part  # IsolatedEngine retries the batch, then records its prompts as failed
        out = [c for part in parts for c in part]
        self.generated_tokens += sum(len(c.token_ids) for c in out)
        return out

    def run_episodes(self, rows: list[dict[str, Any]], params: SamplingParams, max_turns: int,
                     max_context: int = 4096) -> list[Trajectory]:
        """Whole episodes on the workers, a contiguous shard of rows each; trajectories in row
        order. A shard whose actor failed twice comes back as failed trajectories."""
        bounds = [(a, b) for a, b in shard_bounds(len(rows), len(self.workers)) if b > a]
        parts = self._sharded(len(rows), lambda w, a, b: w.run_episodes.remote(rows[a:b], params, max_turns,
                                                                                max_context))
        out = []
        for (a, b), part in zip(bounds, parts):
            if isinstance(part, Exception):
                part = [Trajectory(prompt_messages=(), prompt_ids=(), turns=(), row=r, info={}, error=describe(part))
                        for r in rows[a:b]]
            out += part
        self.generated_tokens += sum(t.num_response_tokens for t in out)
        return out

    def _sharded(self, n: int, call: Any) -> list[Any]:
        """`call(worker, start, end)` on each worker's shard; each result in shard order, or the
        exception of a shard that failed (an actor that died is replaced and its shard run again)."""
        ray = ray_module()
        bounds = [(i, a, b) for i, (a, b) in enumerate(shard_bounds(n, len(self.workers))) if b > a]
        refs = [call(self.workers[i], a, b) for i, a, b in bounds]
        out: list[Any] = []
        for (i, a, b), ref in zip(bounds, refs):
            try:
                out.append(ray.get(ref))
            except Exception as e:  # noqa: BLE001 - one shard's failure is that shard's
                if not _actor_died(e) or self.spawn is None:
                    out.append(e)
                    continue
                try:
                    self._replace(i)
                    out.append(ray.get(call(self.workers[i], a, b)))
                except Exception as again:  # noqa: BLE001
                    out.append(again)
        return out

    def _replace(self, i: int) -> None:
        """A new actor in place of the dead worker `i`, with the last synced weights."""
        ray = ray_module()
        try:
            ray.kill(self.workers[i])
        except Exception:  # noqa: BLE001 - it is dead already
            pass
        self.workers[i] = self.spawn(i)
        ray.get(self.workers[i].ready.remote())
        if self._weights is not None:
            ray.get(self.workers[i].load_weights.remote(self._weights))
        self.replaced_workers += 1

    def sync_weights(self, model: Any) -> None:
        """One `ray.put` of the (CPU) state dict — only the adapter's tensors with LoRA — then
        every worker loads it from the object store."""
        ray = ray_module()
        state = {k: v.detach().cpu() for k, v in model.state_dict().items() if not self.lora or "lora_" in k}
        ref = self._weights = ray.put(state)
        refs = [w.load_weights.remote(ref) for w in self.workers]
        for i, r in enumerate(refs):
            try:
                ray.get(r)
            except Exception as e:  # a dead actor is replaced (with these weights); other errors stop here
                if not _actor_died(e) or self.spawn is None:
                    raise
                self._replace(i)

    def close(self) -> None:
        ray = ray_module()
        for w in self.workers:
            ray.kill(w)
        self.workers = []
        if self.sandbox is not None:
            if code_rewards._DEFAULT_SANDBOX is self.sandbox:  # graders go back to a local sandbox
                code_rewards._DEFAULT_SANDBOX = None
            self.sandbox.close()
            self.sandbox = None


def _adapter_dir(cfg: Config, index: int) -> Path:
    """Where rollout actor `index` saves its LoRA adapters for its vLLM engine (one folder each: the
    actors of one machine must not overwrite each other's versions)."""
    return Path(cfg.rollout.vllm_adapter_dir or Path(cfg.output_dir) / "vllm-adapters") / f"ray-worker-{index}"


def use_as_default(sandbox) -> None:
    """Make `sandbox` the process-wide grading sandbox (what `actloop.rewards.code.default_sandbox`
    returns), so the code tasks' graders and environments run their programs on it."""
    code_rewards._DEFAULT_SANDBOX = sandbox


def _actor_died(exc: BaseException) -> bool:
    """RayActorError and its kin (ActorDiedError, ActorUnavailableError): the actor is gone. So is
    an actor whose call failed with OutOfMemoryError: Ray's memory monitor killed its process."""
    return any(c.__name__ in ("RayActorError", "ActorDiedError", "ActorUnavailableError", "OutOfMemoryError")
               for c in type(exc).__mro__)
