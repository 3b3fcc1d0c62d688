"""Generation engines. An engine samples continuations of token-id prompts and returns the
sampled ids with their log-probs under the sampling distribution (softmax(logits / T)).
`Engine` is the protocol the loop, the evaluator and the gateway use; `EngineBase` its defaults.

`HFEngine` runs a transformers causal LM with a KV cache, batching continuously: requests
(`submit`, or a `generate` batch) join and leave one live decode batch at token boundaries, with
an LRU prefix cache across requests (see the class). Models with sliding-window layers or MoE
routing capture decode in lock-step batches instead (`_decode`): the longest common prefix
encoded once, each row's suffix left-padded in its block, finished rows leaving the batch.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import functools
import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from actloop.models.attention import layer_masks, mask_dtype, uncropped_cache, uses_layer_masks
from actloop.models.routing import RoutingTrace, install_routing
from actloop.rollout.kv import SlackLayer, with_slack
from actloop.rollout.lean_decode import fuse_projections, lean_forward, lean_supported
from actloop.rollout.small_matmul import use_small_batch_linears

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 96
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    stop: tuple[str, ...] = ()  # extra stop strings of this request (the engine's own always apply)


@dataclass(frozen=True)
class Completion:
    token_ids: tuple[int, ...]  # [T] sampled ids, including the EOS or the stop-string token
    logprobs: tuple[float, ...]  # [T] log-prob of each sampled id under the sampling distribution
    finish_reason: Literal["stop", "length", "stop_string"]
    error: str | None = None  # the request failed (actloop.rollout.isolation): no tokens, the episode ends
    # MoE models: the top-k expert ids of every position the engine ran (prompt, then the sampled
    # tokens fed back), [len(prompt) + T - 1, MoE layers, k] int16; None for dense models
    routing: Any = None
    # [T] the policy version (weight syncs so far) that sampled each token; () where the engine does not
    # count versions. A request that spans an in-flight weight update has two or more (VLLMEngine)
    versions: tuple[int, ...] = ()


class Engine(Protocol):
    """Everything the loop, the evaluator and the gateway use of an engine. `EngineBase` gives
    the no-op defaults; HFEngine, VLLMEngine, VLLMServerEngine and RayEngine derive from it.

    weights           "copy" (own weights, refreshed by sync_weights: the trainer turns the IS
                      correction on) or "live" (samples from the trainer's module)
    generated_tokens  sampled tokens over the engine's life (throughput metrics)
    runs_episodes     True when `run_episodes` runs whole episodes itself (Ray's workers)
    continuous_batching  True when `submit`ted requests join a live decode batch at token
                      boundaries (HFEngine, VLLMEngine; VLLMServerEngine sends each as a request of
                      its own to a server that does); the default `submit` batches what is waiting
    own_thread        True when the engine computes on a thread of its own in this process and
                      `run(fn)` executes fn there (the trainer's update then goes through `run`,
                      so that one OpenMP pool computes); False: `run` calls fn in place
    version           weight syncs so far: the policy version its Completions' `versions` name
    context_length    longest prompt + completion the engine takes (None: not known)
    """

    weights: str
    generated_tokens: int
    runs_episodes: bool
    continuous_batching: bool
    own_thread: bool
    context_length: int | None

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]: ...

    def submit(self, prompt: list[int], params: SamplingParams) -> Future: ...

    def sync_weights(self, model: Any) -> None: ...

    def load_weights(self, weights: Any) -> None: ...

    def sleep(self) -> None: ...

    def lend_weights(self, model: Any) -> dict[int, Any]: ...

    def wake(self) -> None: ...

    def run_episodes(self, rows: list[dict[str, Any]], params: SamplingParams, max_turns: int) -> list[Any]: ...

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> Any: ...

    def run_in_flight(self, fn: Any, *args: Any) -> Any: ...

    def decode_for(self, seconds: float) -> int: ...

    def close(self) -> None: ...


class EngineBase:
    """Defaults of the `Engine` protocol. `submit` (one request, answered through a Future, from
    any thread) batches whatever requests are waiting into one `generate` call per sampling
    setting, on a worker thread; HFEngine replaces it with continuous batching."""

    weights: str = "copy"
    generated_tokens: int = 0
    runs_episodes: bool = False
    continuous_batching: bool = False
    own_thread: bool = False
    decodes_in_flight: bool = False  # decode_for samples inside run_in_flight(fn) (VLLMEngine)
    # samples in another process, which goes on while the trainer updates, every token tagged with the
    # version that sampled it (VLLMServerEngine): rollout.max_staleness > 0 needs no compute thread here
    samples_apart: bool = False
    context_length: int | None = None

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        raise NotImplementedError

    def sync_weights(self, model: Any) -> None:
        raise NotImplementedError

    def load_weights(self, weights: Any) -> None:
        """Every weight of the model as (plain checkpoint name, full tensor) pairs, into the engine's
        copy: the sync of a policy the engine cannot read itself (FSDP shards gathered by the trainer)."""
        raise NotImplementedError(f"{type(self).__name__} cannot load gathered weights")

    def sleep(self) -> None:
        """Free accelerator memory for the update (colocated vLLM); a no-op elsewhere."""

    def lend_weights(self, model: Any) -> dict[int, Any]:
        """`sleep`, handing the update the weight copy's storage where the engine can (HFEngine):
        {id(parameter of model): the copy's bf16 tensor of the same shape}; {} here."""
        self.sleep()
        return {}

    def wake(self) -> None:
        """Undo `sleep`; a no-op elsewhere."""

    def run_episodes(self, rows: list[dict[str, Any]], params: SamplingParams, max_turns: int) -> list[Any]:
        raise NotImplementedError(f"{type(self).__name__} does not run whole episodes (runs_episodes is False)")

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) on the thread that computes with the model: here the caller's. HFEngine
        runs it on its decode thread (see there); the trainer's update goes through this."""
        return fn(*args, **kwargs)

    def run_in_flight(self, fn: Any, *args: Any) -> Any:
        """fn(*args) on the compute thread between two decode steps, the running requests kept in the
        batch (paused while fn runs, then continued): the asynchronous loop's update and in-flight
        weight sync (rollout.max_staleness > 0). Here, and on HFEngine, `run`: fn waits for the
        running requests to finish their turn; VLLMEngine does not wait."""
        return self.run(fn, *args)

    def decode_for(self, seconds: float) -> int:
        """From inside run_in_flight(fn), on the compute thread: decode the running requests (and
        those submitted meanwhile) for up to `seconds`, then return to fn; -> tokens decoded. The
        asynchronous loop's update calls it between micro-batches (rollout.decode_during_update).
        Here, and on HFEngine, whose run_in_flight drains first, nothing runs: 0."""
        return 0

    def close(self) -> None:
        q = self.__dict__.get("_submit_queue")
        if q is not None:
            q.put(None)

    def submit(self, prompt: list[int], params: SamplingParams) -> Future:
        if "_submit_queue" not in self.__dict__:
            self._submit_queue: queue.Queue = queue.Queue()
            threading.Thread(target=self._submit_loop, daemon=True, name="engine-submit").start()
        fut: Future = Future()
        self._submit_queue.put((list(prompt), params, fut))
        return fut

    def _submit_loop(self) -> None:
        while True:
            first = self._submit_queue.get()
            if first is None:
                return
            waiting = [first]
            while True:
                try:
                    waiting.append(self._submit_queue.get_nowait())
                except queue.Empty:
                    break
            if any(w is None for w in waiting):
                waiting = [w for w in waiting if w is not None]
                self._submit_queue.put(None)
            by_params: dict[SamplingParams, list] = {}
            for w in waiting:
                by_params.setdefault(w[1], []).append(w)
            for params, reqs in by_params.items():
                try:
                    outs = self.generate([r[0] for r in reqs], params)
                    for r, c in zip(reqs, outs):
                        r[2].set_result(c)
                except Exception as e:  # every waiting request hears of it; the loop goes on
                    for r in reqs:
                        r[2].set_exception(e)


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """Whether this CPU runs bf16 matmuls natively: oneDNN's own check (AVX-512 on x86, with
    AVX512-BF16 / AMX the fastest; the BF16 extension on Arm). An AVX2-only CPU (AMD Zen 2/3, many
    laptop CPUs) emulates them, up to ~9x slower than fp32 (docs/performance.md)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        return False


def use_bf16(precision: str) -> bool:
    """`train.precision`: fp32, bf16, or auto = bf16 where the hardware computes it natively (a CUDA
    GPU with bf16, a CPU that `cpu_has_fast_bf16`), fp32 elsewhere."""
    if precision == "fp32":
        return False
    if precision == "bf16":
        return True
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return cpu_has_fast_bf16()


def autocast_context(precision: str):
    """bf16 autocast when asked (or `auto` and supported); the fp32 master weights stay."""
    if not use_bf16(precision):
        return contextlib.nullcontext()
    return torch.autocast(device_type="cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16)


def cache_kwarg(model: Any) -> str:
    """The forward() keyword for a KV cache: `cache` in transformers >= 5.2x, else `past_key_values`."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"


def output_cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def common_prefix_len(seqs: list[list[int]]) -> int:
    first, n = seqs[0], min(len(s) for s in seqs)
    for i in range(n):
        t = first[i]
        if any(s[i] != t for s in seqs):
            return i
    return n


def is_peft(model: Any) -> bool:
    return hasattr(model, "get_base_model") and hasattr(model, "peft_config")


def _plain_name(name: str) -> str | None:
    """A peft base model's state name under the plain model's name; None for an adapter matrix."""
    return None if ".lora_" in name else name.replace(".base_layer.", ".")


def merged_weights(model: Any):
    """Yield (name, tensor): the policy's effective weights under plain-model names, one at a time;
    for a peft LoRA model each adapted layer's base weight plus its active adapters' delta
    (`get_delta_weight`), computed when it is reached, so that only one layer's merged fp32 weight
    exists at a time (all of them at once were 424 MB of new tensors per sync for SmolLM2-135M)."""
    if not is_peft(model):
        yield from model.state_dict().items()
        return
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    adapted = {f"{name}.base_layer.weight": mod for name, mod in base.named_modules()
               if isinstance(mod, LoraLayer) and not getattr(mod, "merged", False)}
    for name, t in base.state_dict().items():
        if (plain := _plain_name(name)) is None:  # adapter matrices: folded into their base weight
            continue
        if (mod := adapted.get(name)) is not None:
            for adapter in mod.active_adapters:
                if adapter in mod.lora_A:
                    t = t + mod.get_delta_weight(adapter)
        yield plain, t


def plain_named_parameters(model: Any):
    """Yield (name, parameter) of the policy under plain-model names (those of `merged_weights`); a
    peft model's base weights under their layer's name, its adapter matrices skipped."""
    if not is_peft(model):
        yield from model.named_parameters()
        return
    for name, p in model.get_base_model().named_parameters():
        if (plain := _plain_name(name)) is not None:
            yield plain, p


def sample_next(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (token [B], log-prob [B]) under softmax(logits / T), nucleus-filtered."""
    logits = logits.float()
    if params.greedy:
        return logits.argmax(-1), torch.zeros(logits.shape[0])
    logp = torch.log_softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_lp, order = logp.sort(dim=-1, descending=True)
        keep = sorted_lp.exp().cumsum(-1) - sorted_lp.exp() < params.top_p
        sorted_lp = sorted_lp.masked_fill(~keep, float("-inf"))
        logp = torch.full_like(logp, float("-inf")).scatter(-1, order, sorted_lp)
        logp = torch.log_softmax(logp, dim=-1)
    # inverse-CDF sampling: torch.multinomial is ~50x slower on a 49k-entry vocabulary on CPU
    cdf = logp.exp().cumsum(-1)
    u = torch.rand(logp.shape[0], 1) * cdf[:, -1:]
    token = torch.searchsorted(cdf, u).squeeze(-1).clamp(max=logp.shape[-1] - 1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


class HFEngine(EngineBase):
    """Sampling from a transformers causal LM, with continuous batching.

    weights="copy" keeps the engine's own bf16 (or fp32) copy of the policy, refreshed by
    `sync_weights` after each update — decode is faster without autocast's per-step casts, and
    the engine's log-probs then differ slightly from the trainer's (the mismatch the
    importance-sampling correction measures). A LoRA (peft) policy is copied with its adapter
    merged into plain weights (W + scale * B A), re-merged at each sync, so decode pays neither
    the adapter's extra matmuls nor autocast's casts of the frozen base weights. An fp32 copy of a
    plain policy (`train.precision` fp32, or auto on a CPU without native bf16) would equal the
    trainer's weights: with `share_weights` its modules hold the trainer's own tensors (no second
    copy in memory, `sync_weights` has nothing to copy, `sleep` frees nothing). fp32 copies decode
    through `SmallBatchLinear` (`rollout/small_matmul.py`). A copy of a Llama / Qwen2 / Qwen3 /
    Mistral decoder runs `lean_forward` (`rollout/lean_decode.py`, `lean=False`: transformers').
    weights="live" samples from the trainer's module itself (exactness in tests).

    Continuous batching: one decode thread owns the model. `submit(prompt, params)` queues a
    request from any thread; between two decode steps the thread admits waiting requests (each
    prefilled on its own, reusing the longest cached prefix), and a row that finishes leaves
    the batch at once and answers its Future. Episodes, gateway calls and `generate` all share
    this batch, so a request never waits for another request's turn to end. Rows sit left-padded
    in one KV cache ([pad][prefix][sampled]) with explicit position ids.

    One thread computes: `run(fn)` executes fn on the decode thread, between decode batches (the
    trainer's update and weight sync go there). With two threads running torch's OpenMP regions —
    a decode thread and a trainer thread — libgomp manages more threads than there are cores and
    drops its spin-wait to ~100 spins (`gomp_throttled_spin_count_var`), so every parallel region
    of either thread waits for its workers to wake from a futex. Measured on the 2-core box (8 rows
    x 64 tokens): 6.2-6.9 s for a decode before the trainer thread ran any 2-thread op, 8-16.5 s
    after one (a matmul, an add, an update: docs/performance.md).

    Prefix cache: the KV of every prefilled prompt, and of every finished prompt + completion,
    is kept (least recently used first out, `prefix_cache_tokens` in all), so a group's G
    copies of a prompt, a shared system prompt, and an agent's next call (previous prompt +
    sampled ids + tool result) prefill only what is new; entries hold their common prefixes
    once (`PrefixCache`). It is emptied by `sync_weights` and
    `sleep` (the trainer calls it before every update): entries never outlive the weights.
    """

    def __init__(self, model: Any, tokenizer: Any, eos_token_ids: tuple[int, ...], stop_strings=(),
                 precision: str = "auto", weights: Literal["copy", "live"] = "copy", max_batch: int = 128,
                 prefix_cache_tokens: int = 16384, share_weights: bool = True, threads: int | None = None,
                 lean: bool = True):
        self.tokenizer = tokenizer
        self.threads = threads or torch.get_num_threads()  # the decode thread's torch threads (the creator's by default)
        self.eos_token_ids = tuple(eos_token_ids)
        self.stop_strings = tuple(stop_strings)
        self.precision = precision
        self.max_batch = max_batch
        self.weights = weights
        self.model = model
        # an fp32 copy of a plain (not LoRA) policy would hold exactly the trainer's weights: its modules
        # share the trainer's tensors instead (no second 0.5 GB for the 135M model, nothing to sync)
        self.shared = weights == "copy" and share_weights and not is_peft(model) and not use_bf16(precision)
        if weights == "copy":
            if self.shared:  # own modules (eval mode, small-batch linears) over the same parameters
                memo = {id(t): t for t in (*model.parameters(), *model.buffers())}
                self.model = copy.deepcopy(model, memo).eval()
            else:
                self.model = copy.deepcopy(model).eval()
                if is_peft(self.model):
                    self.model = self.model.merge_and_unload()
                if use_bf16(precision):
                    self.model.to(torch.bfloat16)
                for p in self.model.parameters():
                    p.requires_grad_(False)
            use_small_batch_linears(self.model)  # fp32 / bf16 decode on the CPU: rollout/small_matmul.py
        self.generated_tokens = 0  # over the engine's life, for throughput metrics
        self.version = 0  # weight syncs so far: every token a row samples carries it (run(fn) drains first)
        self.asleep = False  # sleep() released the copy's storage
        self._slept: list[tuple[Any, int]] = []  # (storage, bytes) that sleep() released, for wake()
        self._cache_kw = cache_kwarg(self.model)
        self._layer_masks = uses_layer_masks(self.model)  # sliding-window layers: masks from positions
        self._routing = install_routing(self.model)  # MoE: record each position's experts (routing replay)
        # sliding-window layer masks and MoE routing traces follow the lock-step decode below (`_decode`);
        # other models are batched continuously
        self.continuous_batching = not self._layer_masks and self._routing is None
        # the engine's own copy of a Llama / Qwen2 / Qwen3 / Mistral decoder runs `lean_forward`
        # (rollout/lean_decode.py: the same modules without transformers' per-call machinery)
        why = lean_supported(self.model) if lean and weights == "copy" else "off"
        self.lean = why == ""
        if self.lean and not self.shared:  # the copy's own weights: q/k/v and gate/up stacked (lean_decode.py)
            fuse_projections(self.model)
        if lean and why not in ("", "off"):
            log.info("lean decode forward off for this model (%s): transformers' forward", why)
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        self.stats = {"prefill_tokens": 0, "reused_tokens": 0, "decode_steps": 0, "admitted": 0}
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()

    @property
    def own_thread(self) -> bool:  # the continuous batch's decode thread; lock-step decode runs on the caller's
        return self.continuous_batching

    @property
    def context_length(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    @torch.no_grad()
    def sync_weights(self, model: Any) -> None:
        self.prefix_cache.clear()
        self.version += 1
        if self.weights == "live" or self.shared:  # shared tensors: the new weights are already there
            return
        self.load_weights(merged_weights(model))

    @torch.no_grad()
    def load_weights(self, weights: Any) -> None:
        self.prefix_cache.clear()
        self.wake()
        dst = self.model.state_dict()
        written = set()
        for name, t in weights:
            if name in dst:
                dst[name].copy_(t)
                written.add(name)
        if missing := set(dst) - written:  # a copy that would keep stale weights: say so
            raise RuntimeError(f"sync_weights: the policy has no weights for {sorted(missing)[:5]}")

    def to(self, device: Any) -> "HFEngine":
        """Move the engine's own copy (torchrun: onto the rank's device)."""
        if self.weights == "copy":
            self.model.to(device)
        return self

    def sleep(self) -> None:
        """Before an update: the prefix cache goes (its entries come from the weights about to
        change) and so does the storage of the bf16 copy (270 MB for the 135M model), which the
        update's peak need not hold; `sync_weights` brings it back with the new weights."""
        self.prefix_cache.clear()
        if self.weights == "copy" and not self.shared and not self.asleep:
            storages = {}  # each storage once, with its size: tied weights and fused views share one
            for t in self.model.state_dict().values():
                storages.setdefault(t.untyped_storage().data_ptr(), (t.untyped_storage(), t.untyped_storage().nbytes()))
            for storage, _ in storages.values():
                storage.resize_(0)
            self._slept = list(storages.values())
            self.asleep = True

    def lend_weights(self, model: Any) -> dict[int, torch.Tensor]:
        """`sleep` for an update that computes on bf16 copies of `model`'s weights
        (actloop.train.numerics.mixed_precision.bf16_weights): instead of freeing the bf16 copy's storage,
        hand its tensors to the update to cast the fp32 masters into, {id(parameter of model): the
        copy's tensor of that weight}. The update's bf16 weights then take no new memory and the
        next `sync_weights` no re-allocation (each was 270 MB of fresh pages a step for SmolLM2-135M,
        ~66k page faults). As after `sleep`, the copy's values are undefined until `sync_weights`
        (generation refuses until then). A plain `sleep` and {} for another copy (fp32, shared, live)."""
        dst = self.model.state_dict()
        if self.weights != "copy" or self.shared or self.asleep or any(t.dtype != torch.bfloat16 for t in dst.values()):
            self.sleep()
            return {}
        self.prefix_cache.clear()
        lent = {id(p): dst[name] for name, p in plain_named_parameters(model)
                if name in dst and dst[name].shape == p.shape}
        self.asleep = True  # the storage stays (nothing in _slept to re-allocate)
        return lent

    def wake(self) -> None:
        """Re-allocate a sleeping copy's storage (its values are undefined until `sync_weights`
        copies weights in: that is the caller that wakes it)."""
        if self.asleep:
            for storage, nbytes in self._slept:
                storage.resize_(nbytes)
            self._slept = []
            self.asleep = False

    def _check_awake(self) -> None:
        if self.asleep:
            raise RuntimeError("the engine's weight copy was released by sleep(): sync_weights(model) first")

    def close(self) -> None:
        """Stop the decode thread (its running requests fail with "the engine was closed"); a
        request or `run` after this is refused, not served by a new thread (a retry of a failed
        request would otherwise start one that outlives the run, inside torch at exit)."""
        with self._lock:  # a request put after this is refused (_enqueue): none waits behind the None
            self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)
            self._thread = None
            atexit.unregister(self.close)
        super().close()

    # ------------------------------------------------------------------ requests
    def submit(self, prompt: list[int], params: SamplingParams) -> Future:
        if not self.continuous_batching:
            return super().submit(prompt, params)
        return self._submit([(list(prompt), params)])[0]

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """A batch of prompts, answered in order: admitted together into the continuous batch
        (deterministic under the seed), or decoded in lock-step (`_decode`) where the model needs it."""
        if not prompts:
            return []
        if self.continuous_batching:
            futures = self._submit([(list(p), params) for p in prompts])
            return [f.result() for f in futures]
        out: list[Completion] = []
        for i in range(0, len(prompts), self.max_batch):
            out += self._generate_batch(prompts[i : i + self.max_batch], params)
        return out

    def _submit(self, reqs: list[tuple[list[int], SamplingParams]]) -> list[Future]:
        self._check_awake()
        for p, _ in reqs:
            if not p:
                raise ValueError("an empty prompt: nothing to continue")
        if threading.current_thread() is self._thread:
            raise RuntimeError("generate() from inside engine.run(fn): the decode thread would wait for itself")
        futures = [Future() for _ in reqs]
        self._enqueue([_Request(p, params, f) for (p, params), f in zip(reqs, futures)])
        return futures

    def _enqueue(self, item: Any) -> None:
        """Put item (requests, or a run(fn) call) in the decode thread's queue, starting the thread
        if needed; under the lock that close() takes, so nothing is queued behind its stop."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine was closed")
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, args=(self.threads,), daemon=True,
                                                name="hf-engine-decode")
                self._thread.start()
                # stop the decode thread before the interpreter finalizes: a daemon thread still inside
                # torch at exit aborted `actloop eval` ("terminate called without an active exception")
                atexit.register(self.close)
            self._queue.put(item)

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs) on the decode thread, once no row is decoding (autograd on, the model's
        train/eval mode as the caller left it); returns its result or raises its exception. Lock-step
        engines (`continuous_batching` False) and calls from the decode thread run it in place."""
        if not self.continuous_batching or threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        fut: Future = Future()
        self._enqueue(EngineCall(fn, args, kwargs, fut))
        return fut.result()

    def _forward(self, ids, mask, pos, cache, kpos):
        """kpos [B, columns]: the position of every key column (cache + ids), for sliding layers."""
        if self._layer_masks:  # exact sliding windows over the padded layout, cache not cropped
            cache = cache if cache is not None else uncropped_cache(self.model)
            mask = layer_masks(self.model, pos, kpos, mask, mask_dtype(self.model))
        if self.lean:
            return lean_forward(self.model, ids, mask, pos, cache)
        ctx = autocast_context(self.precision) if self.weights == "live" else contextlib.nullcontext()
        with ctx:
            return self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                              **{self._cache_kw: cache})

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        self._check_awake()
        was_training = self.model.training
        self.model.eval()
        try:
            return self._decode(prompts, params)
        finally:
            self.model.train(was_training)

    def _decode(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        device = next(self.model.parameters()).device
        B = len(prompts)
        P = min(common_prefix_len(prompts), min(len(p) for p in prompts) - 1)
        cache = None
        trace = RoutingTrace(B) if self._routing is not None else None
        if self._routing is not None:
            self._routing.forced = None  # the engine routes on its own (a live engine shares the trainer's modules)
        if P > 0:  # the shared prefix, once
            prefix = torch.tensor([prompts[0][:P]], device=device)
            ppos = torch.arange(P, device=device)[None]
            cache = output_cache(self._forward(prefix, torch.ones_like(prefix), ppos, None, ppos))
            if trace is not None:
                trace.prefix(self._routing.take())
            cache.batch_repeat_interleave(B)
        S = max(len(p) - P for p in prompts)
        ids = torch.zeros((B, S), dtype=torch.long)
        mask = torch.zeros((B, P + S), dtype=torch.long)
        mask[:, :P] = 1
        for i, p in enumerate(prompts):
            suffix = p[P:]
            ids[i, S - len(suffix):] = torch.tensor(suffix)
            mask[i, P + S - len(suffix):] = 1
        pos = (P + mask[:, P:].cumsum(-1) - 1).clamp(min=0)
        ids, mask, pos = ids.to(device), mask.to(device), pos.to(device)
        kpos = torch.cat([torch.arange(P, device=device).expand(B, P), pos], dim=1)  # [B, P + S]
        out = self._forward(ids, mask, pos, cache, kpos)
        if trace is not None:
            trace.block(self._routing.take(), [len(p) - P for p in prompts])
        cache, next_pos = with_slack(output_cache(out)), pos[:, -1] + 1  # decode steps write in place

        rows = list(range(B))  # original index of each live row
        tokens: list[list[int]] = [[] for _ in range(B)]
        logps: list[list[float]] = [[] for _ in range(B)]
        reasons: list[str] = ["length"] * B
        for step in range(params.max_new_tokens):
            tok, lp = sample_next(out.logits[:, -1], params)
            done_now = []
            for j, i in enumerate(rows):
                t = int(tok[j])
                tokens[i].append(t)
                logps[i].append(float(lp[j]))
                if t in self.eos_token_ids:
                    reasons[i] = "stop"
                    done_now.append(j)
                elif (self.stop_strings or params.stop) and self._hit_stop(tokens[i], params.stop):
                    reasons[i] = "stop_string"
                    done_now.append(j)
            if step == params.max_new_tokens - 1 or len(done_now) == len(rows):
                break
            if done_now:
                keep = [j for j in range(len(rows)) if j not in set(done_now)]
                keep_t = torch.tensor(keep, device=device)
                cache.batch_select_indices(keep_t)
                tok, mask, next_pos, kpos = tok[keep_t], mask[keep_t], next_pos[keep_t], kpos[keep_t]
                rows = [rows[j] for j in keep]
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype, device=device)], dim=1)
            kpos = torch.cat([kpos, next_pos[:, None]], dim=1)
            out = self._forward(tok[:, None].to(device), mask, next_pos[:, None], cache, kpos)
            if trace is not None:
                trace.step(self._routing.take(), rows)
            next_pos = next_pos + 1
        self.generated_tokens += sum(len(t) for t in tokens)
        return [Completion(tuple(tokens[i]), tuple(logps[i]), reasons[i], routing=trace.row(i) if trace else None,
                           versions=(self.version,) * len(tokens[i]))
                for i in range(B)]

    # ------------------------------------------------------------------ the continuous decode thread
    def _forward_cb(self, ids, mask, pos, cache):
        return self._forward(ids, mask, pos, cache, None)  # no sliding-window layers here (continuous_batching)

    def _loop(self, threads: int) -> None:
        torch.set_num_threads(threads)  # a new thread starts with the OpenMP default, not the caller's
        batch = _Batch()
        was_training = None
        calls: list[EngineCall] = []  # run(fn) calls waiting for the batch to drain
        with torch.no_grad():
            while True:
                waiting: list[_Request] = []
                try:  # block only when nothing is decoding
                    item = self._queue.get(block=not batch.rows and not calls)
                    while True:
                        if item is None:  # closed: every request and call taken so far hears of it
                            closed = RuntimeError("the engine was closed")
                            self._fail_all(batch, closed)
                            for f in [*(r.future for r in waiting), *(c.future for c in calls)]:
                                if not f.done():
                                    f.set_exception(closed)
                            return
                        if isinstance(item, EngineCall):
                            calls.append(item)
                        else:
                            waiting += item
                        item = self._queue.get_nowait()
                except queue.Empty:
                    pass
                if was_training is None and (waiting or batch.rows):
                    was_training = self.model.training
                    self.model.eval()
                admitted = []
                for req in waiting:
                    try:
                        if (prefilled := self._prefill(req)) is not None:
                            admitted.append(prefilled)
                    except Exception as e:  # this request fails; the others go on
                        if not req.future.done():
                            req.future.set_exception(e)
                try:
                    batch.join(admitted)  # one re-allocation of the batch's KV for all of them
                except Exception as e:
                    for row, _ in admitted:
                        if not row.req.future.done():
                            row.req.future.set_exception(e)
                try:
                    if batch.rows:
                        self._step(batch)
                except Exception as e:  # every live request hears of it; the thread goes on
                    self._fail_all(batch, e)
                    batch = _Batch()
                if not batch.rows and (self._queue.empty() or calls) and was_training is not None:
                    self.model.train(was_training)
                    was_training = None
                if calls and not batch.rows:
                    for c in calls:
                        try:
                            with torch.enable_grad():
                                c.future.set_result(c.fn(*c.args, **c.kwargs))
                        except BaseException as e:  # the caller hears of it; the thread goes on
                            c.future.set_exception(e)
                    calls = []

    def _fail_all(self, batch: "_Batch", e: Exception) -> None:
        for row in batch.rows:
            if not row.req.future.done():
                row.req.future.set_exception(e)
        batch.rows = []

    def _prefill(self, req: _Request) -> "tuple[_Row, Any] | None":
        """Prefill one request (after its longest cached prefix) and sample its first token:
        the row and its KV cache, to join the decode batch; None when that token finished it."""
        device = next(self.model.parameters()).device
        prompt = req.prompt
        n = len(prompt)
        self.stats["admitted"] += 1
        if (held := self.prefix_cache.lookup_whole(prompt)) is not None:  # a prompt prefilled before: no forward
            cache, logits = _cache_from(held[0], n), held[1][None]  # logits [1, V]
            self.stats["reused_tokens"] += n
        else:
            P, cached = self.prefix_cache.lookup(prompt)
            cache = _cache_from(cached, P) if P > 0 else None
            suffix = torch.tensor([prompt[P:]], device=device)
            out = self._forward_cb(suffix, torch.ones((1, n), dtype=torch.long, device=device),
                                   torch.arange(P, n, device=device)[None], cache)
            cache, logits = output_cache(out), out.logits[:, -1]
            self.stats["prefill_tokens"] += n - P
            self.stats["reused_tokens"] += P
            self.prefix_cache.put(prompt, lambda start: _layers_of(cache, 0, start))
            self.prefix_cache.put_logits(prompt, logits[0])
        row = _Row(req, next_pos=n)
        tok, lp = sample_next(logits, req.params)
        reason = self._take(row, int(tok[0]), float(lp[0]))
        if reason is not None:
            self._resolve(row, reason)
            return None
        return row, cache

    def _step(self, batch: "_Batch") -> None:
        """One decode step for every live row; finished rows leave the batch."""
        device = batch.mask.device
        B = len(batch.rows)
        ids = torch.tensor([[r.tokens[-1]] for r in batch.rows], device=device)
        pos = torch.tensor([[r.next_pos] for r in batch.rows], device=device)
        batch.mask = torch.cat([batch.mask, torch.ones((B, 1), dtype=batch.mask.dtype, device=device)], dim=1)
        out = self._forward_cb(ids, batch.mask, pos, batch.cache)
        batch.cache = output_cache(out)
        self.stats["decode_steps"] += 1
        logits = out.logits[:, -1]
        groups: dict[SamplingParams, list[int]] = {}
        for j, r in enumerate(batch.rows):
            r.next_pos += 1
            groups.setdefault(r.req.params, []).append(j)
        done: dict[int, str] = {}
        for params, js in groups.items():
            tok, lp = sample_next(logits[js] if len(js) < B else logits, params)
            for k, j in enumerate(js):
                reason = self._take(batch.rows[j], int(tok[k]), float(lp[k]))
                if reason is not None:
                    done[j] = reason
        if done:
            for j, reason in done.items():  # what the row computed is a prefix the next call may extend
                r = batch.rows[j]
                pad = batch.pad_of(j)
                self.prefix_cache.put(r.req.prompt + r.tokens[:-1],
                                      lambda start: _layers_of(batch.cache, j, pad + start),  # noqa: B023 (called here)
                                      replaces=r.req.prompt)
                self._resolve(r, reason)  # after the cache entry: a caller may sync weights at once
            batch.leave(sorted(done))

    def _resolve(self, row: "_Row", reason: str) -> None:
        self.generated_tokens += len(row.tokens)
        row.req.future.set_result(Completion(tuple(row.tokens), tuple(row.logps), reason,
                                             versions=(self.version,) * len(row.tokens)))

    def _take(self, row: "_Row", t: int, lp: float) -> str | None:
        """Append a sampled token; the finish reason when the row is finished, else None."""
        row.tokens.append(t)
        row.logps.append(lp)
        params = row.req.params
        reason = None
        if t in self.eos_token_ids:
            reason = "stop"
        elif (self.stop_strings or params.stop) and self._hit_stop(row.tokens, params.stop):
            reason = "stop_string"
        elif len(row.tokens) >= params.max_new_tokens:
            reason = "length"
        return reason

    def _hit_stop(self, ids: list[int], extra: tuple[str, ...] = ()) -> bool:
        stops = self.stop_strings + tuple(extra)
        tail = self.tokenizer.decode(ids[-4:], skip_special_tokens=False)
        if not any(s[-1] in tail for s in stops):
            return False
        text = self.tokenizer.decode(ids[-32:], skip_special_tokens=False)
        return any(s in text for s in stops)


# ---------------------------------------------------------------------- continuous batching state


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    future: Future


@dataclass
class EngineCall:  # a run(fn) call waiting for the compute thread (HFEngine, VLLMEngine)
    fn: Any
    args: tuple
    kwargs: dict
    future: Future
    in_flight: bool = False  # run between two decode steps, the running requests kept (VLLMEngine.run_in_flight)


@dataclass
class _Row:
    req: _Request
    next_pos: int  # position id of the next token fed
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)


def _layers_of(cache: Any, row: int, pad: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One row's keys and values per layer ([1, H, S, D] each), left padding dropped: views into one
    [2 x layers, 1, H, S, D] block where every layer has the same shape. One allocation per entry
    instead of 2 x layers small ones (60 of ~170 KB for SmolLM2), freed whole when the entry is
    dropped."""
    keys = [layer.keys[row : row + 1, :, pad:] for layer in cache.layers]
    values = [layer.values[row : row + 1, :, pad:] for layer in cache.layers]
    if len({(t.shape, t.dtype) for t in keys + values}) != 1:  # layers of different shapes: one copy each
        return [(k.clone(), v.clone()) for k, v in zip(keys, values)]
    block = torch.stack(keys + values)
    n = len(keys)
    return [(block[i], block[n + i]) for i in range(n)]


def _cache_from(kv: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> Any:
    from transformers.cache_utils import DynamicCache

    return DynamicCache([(k[:, :, :n], v[:, :, :n]) for k, v in kv])


def _left_pad(t: torch.Tensor, n: int) -> torch.Tensor:
    """[B, H, S, D] -> [B, H, n + S, D] with n zero columns on the left."""
    if n == 0:
        return t
    return torch.cat([t.new_zeros(t.shape[0], t.shape[1], n, t.shape[3]), t], dim=2)


@dataclass
class _Batch:
    """The live decode batch: rows, their left-padded KV cache and attention mask [B, S]."""

    rows: list[_Row] = field(default_factory=list)
    cache: Any = None
    mask: torch.Tensor | None = None

    def pad_of(self, j: int) -> int:
        return int((self.mask[j] == 0).sum())  # only left padding is ever zero

    def join(self, new: list[tuple[_Row, Any]]) -> None:
        """Add prefilled rows (each a cache of batch 1, no padding): every side shorter than the
        longest is left-padded, and each layer is re-allocated once for all of them."""
        if not new:
            return
        device = new[0][1].layers[0].keys.device
        lens = [cache.layers[0].keys.shape[2] for _, cache in new]
        S = self.mask.shape[1] if self.rows else 0
        L = max([S, *lens])
        had_rows = bool(self.rows)
        if not had_rows:  # the first row's cache becomes the batch's (decode steps write in place: rollout/kv.py)
            self.cache = with_slack(new[0][1])
            self.mask = torch.zeros((0, 0), dtype=torch.long, device=device)
        for i, layer in enumerate(self.cache.layers):
            keys = [_left_pad(layer.keys, L - S)] if had_rows else []
            values = [_left_pad(layer.values, L - S)] if had_rows else []
            for (_, cache), s in zip(new, lens):
                keys.append(_left_pad(cache.layers[i].keys, L - s))
                values.append(_left_pad(cache.layers[i].values, L - s))
                if cache is not self.cache:  # each row's layer goes as soon as it is copied
                    cache.layers[i].keys = cache.layers[i].values = None
            layer.keys, layer.values = torch.cat(keys), torch.cat(values)
            del keys, values
        ones = [torch.cat([torch.zeros((1, L - s), dtype=torch.long, device=device),
                           torch.ones((1, s), dtype=torch.long, device=device)], 1) for s in lens]
        pad = torch.zeros((len(self.rows), L - S), dtype=torch.long, device=device)
        self.mask = torch.cat([torch.cat([pad, self.mask], 1), *ones])
        self.rows += [row for row, _ in new]

    def leave(self, done: list[int]) -> None:
        keep = [j for j in range(len(self.rows)) if j not in set(done)]
        self.rows = [self.rows[j] for j in keep]
        if not self.rows:
            self.cache, self.mask = None, None
            return
        idx = torch.tensor(keep, device=self.mask.device)
        self.mask = self.mask[idx]
        first = int((self.mask.sum(0) > 0).nonzero()[0])  # columns only padding: dropped
        self.mask = self.mask[:, first:]
        for layer in self.cache.layers:
            if isinstance(layer, SlackLayer):  # in place, no re-allocation
                layer.keep(keep, first)
            else:
                layer.keys, layer.values = layer.keys[idx, :, first:], layer.values[idx, :, first:]


@dataclass(eq=False)
class _Block:
    """One copy of keys and values ([1, H, n, D] per layer, views into one stacked tensor),
    shared by every prefix-cache entry whose segments point into it; freed with the last one."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    tokens: int
    refs: int = 0


_Segment = tuple[_Block, int, int]  # a block, its first column, the number of columns


class PrefixCache:
    """KV of token sequences already computed, LRU, at most `max_tokens` tokens of stored KV.
    `lookup(prompt)` returns the longest cached prefix of `prompt` (at most len(prompt) - 1
    tokens: the last one is fed to get the next token's logits) and its KV.

    Entries share storage: `put(ids, kv_from)` stores only the columns past the longest prefix
    that `ids` has in common with an entry already held (`kv_from(start)` copies them out of the
    caller's cache); the entry points into the older entry's block for the rest. A group's G
    completions of one prompt hold the prompt's KV once, not G times, and an agent's next call
    (previous prompt + sampled ids + tool result) adds only the tool result. The budget counts
    each block once, while any entry points into it (fp32 KV of SmolLM2-135M: 46 KB a token,
    so the default 16384 tokens are at most 0.75 GB)."""

    MIN_SHARED = 16  # a shorter common prefix is copied (a segment costs a concatenation at lookup)
    MAX_LOGITS = 64  # prompts whose next-token logits are kept (`put_logits`): [V] each, 98 KB in bf16 for 49k

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.entries: dict[tuple[int, ...], list[_Segment]] = {}
        self.logits: dict[tuple[int, ...], torch.Tensor] = {}  # prompt -> logits [V] after its last token, LRU
        self.tokens = 0  # of stored KV, each block once
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self.entries.clear()
            self.logits.clear()
            self.tokens = 0

    def put_logits(self, ids: list[int], logits: torch.Tensor) -> None:
        """Keep the logits [V] that follow `ids`: the next request with exactly this prompt (a GRPO
        group's other G - 1 samples) is prefilled from the cache alone, with no forward."""
        with self._lock:
            self.logits.pop(tuple(ids), None)
            self.logits[tuple(ids)] = logits
            while len(self.logits) > self.MAX_LOGITS:
                self.logits.pop(next(iter(self.logits)))

    def lookup_whole(self, prompt: list[int]) -> tuple[Any, torch.Tensor] | None:
        """(KV of all of `prompt` per layer, the logits [V] after it) when both are held, else None."""
        with self._lock:
            logits = self.logits.get(tuple(prompt))
            if logits is None:
                return None
            self.logits[tuple(prompt)] = self.logits.pop(tuple(prompt))
        P, kv = self.lookup(prompt, whole=True)
        return (kv, logits) if P == len(prompt) else None

    def _longest(self, ids: list[int] | tuple[int, ...], cap: int) -> tuple[int, tuple[int, ...] | None]:
        best, best_key = 0, None
        for key in self.entries:
            if not key or key[0] != ids[0]:
                continue
            n = min(common_prefix_len([key, ids]), cap)
            if n > best:
                best, best_key = n, key
        return best, best_key

    def lookup(self, prompt: list[int], whole: bool = False) -> tuple[int, Any]:
        """(P, [(keys, values)] per layer, [1, H, P, D] each) for the longest cached prefix; (0, None) if none.
        P < len(prompt) unless `whole`: the last token is fed to get the next token's logits."""
        with self._lock:
            best, key = self._longest(prompt, len(prompt) - (0 if whole else 1))
            if key is None:
                return 0, None
            self.entries[key] = self.entries.pop(key)  # most recently used last
            segs = _cut(self.entries[key], best)
        parts = [[(b.kv[i][0][:, :, c : c + n], b.kv[i][1][:, :, c : c + n]) for b, c, n in segs]
                 for i in range(len(segs[0][0].kv))]
        if len(segs) == 1:
            return best, [layer[0] for layer in parts]
        return best, [(torch.cat([k for k, _ in layer], 2), torch.cat([v for _, v in layer], 2)) for layer in parts]

    def put(self, ids: list[int], kv_from: Any, replaces: list[int] | None = None) -> None:
        """Keep `ids`' KV. kv_from(start) -> [(keys, values)] per layer of ids[start:] ([1, H, n, D]),
        called only for what no entry holds. `replaces` names an entry it extends (dropped: every
        lookup that entry served, this one serves as well)."""
        key = tuple(ids)
        if self.max_tokens <= 0 or len(key) > self.max_tokens or not key:
            return
        with self._lock:
            if key in self.entries:  # the same ids under the same weights: the same KV
                self.entries[key] = self.entries.pop(key)
                if replaces is not None and tuple(replaces) in self.entries and tuple(replaces) != key:
                    self._drop(tuple(replaces))
                return
            n, other = self._longest(key, len(key))
            if n < min(self.MIN_SHARED, len(key)):
                n, other = 0, None
            segs = _cut(self.entries[other], n) if other is not None else []
            if n < len(key):
                block = _Block(kv_from(n), len(key) - n)
                segs.append((block, 0, block.tokens))
                self.tokens += block.tokens
            for b in {id(b): b for b, _, _ in segs}.values():
                b.refs += 1
            self.entries[key] = segs
            if replaces is not None and tuple(replaces) in self.entries and tuple(replaces) != key:
                self._drop(tuple(replaces))
            while self.tokens > self.max_tokens and self.entries:
                self._drop(next(iter(self.entries)))

    def _drop(self, key: tuple[int, ...]) -> None:
        for b in {id(b): b for b, _, _ in self.entries.pop(key)}.values():
            b.refs -= 1
            if b.refs == 0:
                self.tokens -= b.tokens


def _cut(segs: list[_Segment], n: int) -> list[_Segment]:
    """The segments covering the first n columns."""
    out, have = [], 0
    for b, c, m in segs:
        if have >= n:
            break
        take = min(m, n - have)
        out.append((b, c, take))
        have += take
    return out
