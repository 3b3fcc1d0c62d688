"""Tokens in, tokens out: the trainer's recomputed log-probs of a just-sampled trajectory
match the engine's (on-policy ratio 1 up to numerical noise)."""

import pytest
import torch

from actloop.tasks.calculator import CalculatorEnv, make_splits
from actloop.rollout.engine import HFEngine, SamplingParams, common_prefix_len, sample_next
from actloop.rollout.episodes import run_episodes
from actloop.rollout.renderer import Renderer
from actloop.train.numerics.logprobs import token_logprobs

# fp32 engine vs fp32 trainer: same weights, different batch shapes and kernels (KV-cached decode
# vs one pass over the suffix). Measured max |diff| ~1e-5; we allow 1e-3 on any token.
FP32_TOL = 1e-3


# 48 new tokens: enough for the embedded model to finish a calculator tool call (about 32 tokens)
# and get a second turn; with 24 no episode ever reached one, and the multi-turn checks compared nothing
MULTI_TURN_TOKENS = 48


def _sampled(fp32_model, tokenizer, n=4, precision="fp32", weights="live", seed=0, max_new_tokens=MULTI_TURN_TOKENS):
    torch.manual_seed(seed)
    r = Renderer(tokenizer)
    engine = HFEngine(fp32_model, tokenizer, r.eos_token_ids, r.stop_strings, precision=precision, weights=weights)
    _, held = make_splits(0, n, seed=0)
    trajs = run_episodes(engine, r, CalculatorEnv, held, SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0),
                         max_turns=2)
    return r, engine, trajs


def _compare(model, trajs, precision="fp32"):
    seqs = [t.input_ids for t in trajs]
    masks = [t.loss_mask for t in trajs]
    with torch.no_grad():
        out = token_logprobs(model, seqs, masks, temperature=1.0, precision=precision)
    diffs = []
    for i, t in enumerate(trajs):
        engine_lp = torch.tensor([lp for lp, m in zip(t.logprobs[1:], t.loss_mask[1:]) if m])
        P = len(t.input_ids) - 1 - out.mask.shape[1]
        trainer_lp = out.logp[i][out.mask[i]]
        assert len(engine_lp) == len(trainer_lp) == sum(t.loss_mask), (P, len(engine_lp), len(trainer_lp))
        diffs.append((engine_lp - trainer_lp).abs())
    return torch.cat(diffs)


@pytest.mark.slow
def test_trainer_logprobs_match_engine_fp32(fp32_model, tokenizer):
    _, _, trajs = _sampled(fp32_model, tokenizer)
    assert sum(t.num_response_tokens for t in trajs) > 20
    # multi-turn episodes are among those compared: a tool call executed, its result appended (mask 0)
    # and a second assistant turn sampled after it
    multi = [t for t in trajs if len(t.turns) > 1 and t.num_tool_calls > 0]
    assert multi, [(len(t.turns), t.num_tool_calls) for t in trajs]
    assert all(t.turns[1].token_ids and t.turns[0].env_ids for t in multi)
    diff = _compare(fp32_model, trajs)
    assert float(diff.max()) < FP32_TOL, f"max |engine - trainer| log-prob = {float(diff.max()):.2e}"
    ratio = torch.exp(diff)
    assert float(ratio.max()) < 1 + FP32_TOL


@pytest.mark.slow
def test_multi_turn_episode_has_masked_env_tokens(fp32_model, tokenizer):
    _, _, trajs = _sampled(fp32_model, tokenizer, n=6)
    multi = [t for t in trajs if len(t.turns) > 1]
    assert len(multi) >= 2, [len(t.turns) for t in trajs]  # the check below must see some
    for t in multi:
        assert t.turns[0].env_ids and 0 in t.loss_mask[len(t.prompt_ids):]


@pytest.mark.slow
def test_bf16_engine_copy_mismatch_is_small(fp32_model, tokenizer):
    """The default engine keeps a bf16 copy; its log-probs drift from the fp32 trainer's by
    rounding only. Mean |diff| is ~1e-2 here; a broken copy (stale or wrong weights) is >> 0.1."""
    _, _, trajs = _sampled(fp32_model, tokenizer, precision="bf16", weights="copy")
    diff = _compare(fp32_model, trajs)
    assert float(diff.mean()) < 0.1


def test_stop_string_and_eos_cut_rows(tokenizer):
    r = Renderer(tokenizer)
    engine = HFEngine.__new__(HFEngine)
    engine.tokenizer, engine.stop_strings, engine.eos_token_ids = tokenizer, r.stop_strings, r.eos_token_ids
    ids = r.encode('<tool_call>{"name": "c", "arguments": {}}</tool_call> more')
    assert engine._hit_stop(ids) and not engine._hit_stop(r.encode("<tool_call>{"))


def test_common_prefix_and_sampling():
    assert common_prefix_len([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    logits = torch.tensor([[0.0, 10.0, 0.0], [10.0, 0.0, 0.0]])
    tok, lp = sample_next(logits, SamplingParams(greedy=True))
    assert tok.tolist() == [1, 0]
    torch.manual_seed(0)
    tok, lp = sample_next(torch.tensor([[0.0, 0.0]]).repeat(2000, 1), SamplingParams(temperature=1.0))
    assert 0.45 < tok.float().mean() < 0.55 and torch.allclose(lp, torch.full((2000,), -0.6931), atol=1e-4)
    tok, _ = sample_next(torch.tensor([[5.0, 4.0, -5.0]]).repeat(500, 1), SamplingParams(top_p=0.5))
    assert set(tok.tolist()) == {0}  # nucleus keeps only the top token here


def _tiny_lora():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=53, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                                               "down_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)  # peft starts B at 0 (delta 0): make the adapter matter
    return model


def _engine_vs_trainer(policy, engine, prompts):
    torch.manual_seed(1)
    comps = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0))
    seqs = [p + list(c.token_ids) for p, c in zip(prompts, comps)]
    masks = [[0] * len(p) + [1] * len(c.token_ids) for p, c in zip(prompts, comps)]
    with torch.no_grad():
        out = token_logprobs(policy, seqs, masks, 1.0, "fp32")
    return max(float((torch.tensor(c.logprobs) - out.logp[i][out.mask[i]]).abs().max()) for i, c in enumerate(comps))


def test_lora_engine_copy_is_the_merged_policy_and_follows_sync():
    from peft.tuners.lora import LoraLayer

    policy = _tiny_lora()
    engine = HFEngine(policy, None, eos_token_ids=(), precision="fp32", weights="copy")
    assert not any(isinstance(m, LoraLayer) for m in engine.model.modules())  # plain layers, adapter merged
    prompts = [[5, 6, 7, 8], [5, 6, 9], [5, 6, 7, 1, 2]]
    assert _engine_vs_trainer(policy, engine, prompts) < 1e-4
    with torch.no_grad():  # an "update": only the adapter moves
        for n, p in policy.named_parameters():
            if "lora_" in n:
                p.add_(torch.randn_like(p) * 0.3)
    assert _engine_vs_trainer(policy, engine, prompts) > 1e-3  # stale until synced
    engine.sync_weights(policy)
    assert _engine_vs_trainer(policy, engine, prompts) < 1e-4
