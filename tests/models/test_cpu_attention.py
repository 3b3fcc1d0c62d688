"""`actloop_sdpa` (actloop/models/cpu_attention.py): the matmul path for small score tensors computes
what SDPA computes — outputs and gradients — and hands everything else to transformers' SDPA."""

import pytest
import torch
import torch.nn.functional as F

from actloop.models import cpu_attention
from actloop.models.attention import choose_attn_implementation
from actloop.train.numerics.logprobs import token_logprobs


def _inputs(dtype, B=3, Hq=6, Hkv=2, S=5, L=9, D=8):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hq, S, D, generator=g).to(dtype).requires_grad_()
    k = torch.randn(B, Hkv, L, D, generator=g).to(dtype).requires_grad_()
    v = torch.randn(B, Hkv, L, D, generator=g).to(dtype).requires_grad_()
    keep = torch.ones(B, 1, S, L, dtype=torch.bool).tril(L - S)  # causal over the last S keys
    keep[1, :, :, :2] = False  # row 1: two padded keys
    return q, k, v, keep


class _Module:  # what transformers passes as `module`
    num_key_value_groups = 3
    is_causal = True


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("masked", [True, False])
def test_small_scores_match_sdpa_forward_and_backward(dtype, tol, masked):
    q, k, v, keep = _inputs(dtype)
    mask = keep if masked else None
    got, _ = cpu_attention.small_attention(_Module(), q, k, v, mask, scaling=0.3)  # [B, S, Hq, D]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=keep if masked else keep[:1], scale=0.3,
                                          enable_gqa=True).transpose(1, 2)
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    mine = torch.autograd.grad(got, (q, k, v), grad)
    ref = torch.autograd.grad(want, (q, k, v), grad)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, atol=tol * 4, rtol=tol * 4)


def test_large_scores_and_float_masks_go_to_sdpa(monkeypatch):
    import transformers.integrations.sdpa_attention as sdpa_mod

    calls = []
    real = sdpa_mod.sdpa_attention_forward
    monkeypatch.setattr(sdpa_mod, "sdpa_attention_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, keep = _inputs(torch.float32)
    cpu_attention.small_attention(_Module(), q, k, v, keep)
    assert calls == []
    cpu_attention.small_attention(_Module(), q, k, v, torch.zeros(keep.shape).masked_fill(~keep, -1e9))  # additive
    monkeypatch.setattr(cpu_attention, "MAX_SCORES", 3 * 6 * 5 * 9 - 1)
    cpu_attention.small_attention(_Module(), q, k, v, keep)
    assert calls == [1, 1]


def test_a_model_trains_the_same_with_it_as_with_sdpa(monkeypatch):
    """Log-probs and every parameter's gradient of a tiny Llama, shared prompt prefix and padded
    suffixes included, under `actloop_sdpa` and under `sdpa` (fp32)."""
    import transformers.integrations.sdpa_attention as sdpa_mod
    from transformers import LlamaConfig, LlamaForCausalLM

    calls = []
    real = sdpa_mod.sdpa_attention_forward
    monkeypatch.setattr(sdpa_mod, "sdpa_attention_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    prompt = [3, 9, 4, 11, 7, 2]
    seqs = [prompt + [5, 6, 7], prompt + [8, 9], [1, 2, 3] + [4, 5, 6, 7]]
    masks = [[0] * 6 + [1] * 3, [0] * 6 + [1] * 2, [0] * 3 + [1] * 4]
    results = []
    for impl in ("sdpa", choose_attn_implementation("actloop_sdpa", cfg)):
        model.config._attn_implementation = impl
        model.zero_grad()
        out = token_logprobs(model, seqs, masks, precision="fp32")
        out.logp.sum().backward()
        results.append((out.logp.detach(), [p.grad.clone() for p in model.parameters()], len(calls)))
        calls.clear()
    (lp_a, g_a, sdpa_calls), (lp_b, g_b, fallbacks) = results
    assert bool(lp_a.ne(0).any()) and fallbacks == 0  # every layer took the matmul path
    torch.testing.assert_close(lp_b, lp_a, atol=1e-5, rtol=1e-5)
    for a, b in zip(g_a, g_b):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    monkeypatch.setattr(cpu_attention, "MAX_SCORES", 0)  # the model does call it: now every layer falls back
    token_logprobs(model, seqs, masks, precision="fp32")
    assert len(calls) == 2 * cfg.num_hidden_layers  # the prefix pass and the suffix pass
