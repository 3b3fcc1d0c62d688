"""`VLLMServerEngine`: a `vllm serve` process started separately (`rollout.engine=vllm-server`),
spoken to over HTTP with the standard library: token ids in (POST /v1/completions with token-id
prompts), sampled ids and log-probs out, weights synced after every update (docs/engines.md), and
`VersionGate`, which keeps each request on one weight version so that the server can sample ahead
of training (`rollout.max_staleness > 0`, docs/async.md).

The request bodies and response parsing are plain functions, tested without a server; the
sampling-parameter translation, weight names and weight files are `actloop.rollout.vllm_engine`'s,
shared with the colocated engine. The weight-sync routes are listed in that module's docstring.
"""

from __future__ import annotations

import contextlib
import json
import threading
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from actloop.rollout.engine import Completion, EngineBase, SamplingParams
from actloop.rollout.vllm_engine import (
    WORKER_EXTENSION,
    cast_weights,
    finish_reason,
    full_weights,
    save_adapter,
    save_full_weights,
    vllm_sampling_kwargs,
)


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


class StaleServerError(RuntimeError):
    """The vLLM server does not hold the weights the trainer last sent (restarted, or updated by
    someone else): sampling from it would be silent off-policy data. Fatal: `IsolatedEngine`
    raises it instead of retrying or masking prompts."""

    fatal = True


SERVER_SYNCS = ("path", "nccl", "lora", "none")


class VersionGate:
    """Requests against weight syncs on a server: any number of requests at once, or one sync,
    never both. A sync waits for the requests in flight to return (they were sampled by the old
    weights, all their tokens) and holds back new ones until the new weights are in; a waiting
    sync goes first, so that a stream of requests cannot starve it. So every request's tokens come
    from the one version it started under: the client knows each token's version without the
    server telling it (the server cannot: its completions carry no weight version)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.requests = 0
        self.syncs_waiting = 0
        self.syncing = False

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        with self.cond:
            while self.syncing or self.syncs_waiting:
                self.cond.wait()
            self.requests += 1
        try:
            yield
        finally:
            with self.cond:
                self.requests -= 1
                self.cond.notify_all()

    @contextlib.contextmanager
    def sync(self) -> Iterator[None]:
        with self.cond:
            self.syncs_waiting += 1
            while self.syncing or self.requests:
                self.cond.wait()
            self.syncs_waiting -= 1
            self.syncing = True
        try:
            yield
        finally:
            with self.cond:
                self.syncing = False
                self.cond.notify_all()


class VLLMServerEngine(EngineBase):
    """A separately started `vllm serve` (`rollout.engine=vllm-server`). Launch it with
    `--logprobs-mode processed_logprobs` (log-probs under the sampling temperature) and, for
    full-weight sync, VLLM_SERVER_DEV_MODE=1 (and for `nccl` `--weight-transfer-config
    '{"backend": "nccl"}'`); see docs/engines.md.

    Full weights without NCCL (`sync="path"`, any device, vLLM's CPU build included): the trainer
    writes the weights as <weights_dir>/v<N>/model.safetensors (a folder the server reads: /dev/shm
    on the same machine, a shared filesystem across machines) and the server reloads them in place:
    POST /pause?mode=wait (requests in flight finish on the old weights), POST /collective_rpc
    `reload_weights(weights_path=...)` (vLLM's layerwise reload, the same post-load processing as
    the colocated sync; then the worker extension's `repack_tied_weights`, which needs the server
    started with `--worker-extension-cls actloop.rollout.vllm_engine.WorkerExtension`),
    POST /update_weight_version, /reset_prefix_cache, /resume.

    The server's version is checked before every generation: with full weights its
    GET /weight_info must answer the version string this engine set last (`<run token>-<N>`: a
    restarted server answers none, another run's server another token); with LoRA the adapter last
    loaded must be among GET /v1/models. A mismatch raises `StaleServerError`, never samples.

    Versions: a sync waits for the requests in flight and holds new ones back until the server
    holds the new weights (`VersionGate`), so every completion's tokens carry the one version its
    request started under, exactly. That lets the server sample ahead of training
    (`rollout.max_staleness > 0`, `samples_apart`): the update runs in the trainer's process while
    the server decodes the next groups; an episode's later turns may come from newer weights than
    its first (partial rollouts, turn by turn: a turn never spans a sync, the colocated engine's
    may)."""

    weights = "copy"
    samples_apart = True
    # each submitted request is a /v1/completions call of its own, on a thread: the server batches the
    # live ones continuously, so an episode's slow tool holds up only that episode (the continuous schedule)
    continuous_batching = True

    def __init__(self, base_url: str, eos_token_ids: Iterable[int], stop_strings: Iterable[str] = (), *,
                 model: str | None = None, sync: str = "nccl", adapter_dir: str | Path | None = None,
                 weights_dir: str | Path | None = None,
                 world_size: int = 1, master_address: str | None = None, master_port: int = 51216,
                 timeout_s: float = 600.0, dtype: str = "bfloat16",
                 broadcaster: Callable[[str, int, int], Callable[[Any], None]] = nccl_broadcaster):
        import uuid

        if sync not in SERVER_SYNCS:
            raise ValueError(f"sync must be one of {', '.join(SERVER_SYNCS)}, got {sync!r}")
        self.base_url = base_url.rstrip("/")
        self.eos_token_ids, self.stop_strings = tuple(eos_token_ids), tuple(stop_strings)
        self.sync, self.timeout_s, self.dtype = sync, timeout_s, dtype
        self.adapter_dir = Path(adapter_dir or "vllm-adapters")
        self.weights_dir = Path(weights_dir or "vllm-weights")
        self.world_size, self.master_port = world_size, master_port
        self.master_address = master_address or rendezvous_address(self.base_url)
        self._broadcaster, self._send = broadcaster, None
        self.base_model = model or self._get("/v1/models")["data"][0]["id"]
        self.model = self.base_model  # the LoRA adapter's name once one is loaded
        self.version = 0
        self.generated_tokens = 0
        self.gate = VersionGate()  # requests or a sync, never both: each request's tokens have one version
        # submit's request threads (started as requests come): one in flight per episode waiting for a turn
        self._pool = ThreadPoolExecutor(max_workers=256, thread_name_prefix="vllm-server-request")
        self.token = uuid.uuid4().hex[:8]  # this engine's versions: `<token>-<N>`
        # the version the server holds before any sync: its base weights, unless another run updated it
        self._start_version = self._server_version() if sync != "none" else None

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

    def _post(self, path: str, body: dict[str, Any] | None = None, optional: bool = False,
              query: dict[str, str] | None = None) -> Any:
        from urllib.parse import urlencode

        try:
            return self._request("POST", path + ("?" + urlencode(query) if query else ""), body or {})
        except HTTPError as e:
            if optional and e.status == 404:
                return None  # a route this server version does not have
            raise

    # -- versions
    def version_string(self) -> str | None:
        """What the server must answer once it holds this engine's latest weights (None before a sync)."""
        return f"{self.token}-{self.version}" if self.version else None

    def _server_version(self) -> str | None:
        """GET /weight_info's `weight_version` (None where the server lacks the route: no dev mode)."""
        try:
            answer = self._get("/weight_info")
        except HTTPError as e:
            if e.status == 404:
                return None
            raise
        return answer.get("weight_version") if isinstance(answer, dict) else None

    def check_version(self) -> None:
        """Raise `StaleServerError` unless the server holds the weights this engine sent last: its
        full-weight version, or (LoRA) the latest adapter on the base it had when this run began."""
        if self.sync == "none":
            return
        if self.sync == "lora" and self.model != self.base_model:
            served = {m["id"] for m in self._get("/v1/models").get("data", [])}
            if self.model not in served:
                raise StaleServerError(f"vLLM server {self.base_url} does not serve the adapter {self.model} "
                                       f"(it serves {sorted(served)}): restarted? Resume the run to re-send it.")
        want = (self.version_string() if self.sync != "lora" else None) or self._start_version
        held = self._server_version()
        if held != want:
            raise StaleServerError(f"vLLM server {self.base_url} holds weight version {held!r}, not this run's "
                                   f"latest {want!r} (restarted, or updated by another trainer): sampling from it "
                                   "would be off-policy. Resume the run to re-send the weights.")

    # -- engine
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        with self.gate.request():  # no sync until this request is answered: its tokens are `version`'s
            version = self.version
            self.check_version()
            body = completions_request(self.model, prompts, params, self.eos_token_ids, self.stop_strings)
            comps = parse_completions(self._post("/v1/completions", body), len(prompts), params.greedy)
        with self.gate.cond:  # requests answer on several threads at once
            self.generated_tokens += sum(len(c.token_ids) for c in comps)
        return [replace(c, versions=(version,) * len(c.token_ids)) for c in comps]

    def submit(self, prompt: list[int], params: SamplingParams) -> Future:
        return self.submit_call(lambda: self.generate([prompt], params)[0])

    def submit_call(self, fn: Callable[[], Completion]) -> Future:
        """fn() on a thread of the request pool (IsolatedEngine passes its retrying `generate` here)."""
        return self._pool.submit(fn)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def sync_weights(self, model: Any) -> None:
        if self.sync == "path":
            self.load_weights(full_weights(model))
            return
        with self.gate.sync():
            self._send_weights(model)

    def _send_weights(self, model: Any) -> None:
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
            self._post("/update_weight_version", {"new_version": self.version_string()}, optional=True)
            self._post("/reset_prefix_cache", optional=True)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """(checkpoint name, tensor) pairs, every weight of the model, written to `weights_dir` and
        reloaded in place by the server (`sync="path"`; torchrun's gathered shards come here too)."""
        import torch

        if self.sync != "path":
            raise ValueError(f"load_weights needs sync='path' (this engine syncs by {self.sync})")
        # written while requests go on (one sync at a time: the trainer's); then the gate holds them back
        path = save_full_weights(cast_weights(weights, getattr(torch, self.dtype)), self.weights_dir,
                                 self.version + 1)
        with self.gate.sync():
            self.version += 1
            self._reload(path)

    def _reload(self, path: Path) -> None:
        self._post("/pause", query={"mode": "wait"})  # nothing is in flight (the gate), nothing starts
        try:
            self._post("/collective_rpc", {"method": "reload_weights",
                                           "kwargs": {"weights_path": str(path.resolve())}})
            try:
                self._post("/collective_rpc", {"method": "repack_tied_weights"})
            except HTTPError as e:
                raise RuntimeError(f"vLLM server {self.base_url} cannot re-process a tied head after a reload "
                                   f"({e}): start it with --worker-extension-cls {WORKER_EXTENSION} (without it a "
                                   "head tied to the embeddings keeps the old weights on vLLM's CPU build; "
                                   "see docs/engines.md)") from None
            self._post("/update_weight_version", {"new_version": self.version_string()})
            self._post("/reset_prefix_cache", optional=True)
        finally:
            self._post("/resume")

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
