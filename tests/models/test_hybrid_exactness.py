"""Tokens in, tokens out, for GPT-OSS (sliding-window + full layers, attention sinks, MoE) and Qwen3:
the HF engine's log-probs (fp32, live weights) equal the trainer's recomputation within 1e-3 over
episodes longer than the sliding window, with batches whose rows share a prefix, differ in
length (padding between prefix and suffix) and finish at different steps (rows leave the batch)."""

import pytest
import torch
from fixtures.tiny_models import GPT_OSS_SLIDING_WINDOW

from actloop.models import load_models
from actloop.rollout.engine import HFEngine, SamplingParams
from actloop.train.numerics.logprobs import token_logprobs

W = GPT_OSS_SLIDING_WINDOW


def _prompts(tok):
    head = tok.apply_chat_template([{"role": "system", "content": "You are a helpful assistant. Use the calculator tool."},
                                    {"role": "user", "content": "What is 23 * 17? Use the calculator."}],
                                   tokenize=False, add_generation_prompt=True)
    base = tok.encode(head, add_special_tokens=False)
    extra = tok.encode(" The answer is 391 and 42.", add_special_tokens=False)
    # a shared prefix longer than the window, then suffixes of different lengths
    return [base, base[:-3] + extra + base[-3:], base[:-3] + extra[:4] + base[-3:], base[:-1] + base[-1:]]


@pytest.mark.parametrize("which", ["tiny_gpt_oss_dir", "tiny_qwen3_dir"])
@pytest.mark.parametrize("share_prefix", [True, False])
def test_engine_logprobs_equal_trainer(which, share_prefix, request):
    models = load_models(request.getfixturevalue(which))
    model, tok = models.policy.eval(), models.tokenizer
    eos = (tok.eos_token_id,)
    engine = HFEngine(model, tok, eos, precision="fp32", weights="live")
    prompts = _prompts(tok)
    torch.manual_seed(0)
    assert min(len(p) for p in prompts) > 3 * W
    params = SamplingParams(max_new_tokens=4 * W, temperature=1.0)
    first = engine.generate(prompts, params)
    # make a token row 1 sampled after the window a stop id, so that row leaves the batch early
    engine.eos_token_ids = eos + (first[1].token_ids[W + 2],)
    torch.manual_seed(0)
    outs = engine.generate(prompts, params)
    assert len(outs[1].token_ids) <= W + 3 < max(len(o.token_ids) for o in outs)
    assert max(len(o.token_ids) for o in outs) > 2 * W  # decode crosses the window several times
    seqs = [p + list(o.token_ids) for p, o in zip(prompts, outs)]
    masks = [[0] * len(p) + [1] * len(o.token_ids) for p, o in zip(prompts, outs)]
    with torch.no_grad():
        tl = token_logprobs(model, seqs, masks, precision="fp32", share_prefix=share_prefix)
    worst = 0.0
    for i, o in enumerate(outs):
        trainer = tl.logp[i][tl.mask[i]]
        assert len(trainer) == len(o.token_ids)
        worst = max(worst, (trainer - torch.tensor(o.logprobs)).abs().max().item())
    assert worst < 1e-3, worst
