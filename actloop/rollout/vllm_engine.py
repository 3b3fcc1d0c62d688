"""vLLM engines for GPUs: `VLLMEngine` (colocated with the trainer, in this process) and
`VLLMServerEngine` (a `vllm serve` process started separately, spoken to over HTTP).

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
- server, LoRA: the adapter is saved where the server can read it and loaded with POST
  /v1/load_lora_adapter (needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True on the server); the
  previous version is unloaded.

The pure pieces (sampling-parameter translation, log-prob extraction, weight names, request
bodies and response parsing) are plain functions, tested without a GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from actloop.rollout.engine import Completion, EngineBase, SamplingParams

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


def completion_from_vllm(output: Any, greedy: bool = False) -> Completion:
    """One `vllm.CompletionOutput` -> Completion. `output.logprobs` holds, per position, a
    mapping token id -> Logprob (or a float); the sampled token's entry is the one we keep."""
    ids = tuple(int(t) for t in output.token_ids)
    if greedy:
        lps = (0.0,) * len(ids)  # as HFEngine: a greedy choice is certain under its own rule
    else:
        if output.logprobs is None:
            raise ValueError("vLLM returned no log-probs: the request must set logprobs=0")
        if len(output.logprobs) != len(ids):
            raise ValueError(f"vLLM returned {len(output.logprobs)} log-probs for {len(ids)} tokens")
        lps = tuple(_logprob_of(output.logprobs[i], t) for i, t in enumerate(ids))
    return Completion(ids, lps, finish_reason(output.finish_reason, getattr(output, "stop_reason", None)))


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
    for name, t in model.state_dict().items():
        t = t.detach()
        yield vllm_weight_name(name), (t.to(dtype) if dtype is not None else t)


def save_adapter(model: Any, root: str | Path, version: int, keep: int = 2) -> Path:
    """Save the LoRA adapter as <root>/v<version> (adapter_config.json + weights) and delete
    all but the newest `keep` versions."""
    root = Path(root)
    out = root / f"v{version}"
    model.save_pretrained(out)
    for old in sorted((p for p in root.glob("v*") if p.name[1:].isdigit()), key=lambda p: int(p.name[1:]))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return out


# --- colocated -----------------------------------------------------------------------------


class VLLMEngine(EngineBase):
    """vLLM colocated with the trainer on one GPU (`rollout.engine=vllm`)."""

    weights = "copy"

    def __init__(self, model_path: str, eos_token_ids: Iterable[int], stop_strings: Iterable[str] = (), *,
                 gpu_memory_utilization: float = 0.3, sleep: bool = True, max_model_len: int = 4096,
                 lora_rank: int | None = None, adapter_dir: str | Path | None = None, dtype: str = "bfloat16",
                 seed: int = 0, llm: Any = None):
        self.eos_token_ids = tuple(eos_token_ids)
        self.stop_strings = tuple(stop_strings)
        self.lora = lora_rank is not None
        self.sleep_enabled = sleep
        self.dtype = dtype
        self.seed = seed
        self.adapter_dir = Path(adapter_dir or "vllm-adapters")
        self.version = 0
        self.generated_tokens = 0
        self._lora_request = None
        self._asleep = False
        self._weights_lost = False  # after a level-2 sleep, until the next sync
        if llm is None:
            # the engine core in this process: the weight sync hands it tensors, not copies
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            from vllm import LLM

            kwargs: dict[str, Any] = dict(model=model_path, gpu_memory_utilization=gpu_memory_utilization,
                                          enable_sleep_mode=sleep, max_model_len=max_model_len, dtype=dtype,
                                          seed=seed, logprobs_mode="processed_logprobs")
            if self.lora:
                kwargs.update(enable_lora=True, max_lora_rank=vllm_max_lora_rank(lora_rank), max_loras=1)
            llm = LLM(**kwargs)
        self.llm = llm

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        if self._weights_lost:
            raise RuntimeError("vLLM slept at level 2 (weights freed): call sync_weights before generating")
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        self.wake()
        sp = VSamplingParams(**vllm_sampling_kwargs(params, self.eos_token_ids, self.stop_strings))
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp,
                                 lora_request=self._lora_request, use_tqdm=False)
        comps = [completion_from_vllm(o.outputs[0], params.greedy) for o in outs]
        self.generated_tokens += sum(len(c.token_ids) for c in comps)
        return comps

    def sleep(self) -> None:
        """Free vLLM's GPU memory for the update: level 2 (weights too, they are re-sent by
        sync_weights) for full fine-tuning, level 1 (weights offloaded to CPU) with LoRA."""
        if not self.sleep_enabled or self._asleep:
            return
        level = 1 if self.lora else 2
        self.llm.sleep(level=level)
        self._asleep, self._weights_lost = True, level == 2

    def wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def sync_weights(self, model: Any) -> None:
        self.version += 1
        if self.lora:
            from vllm.lora.request import LoRARequest

            path = save_adapter(model, self.adapter_dir, self.version)
            self._lora_request = LoRARequest(f"actloop-v{self.version}", self.version, str(path))
            return
        import torch

        if getattr(self.llm.llm_engine, "model_executor", None) is None:
            raise RuntimeError("cannot reach vLLM's worker in this process: colocated sync needs "
                               "VLLM_ENABLE_V1_MULTIPROCESSING=0 and a single-GPU engine (tensor_parallel_size=1)")
        if self._asleep:
            self.llm.wake_up(tags=["weights"])  # weights first: the KV cache is not needed to load
        # in-process, collective_rpc calls the function on the worker object itself (no pickling)
        self.llm.collective_rpc(load_into_worker, args=(full_weights(model, getattr(torch, self.dtype)),))
        self._weights_lost = False
        if self._asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights


def load_into_worker(worker: Any, weights: Iterable[tuple[str, Any]]) -> None:
    """Run on vLLM's worker (through `LLM.collective_rpc`): load checkpoint-format weights in
    place. The worker's `reload_weights(weights_iterator=...)` (0.33; older ones only re-read
    the checkpoint from disk) wraps `load_weights` in the layerwise reload, which re-runs each
    layer's post-load processing and resets LoRA/encoder state; else the model's `load_weights`."""
    import inspect

    runner = worker.model_runner
    reload = getattr(runner, "reload_weights", None)
    if reload is not None and "weights_iterator" in inspect.signature(reload).parameters:
        worker.reload_weights(weights_iterator=weights)
    else:
        runner.model.load_weights(weights)


# --- server --------------------------------------------------------------------------------


def completions_request(model: str, prompts: list[list[int]], params: SamplingParams, eos_token_ids: Iterable[int],
                        stop_strings: Iterable[str], seed: int | None = None) -> dict[str, Any]:
    """The body of one batched POST /v1/completions: prompts as token-id lists, the sampled
    tokens returned as `token_id:<id>` strings (and as ids where the server supports it)."""
    kw = vllm_sampling_kwargs(params, eos_token_ids, stop_strings, seed)
    kw["logprobs"] = 1  # OpenAI's field: 0 is falsy on some servers; vLLM always adds the sampled token
    if kw["seed"] is None:
        del kw["seed"]
    return {"model": model, "prompt": [list(map(int, p)) for p in prompts], "echo": False,
            "return_tokens_as_token_ids": True, "return_token_ids": True, **kw}


def parse_completions(response: dict[str, Any], n: int, greedy: bool = False) -> list[Completion]:
    """/v1/completions response -> one Completion per prompt, in prompt order (choices carry
    their prompt's `index`)."""
    choices = sorted(response.get("choices", []), key=lambda c: c["index"])
    if [c["index"] for c in choices] != list(range(n)):
        raise ValueError(f"server returned choices {[c['index'] for c in choices]} for {n} prompts")
    out = []
    for c in choices:
        lp = c.get("logprobs") or {}
        tokens = lp.get("tokens")
        if c.get("token_ids") is not None:
            ids = tuple(int(t) for t in c["token_ids"])
        elif tokens is not None:
            ids = tuple(_token_id(t) for t in tokens)
        else:
            raise ValueError("server returned neither token_ids nor logprobs.tokens: start it with a vLLM that "
                             "supports return_tokens_as_token_ids")
        if greedy:
            lps = (0.0,) * len(ids)
        else:
            values = lp.get("token_logprobs")
            if values is None or len(values) != len(ids):
                raise ValueError(f"server returned {None if values is None else len(values)} log-probs for {len(ids)} tokens")
            lps = tuple(float(v) for v in values)
        out.append(Completion(ids, lps, finish_reason(c.get("finish_reason"), c.get("stop_reason"))))
    return out


def _token_id(token: str) -> int:
    if not token.startswith("token_id:"):
        raise ValueError(f"token {token!r} is not `token_id:<id>`: the server ignored return_tokens_as_token_ids")
    return int(token[len("token_id:"):])


def weight_update_info(weights: list[tuple[str, Any]]) -> dict[str, Any]:
    """The `update_info` of POST /update_weights for the NCCL backend: what the server must
    allocate, in the order the trainer broadcasts."""
    return {  # no `packed` key: 0.33 moved it to init_info and rejects it here; unpacked is the default in both
        "names": [n for n, _ in weights],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in weights],
        "shapes": [list(t.shape) for _, t in weights],
    }


def nccl_broadcaster(master_address: str, master_port: int, world_size: int) -> Callable[[Any], None]:
    """The trainer's end of the NCCL group (rank 0): returns `send(tensor)`, a broadcast."""
    import torch
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    pg = StatelessProcessGroup.create(host=master_address, port=master_port, rank=0, world_size=world_size)
    comm = PyNcclCommunicator(pg, device=torch.cuda.current_device())

    def send(t: Any) -> None:
        comm.broadcast(t.cuda().contiguous(), src=0, stream=torch.cuda.current_stream())

    return send


def rendezvous_address(server_url: str) -> str:
    """Where the server's workers reach the trainer's NCCL rendezvous: loopback when the server
    runs on this machine, else this host's address."""
    import socket
    from urllib.parse import urlparse

    host = urlparse(server_url).hostname
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    try:  # the address of the interface that routes to the server (a UDP connect sends nothing)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class HTTPError(RuntimeError):
    """The vLLM server answered with an error status (its body is in the message)."""

    def __init__(self, status: int, path: str, body: str):
        super().__init__(f"vLLM server: {path} -> HTTP {status}: {body[:500]}")
        self.status = status


class VLLMServerEngine(EngineBase):
    """A separately started `vllm serve` (`rollout.engine=vllm-server`). Launch it with
    `--logprobs-mode processed_logprobs` (log-probs under the sampling temperature) and, for
    full-weight sync, VLLM_SERVER_DEV_MODE=1 and `--weight-transfer-config '{"backend": "nccl"}'`;
    see docs/engines.md."""

    weights = "copy"

    def __init__(self, base_url: str, eos_token_ids: Iterable[int], stop_strings: Iterable[str] = (), *,
                 model: str | None = None, sync: str = "nccl", adapter_dir: str | Path | None = None,
                 world_size: int = 1, master_address: str | None = None, master_port: int = 51216,
                 timeout_s: float = 600.0, dtype: str = "bfloat16",
                 broadcaster: Callable[[str, int, int], Callable[[Any], None]] = nccl_broadcaster):
        if sync not in ("nccl", "lora", "none"):
            raise ValueError(f"sync must be nccl, lora or none, got {sync!r}")
        self.base_url = base_url.rstrip("/")
        self.eos_token_ids, self.stop_strings = tuple(eos_token_ids), tuple(stop_strings)
        self.sync, self.timeout_s, self.dtype = sync, timeout_s, dtype
        self.adapter_dir = Path(adapter_dir or "vllm-adapters")
        self.world_size, self.master_port = world_size, master_port
        self.master_address = master_address or rendezvous_address(self.base_url)
        self._broadcaster, self._send = broadcaster, None
        self.base_model = model or self._get("/v1/models")["data"][0]["id"]
        self.model = self.base_model  # the LoRA adapter's name once one is loaded
        self.version = 0
        self.generated_tokens = 0

    # -- http
    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                text = r.read().decode()
        except urllib.error.HTTPError as e:
            raise HTTPError(e.code, path, e.read().decode(errors="replace")) from None
        try:
            return json.loads(text) if text.strip() else None
        except json.JSONDecodeError:
            return text

    def _get(self, path: str) -> Any:
        return self._request("GET", path)

    def _post(self, path: str, body: dict[str, Any] | None = None, optional: bool = False) -> Any:
        try:
            return self._request("POST", path, body or {})
        except HTTPError as e:
            if optional and e.status == 404:
                return None  # a route this server version does not have
            raise

    # -- engine
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        body = completions_request(self.model, prompts, params, self.eos_token_ids, self.stop_strings)
        comps = parse_completions(self._post("/v1/completions", body), len(prompts), params.greedy)
        self.generated_tokens += sum(len(c.token_ids) for c in comps)
        return comps

    def sync_weights(self, model: Any) -> None:
        self.version += 1
        if self.sync == "lora":
            path = save_adapter(model, self.adapter_dir, self.version)
            name, old = f"actloop-v{self.version}", self.model
            self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path.resolve())})
            self.model = name
            if old != self.base_model:
                self._post("/v1/unload_lora_adapter", {"lora_name": old})
        elif self.sync == "nccl":
            import torch

            weights = list(full_weights(model, getattr(torch, self.dtype)))
            if self._send is None:
                self.world_size = self._server_world_size()
                init = {"master_address": self.master_address, "master_port": self.master_port,
                        "rank_offset": 1, "world_size": 1 + self.world_size}
                # the server joins the group while we do: its request returns once both ends are in
                self._send = self._while_posting("/init_weight_transfer_engine", {"init_info": init},
                                                 lambda: self._broadcaster(self.master_address, self.master_port,
                                                                           1 + self.world_size))
            self._post("/start_weight_update", optional=True)
            send = self._send
            self._while_posting("/update_weights", {"update_info": weight_update_info(weights)},
                                lambda: [send(t) for _, t in weights])
            self._post("/finish_weight_update", optional=True)
            self._post("/reset_prefix_cache", optional=True)

    def _server_world_size(self) -> int:
        """The server's worker count (TP x PP x DP) from GET /get_world_size (a wrong NCCL group
        size hangs both ends); the configured one only if the answer lacks it. vLLM registers
        that route with its weight-transfer routes, so a 404 here means the NCCL rendezvous
        would wait for a server that never joins: refused with the fix instead."""
        try:
            answer = self._get("/get_world_size")
        except HTTPError as e:
            if e.status == 404:
                raise RuntimeError(f"vLLM server {self.base_url} has no weight-transfer routes (/get_world_size "
                                   "answered 404): start it with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config "
                                   "'{\"backend\": \"nccl\"}' (see docs/engines.md)") from None
            raise
        return int(answer["world_size"]) if isinstance(answer, dict) and "world_size" in answer else self.world_size

    def _while_posting(self, path: str, body: dict[str, Any], work: Callable[[], Any]) -> Any:
        """POST `path` on a thread while `work()` runs here (the two ends of a collective)."""
        err: list[BaseException] = []

        def post() -> None:
            try:
                self._post(path, body)
            except BaseException as e:  # surfaced below, on the caller's thread
                err.append(e)

        th = threading.Thread(target=post, daemon=True)
        th.start()
        result = work()
        th.join(self.timeout_s)
        if th.is_alive():
            raise TimeoutError(f"vLLM server: {path} did not return within {self.timeout_s:.0f}s")
        if err:
            raise err[0]
        return result
