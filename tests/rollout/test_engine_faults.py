"""Engine failures isolated (actloop.rollout.isolation): a vllm-server stand-in that fails 1 request
in 5 (and one that refuses connections), out-of-memory and one bad prompt in a batch, a Ray rollout
actor SIGKILLed in the middle of a request. Each test states what was lost and what was reported."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from actloop.envs.base import StepResult
from actloop.rollout.engine import Completion, SamplingParams
from actloop.rollout.isolation import IsolatedEngine, kind_of
from actloop.types import Message

P = SamplingParams(max_new_tokens=4)


class Flaky:
    """An engine whose `plan` says what each call does: None = answer, an exception = raise it."""

    weights = "copy"

    def __init__(self, plan=(), fail_if=None):
        self.plan, self.fail_if, self.calls, self.generated_tokens = list(plan), fail_if, [], 0

    def generate(self, prompts, params):
        self.calls.append([list(p) for p in prompts])
        step = self.plan.pop(0) if self.plan else None
        if step is not None:
            raise step
        if self.fail_if is not None and (err := self.fail_if(prompts)) is not None:
            raise err
        self.generated_tokens += len(prompts)
        return [Completion((p[-1] + 1,), (-0.5,), "stop") for p in prompts]

    def sync_weights(self, model):
        self.synced = model


class Status(RuntimeError):
    def __init__(self, status):
        super().__init__(f"HTTP {status}")
        self.status = status


def test_transient_failures_are_retried_with_capped_exponential_backoff():
    waits = []
    inner = Flaky([Status(503), Status(500), ConnectionRefusedError("refused")])
    eng = IsolatedEngine(inner, retries=3, backoff_s=1.0, max_backoff_s=3.0, sleep=waits.append)
    out = eng.generate([[1], [2]], P)
    assert [c.token_ids for c in out] == [(2,), (3,)] and all(c.error is None for c in out)  # nothing lost
    assert waits == [1.0, 2.0, 3.0]  # 1, 2, then 4 capped at 3
    assert eng.stats() == {"failed_requests": 3, "retried_requests": 3, "failed_prompts": 0}


def test_retries_exhausted_fail_only_that_request_s_prompts_with_the_reason():
    eng = IsolatedEngine(Flaky([Status(502)] * 3), retries=2, sleep=lambda s: None)
    out = eng.generate([[1], [2], [3]], P)
    assert all(c.token_ids == () and c.error.startswith("engine: Status: HTTP 502") for c in out)
    assert eng.generate([[4]], P)[0].token_ids == (5,)  # the next request goes through
    assert eng.stats()["failed_prompts"] == 3


def test_out_of_memory_splits_the_batch_until_it_fits():
    oom = lambda ps: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB") if len(ps) > 2 else None
    inner = Flaky(fail_if=oom)
    eng = IsolatedEngine(inner, retries=2, sleep=lambda s: pytest.fail("an OOM is not retried as it was"))
    out = eng.generate([[i] for i in range(8)], P)
    assert [c.token_ids for c in out] == [(i + 1,) for i in range(8)]  # every prompt answered, in order
    assert [len(c) for c in inner.calls] == [8, 4, 2, 2, 4, 2, 2]


def test_one_bad_prompt_fails_alone():
    bad = lambda ps: Status(400) if [666] in [list(p) for p in ps] else None
    eng = IsolatedEngine(Flaky(fail_if=bad), sleep=lambda s: None)
    out = eng.generate([[1], [666], [3], [4]], P)
    assert [c.error is not None for c in out] == [False, True, False, False]
    assert [c.token_ids for c in out] == [(2,), (), (4,), (5,)]


def test_wrapper_passes_everything_else_through():
    inner = Flaky()
    eng = IsolatedEngine(inner)
    eng.generate([[1]], P)
    assert eng.generated_tokens == 1 and eng.weights == "copy"
    eng.sync_weights("w")
    assert inner.synced == "w"
    eng.generated_tokens = 7  # set on the engine, not on the wrapper
    assert inner.generated_tokens == 7
    assert not hasattr(eng, "sleep")  # the trainer's hasattr checks see the inner engine's methods only


def test_retry_settings_are_validated():
    from actloop.config import ConfigError, load_config

    for bad in (["rollout.engine_retries=-1"], ["rollout.engine_retry_backoff_s=60"]):
        with pytest.raises(ConfigError, match="engine_retr"):
            load_config(None, bad)


def test_kinds():
    import urllib.error

    assert kind_of(Status(429)) == "transient" and kind_of(Status(400)) == "other"
    assert kind_of(urllib.error.URLError("refused")) == "transient" and kind_of(TimeoutError()) == "transient"
    assert kind_of(RuntimeError("DefaultCPUAllocator: can't allocate memory")) == "oom"
    assert kind_of(ValueError("bad reply")) == "other"


# --- a vllm-server stand-in that fails 1 request in 5 --------------------------------------------


class StandIn:
    """`vllm serve` as far as VLLMServerEngine sees it: /v1/models, and /v1/completions answering
    every prompt with `reply` ids; every `fail_every`-th completions request answers HTTP 500."""

    def __init__(self, reply, fail_every=5):
        self.reply, self.fail_every, self.requests, self.failed = list(reply), fail_every, 0, 0
        me = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(200, {"data": [{"id": "stand-in"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                me.requests += 1
                if me.fail_every and me.requests % me.fail_every == 0:
                    me.failed += 1
                    return self._send(500, {"error": "injected: CUDA error: an illegal memory access"})
                ids = me.reply[: body["max_tokens"]]
                self._send(200, {"choices": [{"index": i, "text": "", "finish_reason": "stop", "stop_reason": None,
                                              "logprobs": {"tokens": [f"token_id:{t}" for t in ids],
                                                           "token_logprobs": [-0.5] * len(ids)}}
                                             for i in range(len(body["prompt"]))]})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class OneTurn:
    """Asks a question, accepts any answer."""

    def reset(self, row):
        return [Message("user", f"What is {row['id']} + 1?")], []

    def step(self, message):
        return StepResult(messages=(), done=True, reward=1.0)


def _rollout(engine, tokenizer, steps=10, per_step=4):
    from actloop.rewards.rubric import Rubric, RewardTerm
    from actloop.rollout.episodes import run_episodes
    from actloop.rollout.renderer import Renderer
    from actloop.train.runtime.failures import classify

    renderer = Renderer(tokenizer)
    rubric = Rubric([RewardTerm("one", lambda prompts, completions, **kw: [1.0] * len(completions))])
    scored, failures = [], []
    for step in range(1, steps + 1):
        # lockstep: a step's turns go out as one batched request, the unit the stand-in fails (a server's
        # default, the continuous schedule, sends a request per episode: test_vllm_engine.py retries those)
        trajs = run_episodes(engine, renderer, OneTurn, [{"id": f"{step}-{i}"} for i in range(per_step)], P, 1,
                             schedule="lockstep")
        s = rubric.score(trajs)
        scored += s
        failures += classify(step, s)
    return scored, failures


@pytest.fixture
def stand_in(tokenizer):
    s = StandIn(tokenizer.encode("4", add_special_tokens=False) + [tokenizer.eos_token_id])
    yield s
    s.close()


def test_vllm_server_failing_one_request_in_five_loses_nothing_with_retries(stand_in, tokenizer):
    from actloop.rollout.vllm_server import VLLMServerEngine

    waits = []
    eng = IsolatedEngine(VLLMServerEngine(stand_in.url, (tokenizer.eos_token_id,), sync="none"), retries=2,
                         backoff_s=0.5, sleep=waits.append)
    scored, failures = _rollout(eng, tokenizer)
    # lost: nothing. 40 episodes, every one answered; 2 of the 12 requests failed and were retried
    assert stand_in.failed == 2 and stand_in.requests == 12
    assert len(scored) == 40 and not any(s.masked for s in scored) and failures == []
    assert all(s.trajectory.num_response_tokens == 2 for s in scored)
    # reported: the retries, each after a 0.5 s backoff
    assert eng.stats() == {"failed_requests": 2, "retried_requests": 2, "failed_prompts": 0} and waits == [0.5, 0.5]


def test_vllm_server_failures_without_retries_are_recorded_per_trajectory_and_masked(stand_in, tokenizer, tmp_path):
    from actloop.config import FailuresConfig
    from actloop.rollout.vllm_server import VLLMServerEngine
    from actloop.train.runtime.failures import FailureGuard, FailureLog, failure_metrics

    eng = IsolatedEngine(VLLMServerEngine(stand_in.url, (tokenizer.eos_token_id,), sync="none"), retries=0)
    scored, failures = _rollout(eng, tokenizer)
    # lost: only the two failed requests' episodes (steps 5 and 10), masked from the loss
    assert [s.masked for s in scored].count(True) == 8 and stand_in.failed == 2
    assert sorted({f.step for f in failures}) == [5, 10] and {f.kind for f in failures} == {"engine"}
    assert all(f.masked and "HTTP 500" in f.message and "illegal memory access" in f.message for f in failures)
    # reported: failures.jsonl lines and the per-step metrics; the guard sees bad steps, not a crash
    log = FailureLog(tmp_path / "failures.jsonl")
    log.write(failures)
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "failures.jsonl").read_text().splitlines()]
    assert len(lines) == 8 and lines[0]["kind"] == "engine" and lines[0]["step"] == 5
    step5 = [f for f in failures if f.step == 5]
    m = failure_metrics(step5, 4, FailuresConfig())
    assert m["failures/engine"] == 4 and m["failures/rate"] == 1.0
    guard = FailureGuard(FailuresConfig())
    assert guard.check(5, step5, 4, tmp_path) is None  # one bad step: the run goes on (max_bad_steps=3)


def test_refused_connection_is_recorded_not_raised(tokenizer):
    import socket

    from actloop.rollout.vllm_server import VLLMServerEngine

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    eng = IsolatedEngine(VLLMServerEngine(f"http://127.0.0.1:{port}", (2,), sync="none", model="m"), retries=1,
                         sleep=lambda s: None)
    out = eng.generate([[1, 2], [3]], P)
    assert all(c.error and "Connection refused" in c.error for c in out)
    assert eng.stats() == {"failed_requests": 2, "retried_requests": 1, "failed_prompts": 2}


@pytest.mark.slow
def test_training_against_a_flaky_vllm_server_completes_and_reports(stand_in, tmp_path):
    """The trainer end to end with rollout.engine=vllm-server (sync none) against the stand-in,
    no retries: the failed request's trajectories are masked and in failures.jsonl, the other
    steps train, the run finishes."""
    from actloop.config import load_config
    from actloop.train.trainer import train

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Say {i}."}]}) + "\n" for i in range(8)))
    (tmp_path / "rew.py").write_text("import random\ndef r(prompts, completions, **kw):\n"
                                     "    return [random.random() for c in completions]\n")
    cfg = load_config(None, [f"data.path={rows}", f"reward.funcs=[{tmp_path}/rew.py:r]", "train.steps=5",
                             "train.prompts_per_step=1", "train.group_size=2", "rollout.max_new_tokens=4",
                             "rollout.max_turns=1", "train.eval_before=false", "train.eval_after=false",
                             "train.save_final=false", "checkpoint.every=0", "checkpoint.at_end=false",
                             "train.threads=1", "train.beta=0", "rollout.engine=vllm-server",
                             f"rollout.vllm_server_url={stand_in.url}", "rollout.vllm_server_sync=none",
                             "rollout.engine_retries=0", "rollout.schedule=lockstep", f"output_dir={tmp_path}",
                             "run_name=flaky",
                             "monitor.sample_every=0"])
    res = train(cfg, progress=False, print_fn=lambda *_: None)
    lines = [json.loads(x) for x in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5] and stand_in.failed == 1
    assert [r["failures/engine"] for r in lines] == [0, 0, 0, 0, 2]
    assert lines[4]["trained_trajectories"] == 0 and sum(r["trained_trajectories"] for r in lines[:4]) > 0
    failed = [json.loads(x) for x in (res.run_dir / "failures.jsonl").read_text().splitlines()]
    assert [(f["step"], f["kind"], f["masked"]) for f in failed] == [(5, "engine", True)] * 2
    assert res.summary["failures"] == {"engine": 2}


# --- a Ray rollout actor killed in the middle of a request ----------------------------------------


@pytest.mark.slow
def test_ray_actor_sigkilled_mid_request_is_replaced_with_the_synced_weights(ray_session, tmp_path, fp32_model):
    import copy
    import os
    import signal
    import time

    from actloop.config import load_config
    from actloop.rollout.ray_engine import RayEngine

    ray = ray_session
    engine = None
    try:
        cfg = load_config(None, ["train.threads=1", "ray.num_rollout_workers=1", "ray.cpus_per_worker=1",
                                 "train.precision=fp32", f"output_dir={tmp_path}"])
        engine = RayEngine.from_config(cfg)
        policy = copy.deepcopy(fp32_model)
        with torch.no_grad():  # weights a fresh actor would not have without the last sync
            policy.model.layers[0].mlp.down_proj.weight.mul_(1.5)
        engine.sync_weights(policy)
        greedy = SamplingParams(max_new_tokens=24, greedy=True)
        prompt = [[1, 504, 3937, 314]]
        before = engine.generate(prompt, greedy)[0]
        pid = ray.get(engine.workers[0].ready.remote())["pid"]
        result = {}
        # 16 rows and an early kill: the request must still be running when the actor dies (4 rows could
        # finish inside a 1 s sleep on a fast box, and the kill then found nothing to replace); a kill
        # landing before the request reaches the actor fails it the same way
        t = threading.Thread(target=lambda: result.update(out=engine.generate(prompt * 16, greedy)))
        t.start()
        time.sleep(0.3)
        os.kill(pid, signal.SIGKILL)
        t.join(timeout=600)
        # lost: nothing; the shard ran again on a new actor that has the synced weights
        out = result["out"]
        assert engine.replaced_workers == 1 and ray.get(engine.workers[0].ready.remote())["pid"] != pid
        assert all(c.token_ids == before.token_ids for c in out)
        assert all(max(abs(a - b) for a, b in zip(c.logprobs, before.logprobs)) < 1e-4 for c in out)
        # a shard whose actor dies and cannot be replaced comes back as failed trajectories
        engine.spawn = None
        os.kill(ray.get(engine.workers[0].ready.remote())["pid"], signal.SIGKILL)
        time.sleep(1.0)
        rows = [{"question": "1 + 1", "answer": "2", "id": "r0"}]
        trajs = engine.run_episodes(rows, greedy, max_turns=1)
        assert len(trajs) == 1 and trajs[0].error.startswith("engine: ") and "Actor" in trajs[0].error
    finally:
        if engine is not None:
            engine.close()
