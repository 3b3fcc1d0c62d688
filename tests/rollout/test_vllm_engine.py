"""vLLM engines, the pieces that need no vLLM: sampling-parameter translation, log-prob
extraction from vLLM's output objects, weight names, the colocated sleep/sync sequence against a
recording stand-in for `vllm.LLM` (the GPU's sleep mode, which the CPU build lacks), and the server
protocol against a local fake HTTP server that speaks vLLM's routes. The real engine:
tests/rollout/test_vllm_real.py."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch

from actloop.config import ConfigError, load_config
from actloop.rollout.engine import SamplingParams
from actloop.rollout.factory import make_engine
from actloop.rollout.vllm_engine import (
    VLLMEngine,
    cast_weights,
    completion_from_vllm,
    finish_reason,
    full_weights,
    load_into_worker,
    repack_tied_weights,
    save_adapter,
    save_full_weights,
    vllm_dtype,
    vllm_max_lora_rank,
    vllm_sampling_kwargs,
    vllm_weight_name,
)
from actloop.rollout.vllm_server import (
    StaleServerError,
    VLLMServerEngine,
    completions_request,
    parse_completions,
    rendezvous_address,
    weight_update_info,
)


def _has_vllm_gpu() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def test_sampling_params_translation():
    kw = vllm_sampling_kwargs(SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9), (2, 7), ["</tool_call>"])
    assert kw == {"n": 1, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                  "presence_penalty": 0.0, "frequency_penalty": 0.0, "max_tokens": 12, "ignore_eos": True,
                  "stop_token_ids": [2, 7], "stop": ["</tool_call>"], "include_stop_str_in_output": True,
                  "skip_special_tokens": False, "logprobs": 0, "seed": None}
    greedy = vllm_sampling_kwargs(SamplingParams(max_new_tokens=5, temperature=0.7, top_p=0.9, greedy=True), (2,), ())
    assert greedy["temperature"] == 0.0 and greedy["top_p"] == 1.0 and greedy["max_tokens"] == 5


def test_finish_reasons():
    assert finish_reason("length", None) == "length"
    assert finish_reason("stop", None) == "stop"  # EOS
    assert finish_reason("stop", 2) == "stop"  # a stop token id
    assert finish_reason("stop", "</tool_call>") == "stop_string"
    assert finish_reason("abort", None) == "length"
    assert finish_reason("repetition", "repetition_detected") == "length"  # cut off, not a stop string
    assert finish_reason("error", None) == "length"


def test_max_lora_rank_rounds_up_to_a_value_vllm_accepts():
    assert [vllm_max_lora_rank(r) for r in (1, 4, 8, 12, 16, 200, 320, 512)] == [1, 8, 8, 16, 16, 256, 320, 512]
    with pytest.raises(ValueError, match="512"):
        vllm_max_lora_rank(600)


def _out(ids, lps, reason="stop", stop=None, extra_top=True):
    positions = []
    for t, lp in zip(ids, lps):
        d = {t: SimpleNamespace(logprob=lp, rank=2, decoded_token="x")}
        if extra_top:
            d[t + 1000] = SimpleNamespace(logprob=-0.01, rank=1, decoded_token="y")  # the top-1 alternative
        positions.append(d)
    return SimpleNamespace(token_ids=ids, logprobs=positions, finish_reason=reason, stop_reason=stop)


def test_completion_from_vllm_takes_the_sampled_tokens_logprob():
    c = completion_from_vllm(_out([5, 9, 2], [-1.5, -0.25, -3.0]))
    assert c.token_ids == (5, 9, 2) and c.logprobs == (-1.5, -0.25, -3.0) and c.finish_reason == "stop"
    c = completion_from_vllm(_out([5, 9], [-1.0, -2.0], stop="</tool_call>"))
    assert c.finish_reason == "stop_string"
    assert completion_from_vllm(_out([5, 9], [-1.0, -2.0]), greedy=True).logprobs == (0.0, 0.0)
    # plain floats (a flat log-prob container) work too
    flat = SimpleNamespace(token_ids=[4], logprobs=[{4: -0.5}], finish_reason="length", stop_reason=None)
    assert completion_from_vllm(flat).logprobs == (-0.5,) and completion_from_vllm(flat).finish_reason == "length"
    with pytest.raises(ValueError, match="3 tokens"):
        completion_from_vllm(SimpleNamespace(token_ids=[1, 2, 3], logprobs=[{1: -1.0}], finish_reason="stop"))
    with pytest.raises(ValueError, match="sampled token 7"):
        completion_from_vllm(SimpleNamespace(token_ids=[7], logprobs=[{8: -1.0}], finish_reason="stop"))
    with pytest.raises(ValueError, match="logprobs=0"):
        completion_from_vllm(SimpleNamespace(token_ids=[7], logprobs=None, finish_reason="stop"))


def test_vllm_routed_experts_become_the_routing_of_every_input_position():
    import numpy as np

    experts = np.arange(6 * 2 * 2).reshape(6, 2, 2)  # 6 positions (prompt 4 + 2 sampled), 2 MoE layers, top-2
    out = SimpleNamespace(token_ids=[7, 8], logprobs=[{7: -0.1}, {8: -0.2}], finish_reason="stop", stop_reason=None,
                          routed_experts=experts)
    comp = completion_from_vllm(out, prompt_len=4)
    assert comp.routing.shape == (5, 2, 2) and comp.routing.dtype == torch.long  # the last sampled id is no input
    assert torch.equal(comp.routing, torch.as_tensor(experts[:5]))
    with pytest.raises(ValueError, match="experts of 6 positions for 9 inputs"):
        completion_from_vllm(out, prompt_len=8)
    assert completion_from_vllm(_out([7], [-0.1]), prompt_len=4).routing is None


def test_routing_replay_on_vllms_cpu_build_is_refused_at_start_with_the_reason(monkeypatch):
    pytest.importorskip("vllm", reason="vLLM is not installed")
    import actloop.rollout.vllm_engine as ve
    from actloop.rollout.factory import resolve_engine

    if ve.vllm_platform() != "cpu":
        pytest.skip("vLLM's GPU build returns routed experts")
    assert "V2 model runner" in ve.vllm_routing_support()
    monkeypatch.delenv("ACTLOOP_AUTO_ENGINE", raising=False)
    kind, why = resolve_engine(load_config(None, ["train.routing_replay=true"]))
    assert kind == "hf" and "cannot return routed experts" in why
    with pytest.raises(ValueError, match="routing_replay on the vllm engine: vLLM's CPU build"):
        VLLMEngine("unused", (2,), routing=True)


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 3)


def test_vllm_samples_in_bf16_only_where_the_trainer_computes_in_bf16(monkeypatch):
    import actloop.rollout.engine as engine_mod

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for fast, auto in ((True, "bfloat16"), (False, "float32")):  # AVX-512 BF16 / AMX, or an AVX2-only CPU
        monkeypatch.setattr(engine_mod, "cpu_has_fast_bf16", lambda fast=fast: fast)
        assert (vllm_dtype("auto"), vllm_dtype("bf16"), vllm_dtype("fp32")) == (auto, "bfloat16", "float32")


def test_weight_names_and_casting():
    assert vllm_weight_name("_orig_mod.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert vllm_weight_name("module.lm_head.weight") == "lm_head.weight"
    assert vllm_weight_name("model._fsdp_wrapped_module.embed_tokens.weight") == "model.embed_tokens.weight"
    m = torch.nn.Sequential()
    m.add_module("_orig_mod", _Tiny())
    ws = list(full_weights(m, torch.bfloat16))
    assert [n for n, _ in ws] == ["lin.weight", "lin.bias"] and all(t.dtype == torch.bfloat16 for _, t in ws)
    info = weight_update_info(ws)
    # exactly vLLM's NCCLWeightTransferUpdateInfo fields (0.33 rejects any other key, e.g. `packed`)
    assert info == {"names": ["lin.weight", "lin.bias"], "dtype_names": ["bfloat16", "bfloat16"], "shapes": [[3, 2], [3]]}
    peft_like = _Tiny()
    peft_like.peft_config = {}
    with pytest.raises(ValueError, match="adapter"):
        list(full_weights(peft_like))


class _Adapter:
    def save_pretrained(self, out):
        out.mkdir(parents=True)
        (out / "adapter_config.json").write_text("{}")


def test_save_adapter_keeps_the_newest(tmp_path):
    for v in range(1, 5):
        path = save_adapter(_Adapter(), tmp_path, v)
    assert path == tmp_path / "v4" and sorted(p.name for p in tmp_path.iterdir()) == ["v3", "v4"]


# --- colocated: the sleep / wake / load sequence against a recording stand-in for vllm.LLM ---

class _Runner:
    """vLLM >= 0.1x model runner: reload_weights takes the tensors (layerwise reload)."""

    def __init__(self, calls):
        self.calls, self.model = calls, SimpleNamespace(load_weights=lambda w: calls.append(("direct", list(w))),
                                                        modules=lambda: [])

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        self.calls.append(("load", [n for n, _ in weights_iterator]))


class _Worker:
    def __init__(self, runner):
        self.model_runner = runner

    def reload_weights(self, *args, **kwargs):  # as vLLM's Worker: forwards to its runner
        self.model_runner.reload_weights(*args, **kwargs)


class _FakeLLM:
    def __init__(self, in_process=True):
        self.calls = []
        self.worker = _Worker(_Runner(self.calls))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace() if in_process else None)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return [method(self.worker, *args, **(kwargs or {}))]  # in-process: the callable runs on the worker

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake", tags))

    def reset_prefix_cache(self):
        self.calls.append(("reset",))


def test_colocated_sleeps_for_the_update_and_loads_weights_before_the_kv_cache():
    llm = _FakeLLM()
    eng = VLLMEngine("unused", (2,), llm=llm)
    assert eng.weights == "copy"
    eng.sleep()
    eng.sleep()  # idempotent
    with pytest.raises(RuntimeError, match="sync_weights"):
        eng.generate([[1, 2]], SamplingParams())  # level 2 freed the weights
    eng.sync_weights(_Tiny())
    assert llm.calls == [("sleep", 2), ("wake", ["weights"]), ("load", ["lin.weight", "lin.bias"]),
                         ("wake", ["kv_cache"]), ("reset",)]
    assert not eng._asleep and not eng._weights_lost and eng.version == 1


def test_colocated_sync_refuses_an_engine_core_in_another_process():
    eng = VLLMEngine("unused", (2,), llm=_FakeLLM(in_process=False))
    with pytest.raises(RuntimeError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        eng.sync_weights(_Tiny())


def test_load_into_worker_uses_reload_weights_else_load_weights():
    calls = []
    load_into_worker(_Worker(_Runner(calls)), iter([("a", 1), ("b", 2)]))
    assert calls == [("load", ["a", "b"])]

    class OldRunner:  # older vLLM: reload_weights() re-reads the checkpoint from disk, no tensors
        def __init__(self):
            self.model = SimpleNamespace(load_weights=lambda w: calls.append(("direct", [n for n, _ in w])))

        def reload_weights(self):
            raise AssertionError("would reload from disk")

    calls.clear()
    load_into_worker(SimpleNamespace(model_runner=OldRunner()), iter([("a", 1)]))
    assert calls == [("direct", ["a"])]


def test_a_layer_tied_to_another_is_processed_again_after_a_reload():
    import torch

    processed = []
    method = SimpleNamespace(process_weights_after_loading=lambda m: processed.append(m.name))
    embed = torch.nn.Parameter(torch.ones(4, 2))
    layers = [SimpleNamespace(name="embed", weight=embed, quant_method=method),
              SimpleNamespace(name="norm", weight=torch.nn.Parameter(torch.ones(2)), quant_method=method),
              SimpleNamespace(name="head", weight=embed, quant_method=method),  # tied: the same tensor
              SimpleNamespace(name="other", weight=torch.nn.Parameter(torch.ones(4, 2)), quant_method=method)]
    assert repack_tied_weights(SimpleNamespace(modules=lambda: layers)) == 1
    assert processed == ["head"]


def test_colocated_lora_sleeps_at_level_1_and_sends_a_new_adapter(tmp_path):
    pytest.importorskip("vllm", reason="LoRARequest comes from vllm")
    llm = _FakeLLM()
    eng = VLLMEngine("unused", (2,), llm=llm, lora_rank=8, adapter_dir=tmp_path)
    eng.sleep()
    eng.sync_weights(_Adapter())
    assert llm.calls == [("sleep", 1)] and eng._lora_request.lora_int_id == 1


# --- server: a fake HTTP server speaking vLLM's routes --------------------------------------

class _FakeServer:
    """Records every request; /v1/completions answers each prompt with its ids reversed, each
    token's log-prob -0.1 * (position + 1), choices in reverse order (the client must sort)."""

    def __init__(self, missing=("/start_weight_update",), world_size=2):
        self.requests, self.missing, self.world_size = [], set(missing), world_size
        self.adapters, self.weight_version = [], "default"  # as vLLM: loaded LoRA names, GET /weight_info
        self.worker_methods = {"reload_weights", "repack_tied_weights"}  # with actloop's worker extension
        self.hold = threading.Event()  # cleared: /v1/completions answers only once it is set again
        self.hold.set()
        self.arrived = threading.Semaphore(0)  # released as each /v1/completions arrives
        self.fail = 0  # the next this many /v1/completions answer 503
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                fake.requests.append(("GET", self.path, None))
                if self.path in fake.missing:
                    return self._reply(404, {"detail": "Not Found"})
                if self.path == "/get_world_size":
                    return self._reply(200, {"world_size": fake.world_size})
                if self.path == "/weight_info":
                    return self._reply(200, {"weight_version": fake.weight_version})
                self._reply(200, {"data": [{"id": m} for m in ["served-model", *fake.adapters]]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                fake.requests.append(("POST", self.path, body))
                if self.path in fake.missing:
                    return self._reply(404, {"detail": "Not Found"})
                if self.path == "/v1/completions":
                    fake.arrived.release()
                    fake.hold.wait(30)
                    if fake.fail:
                        fake.fail -= 1
                        return self._reply(503, {"error": "overloaded"})
                    return self._reply(200, fake.completions(body))
                if self.path == "/v1/load_lora_adapter":
                    fake.adapters.append(body["lora_name"])
                elif self.path == "/v1/unload_lora_adapter":
                    fake.adapters.remove(body["lora_name"])
                elif self.path == "/collective_rpc" and body["method"] not in fake.worker_methods:
                    return self._reply(500, {"error": f"'CPUWorker' object has no attribute '{body['method']}'"})
                elif self.path == "/update_weight_version":
                    fake.weight_version = body["new_version"]
                self._reply(200, {})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @staticmethod
    def completions(body):
        choices = []
        for i, p in enumerate(body["prompt"]):
            ids = list(reversed(p))[: body["max_tokens"]]
            choices.append({"index": i, "text": "", "finish_reason": "length" if i else "stop",
                            "stop_reason": "</tool_call>" if i == 0 else None,
                            "logprobs": {"tokens": [f"token_id:{t}" for t in ids],
                                         "token_logprobs": [-0.1 * (k + 1) for k in range(len(ids))]}})
        return {"choices": list(reversed(choices))}

    def posts(self, path):
        return [b for m, p, b in self.requests if m == "POST" and p == path]

    def close(self):
        self.httpd.shutdown()


@pytest.fixture
def server():
    s = _FakeServer()
    yield s
    s.close()


def test_server_generate_sends_token_ids_and_parses_tokens_back(server):
    eng = VLLMServerEngine(server.url, (2,), ["</tool_call>"], sync="none")
    assert eng.base_model == "served-model"  # from GET /v1/models
    comps = eng.generate([[1, 2, 3], [7, 8]], SamplingParams(max_new_tokens=2, temperature=0.9))
    body = server.posts("/v1/completions")[0]
    assert body["prompt"] == [[1, 2, 3], [7, 8]] and body["model"] == "served-model"
    assert body["logprobs"] == 1 and body["return_tokens_as_token_ids"] and body["max_tokens"] == 2
    assert body["temperature"] == 0.9 and body["stop_token_ids"] == [2] and body["stop"] == ["</tool_call>"]
    # only our EOS ids stop; no sampling knob is left for the server's generation_config to fill
    assert body["ignore_eos"] is True and body["top_k"] == -1 and body["min_p"] == 0.0
    assert body["repetition_penalty"] == 1.0 and body["return_token_ids"]
    assert "seed" not in body
    assert comps[0].token_ids == (3, 2) and comps[0].logprobs == pytest.approx((-0.1, -0.2))
    assert comps[0].finish_reason == "stop_string"
    assert comps[1].token_ids == (8, 7) and comps[1].finish_reason == "length"
    assert eng.generated_tokens == 4


def test_parse_completions_prefers_token_ids_and_checks_counts():
    resp = {"choices": [{"index": 0, "token_ids": [4, 5], "finish_reason": "stop",
                         "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0]}}]}
    assert parse_completions(resp, 1)[0].token_ids == (4, 5)
    with pytest.raises(ValueError, match="choices"):
        parse_completions(resp, 2)
    bad = {"choices": [{"index": 0, "finish_reason": "stop", "logprobs": {"tokens": ["hello"], "token_logprobs": [-1.0]}}]}
    with pytest.raises(ValueError, match="return_tokens_as_token_ids"):
        parse_completions(bad, 1)
    short = {"choices": [{"index": 0, "token_ids": [4, 5], "finish_reason": "stop", "logprobs": {"token_logprobs": [-1.0]}}]}
    with pytest.raises(ValueError, match="1 log-probs for 2 tokens"):
        parse_completions(short, 1)
    req = completions_request("m", [[1]], SamplingParams(greedy=True, max_new_tokens=3), (2,), (), seed=5)
    assert req["temperature"] == 0.0 and req["seed"] == 5


def test_server_lora_sync_loads_new_and_unloads_old(server, tmp_path):
    eng = VLLMServerEngine(server.url, (2,), sync="lora", adapter_dir=tmp_path)
    eng.sync_weights(_Adapter())
    eng.sync_weights(_Adapter())
    loads = server.posts("/v1/load_lora_adapter")
    assert [b["lora_name"] for b in loads] == ["actloop-v1", "actloop-v2"]
    assert loads[1]["lora_path"] == str((tmp_path / "v2").resolve())
    assert server.posts("/v1/unload_lora_adapter") == [{"lora_name": "actloop-v1"}]
    eng.generate([[1]], SamplingParams(max_new_tokens=1))
    assert server.posts("/v1/completions")[-1]["model"] == "actloop-v2"


def test_server_path_sync_writes_safetensors_and_reloads_in_place_then_checks_the_version(server, tmp_path):
    from safetensors.torch import load_file

    eng = VLLMServerEngine(server.url, (2,), sync="path", weights_dir=tmp_path)
    eng.generate([[1]], SamplingParams(max_new_tokens=1))  # before any sync: the server as found ("default")
    model = _Tiny()
    eng.sync_weights(model)
    eng.sync_weights(model)
    calls = [p for m, p, _ in server.requests if m == "POST" and p != "/v1/completions"]
    assert calls == ["/pause?mode=wait", "/collective_rpc", "/collective_rpc", "/update_weight_version",
                     "/reset_prefix_cache", "/resume"] * 2
    assert server.posts("/collective_rpc")[2:] == [
        {"method": "reload_weights", "kwargs": {"weights_path": str((tmp_path / "v2").resolve())}},
        {"method": "repack_tied_weights"}]  # a head tied to the embeddings processed again
    assert [p.name for p in tmp_path.iterdir()] == ["v2"]  # only the newest kept
    saved = load_file(str(tmp_path / "v2" / "model.safetensors"))
    assert torch.equal(saved["lin.weight"], model.lin.weight.detach().to(torch.bfloat16))
    assert server.weight_version == eng.version_string() == f"{eng.token}-2"
    eng.generate([[1]], SamplingParams(max_new_tokens=1))
    server.weight_version = "default"  # restarted
    with pytest.raises(StaleServerError, match="holds weight version 'default', not this run's latest"):
        eng.generate([[1]], SamplingParams(max_new_tokens=1))
    server.worker_methods.discard("repack_tied_weights")  # a server started without actloop's extension
    with pytest.raises(RuntimeError, match="--worker-extension-cls actloop.rollout.vllm_engine.WorkerExtension"):
        eng.sync_weights(model)
    assert server.requests[-1][1] == "/resume"  # the server is not left paused


def test_a_server_sync_waits_for_the_requests_in_flight_and_holds_new_ones_so_each_has_one_version(server,
                                                                                                     tmp_path):
    """rollout.max_staleness > 0 on a server: the client knows each token's version because no
    request is ever in flight across a sync (a request sampled from two versions, tagged with one,
    would be trained with the wrong behaviour policy)."""
    eng = VLLMServerEngine(server.url, (2,), sync="path", weights_dir=tmp_path)
    assert eng.generate([[1, 2]], SamplingParams(max_new_tokens=2))[0].versions == (0, 0)
    server.hold.clear()
    out: dict[str, object] = {}
    first = threading.Thread(target=lambda: out.update(first=eng.generate([[3, 4, 5]], SamplingParams(max_new_tokens=3))))
    first.start()
    assert server.arrived.acquire(timeout=10) and server.arrived.acquire(timeout=10)  # the two answered, this one held
    sync = threading.Thread(target=lambda: eng.sync_weights(_Tiny()))
    sync.start()
    time.sleep(0.3)
    assert "/pause?mode=wait" not in [p for _, p, _ in server.requests] and eng.version == 0  # the sync waits
    second = threading.Thread(target=lambda: out.update(second=eng.generate([[6, 7]], SamplingParams(max_new_tokens=2))))
    second.start()
    time.sleep(0.3)
    assert len(server.posts("/v1/completions")) == 2  # held back behind the waiting sync, not sent
    server.hold.set()
    for t in (first, sync, second):
        t.join(10)
    assert out["first"][0].versions == (0, 0, 0) and out["second"][0].versions == (1, 1)
    paths = [p for m, p, _ in server.requests if m == "POST"]
    assert paths.index("/resume") < len(paths) - 1 - paths[::-1].index("/v1/completions")  # second: after the sync
    assert server.weight_version == eng.version_string()


def test_server_requests_are_in_flight_together_each_retried_on_its_own(server):
    """The continuous schedule on a server: every episode's turn is a request of its own, sent as
    it comes (the server batches the live ones), with IsolatedEngine's retries per request."""
    from actloop.rollout.isolation import IsolatedEngine

    eng = IsolatedEngine(VLLMServerEngine(server.url, (2,), sync="none"), retries=2, sleep=lambda s: None)
    assert eng.continuous_batching
    server.hold.clear()
    futures = [eng.submit([1, 2, i], SamplingParams(max_new_tokens=3)) for i in range(3)]
    assert all(server.arrived.acquire(timeout=10) for _ in range(3))  # all three in flight at once
    server.fail = 1
    server.hold.set()
    outs = [f.result(timeout=10) for f in futures]
    assert [o.token_ids for o in outs] == [(i, 2, 1) for i in range(3)] and all(o.error is None for o in outs)
    assert eng.retried_requests == 1 and len(server.posts("/v1/completions")) == 4  # the 503 one, sent again
    server.fail = 3  # a request that fails every try: a recorded failure, not an exception
    assert "503" in eng.submit([5], SamplingParams(max_new_tokens=1)).result(timeout=10).error
    eng.close()


def test_a_new_run_in_a_weights_folder_an_older_run_left_keeps_what_it_just_wrote(tmp_path):
    for v in (4, 5):
        save_full_weights([("w", torch.ones(2))], tmp_path, v)  # an earlier run's versions (only v5 kept)
    out = save_full_weights([("w", torch.zeros(2))], tmp_path, 1)  # this run's first sync
    assert out.exists() and [p.name for p in tmp_path.iterdir()] == ["v1"]  # the server reads v1 next


def test_tied_tensors_are_written_once_under_the_first_name():
    emb = torch.nn.Embedding(4, 2)
    head = torch.nn.Linear(2, 4, bias=False)
    head.weight = emb.weight
    state = [("model.embed_tokens.weight", emb.weight), ("lm_head.weight", head.weight)]
    assert [n for n, _ in cast_weights(state, torch.bfloat16)] == ["model.embed_tokens.weight"]


def test_server_nccl_sync_posts_metadata_while_broadcasting_in_order(server):
    sent, groups = [], []

    def broadcaster(addr, port, world):
        groups.append((addr, port, world))
        return lambda t: sent.append(t.clone())

    eng = VLLMServerEngine(server.url, (2,), sync="nccl", world_size=2, master_port=6000, broadcaster=broadcaster)
    model = _Tiny()
    eng.sync_weights(model)
    eng.sync_weights(model)
    assert groups == [("127.0.0.1", 6000, 3)]  # one group, joined once
    assert server.posts("/init_weight_transfer_engine") == [
        {"init_info": {"master_address": "127.0.0.1", "master_port": 6000, "rank_offset": 1, "world_size": 3}}]
    ups = server.posts("/update_weights")
    assert len(ups) == 2 and ups[0]["update_info"]["names"] == ["lin.weight", "lin.bias"]
    assert ups[0]["update_info"]["shapes"] == [[3, 2], [3]]
    assert len(sent) == 4 and torch.equal(sent[0], model.lin.weight.detach().to(torch.bfloat16))
    assert len(server.posts("/finish_weight_update")) == 2  # /start_weight_update is 404 here: skipped


def test_server_nccl_group_size_comes_from_the_server():
    groups = []

    def broadcaster(addr, port, world):
        groups.append(world)
        return lambda t: None

    s = _FakeServer(world_size=4)
    try:
        VLLMServerEngine(s.url, (2,), sync="nccl", world_size=1, broadcaster=broadcaster).sync_weights(_Tiny())
        assert groups == [5] and s.posts("/init_weight_transfer_engine")[0]["init_info"]["world_size"] == 5
    finally:
        s.close()
    # without dev mode the RL routes 404: refused before the rendezvous would wait forever
    s = _FakeServer(missing=("/get_world_size", "/init_weight_transfer_engine"))
    try:
        eng = VLLMServerEngine(s.url, (2,), sync="nccl", broadcaster=broadcaster)
        with pytest.raises(RuntimeError, match="VLLM_SERVER_DEV_MODE=1"):
            eng.sync_weights(_Tiny())
        assert groups == [5] and s.posts("/init_weight_transfer_engine") == []
    finally:
        s.close()


def test_rendezvous_address_is_loopback_only_for_a_local_server():
    assert rendezvous_address("http://localhost:8000") == rendezvous_address("http://127.0.0.1:8000") == "127.0.0.1"
    import ipaddress

    remote = rendezvous_address("http://192.0.2.7:8000")  # TEST-NET: routed (or not) but never contacted
    assert ipaddress.ip_address(remote).version == 4


def test_server_error_status_is_raised_with_its_body(server):
    server.missing.add("/v1/completions")
    eng = VLLMServerEngine(server.url, (2,), sync="none", model="x")
    with pytest.raises(RuntimeError, match="404"):
        eng.generate([[1]], SamplingParams())


def test_factory_refuses_what_cannot_run(tmp_path):
    models = SimpleNamespace(lora=False, policy=None, tokenizer=None)
    renderer = SimpleNamespace(eos_token_ids=(2,), stop_strings=())
    if not _has_vllm_gpu():
        try:
            import vllm  # noqa: F401
        except ImportError:
            with pytest.raises(ConfigError, match="actloop\\[vllm"):
                make_engine(load_config(None, ["rollout.engine=vllm"]), models, renderer)
            with pytest.raises(ConfigError, match="vllm_server_sync=nccl needs vLLM"):  # before any GPU time is spent
                make_engine(load_config(None, ["rollout.engine=vllm-server"]), models, renderer)
    with pytest.raises(ConfigError, match="lora.enabled"):
        make_engine(load_config(None, ["rollout.engine=vllm-server", "rollout.vllm_server_sync=lora"]), models, renderer)


def test_auto_resolves_to_vllm_where_installed_else_hf_and_says_why(monkeypatch, tmp_path):
    from actloop.rollout import factory

    monkeypatch.delenv("ACTLOOP_AUTO_ENGINE", raising=False)
    monkeypatch.setattr(factory, "vllm_available", lambda: "")
    assert factory.resolve_engine(load_config(None, [])) == ("vllm", "rollout.engine=auto: vLLM is installed")
    kind, why = factory.resolve_engine(load_config(None, ["train.routing_replay=true"]))
    assert kind == "hf" and "routing_replay" in why
    assert factory.resolve_engine(load_config(None, ["rollout.engine=hf"])) == ("hf", "rollout.engine=hf")
    # small synchronous steps without CUDA: hf (a whole GRPO step measured faster there); not with rollouts ahead
    small = ["train.prompts_per_step=2", "train.group_size=8"]
    kind, why = factory.resolve_engine(load_config(None, small))
    assert (kind, "16 episodes a step" in why) == (("vllm", False) if torch.cuda.is_available() else ("hf", True))
    assert factory.resolve_engine(load_config(None, [*small, "rollout.max_staleness=1"]))[0] == "vllm"
    assert factory.resolve_engine(load_config(None, ["train.prompts_per_step=2", "train.group_size=9"]))[0] == "vllm"
    assert factory.resolve_engine(load_config(None, [*small, "rollout.engine=vllm"]))[0] == "vllm"
    kind, why = factory.resolve_engine(load_config(None, ["lora.enabled=true"]))
    assert kind == ("vllm" if torch.cuda.is_available() else "hf") and ("LoRA" in why or kind == "vllm")
    assert factory.resolve_engine(load_config(None, ["lora.enabled=true", "rollout.engine=vllm"]))[0] == "vllm"
    kind, why = factory.resolve_engine(load_config(None, ["model=openai/gpt-oss-20b"]))
    assert kind == "hf" and "sinks and experts" in why
    local = tmp_path / "tiny"
    local.mkdir()
    (local / "config.json").write_text('{"model_type": "gpt_oss"}')
    assert factory.resolve_engine(load_config(None, [f"model={local}"]))[0] == "hf"
    assert factory.resolve_engine(load_config(None, [f"model={local}", "rollout.engine=vllm"]))[0] == "vllm"
    monkeypatch.setattr(factory, "vllm_available", lambda: "vLLM is not installed (...)")
    assert factory.resolve_engine(load_config(None, [])) == ("hf", "rollout.engine=auto: vLLM is not installed (...)")
    assert factory.resolve_engine(load_config(None, ["rollout.engine=vllm"]))[0] == "vllm"  # named: no fallback
    monkeypatch.setattr(factory, "vllm_available", lambda: "")
    monkeypatch.setenv("ACTLOOP_AUTO_ENGINE", "hf")
    assert factory.resolve_engine(load_config(None, []))[0] == "hf"
    monkeypatch.setenv("ACTLOOP_AUTO_ENGINE", "tgi")
    with pytest.raises(ConfigError, match="ACTLOOP_AUTO_ENGINE=tgi"):
        factory.resolve_engine(load_config(None, []))
