"""`actloop_sdpa`: transformers' SDPA attention, with a plain matmul path for small score tensors.

On the CPU, torch's flash-attention kernel for bf16 is slow for the short sequences of a GRPO step:
its backward took three times as long as the same attention written as two matmuls and an fp32
softmax on the benchmark update's shapes (docs/performance.md). The matmul path materialises the
[B, Hq, S, L] scores (and keeps the probabilities for the backward), so it is taken only while
B x Hq x S x L <= `MAX_SCORES` (2^20: the probabilities kept for the backward are 2 MB a layer at
most in bf16, 60 MB over SmolLM2's 30 layers; the benchmark's update is 0.85M); longer sequences
keep SDPA's kernel, which never holds an L x L matrix (`benchmarks/memory_vs_length.py`).

    scores = q k^T * scale          # [B, Hkv, g, S, L], g = Hq / Hkv query heads per KV head
    scores[~mask] = finfo.min       # masked keys (a query with none left gets a uniform row: a pad)
    out = softmax(scores) v         # [B, S, Hq, D], as transformers' sdpa_attention_forward returns

The scores stay in the matmul's dtype: a bf16 product is already rounded to bf16, and torch's CPU
softmax sums a bf16 row in fp32 and rounds its output once, so the probabilities are those of an
fp32 softmax over the same scores (bit for bit in all but ~1e-5 of them), without the fp32 copy of
the scores and the fp32 softmax output the backward used to keep (~115 MB and ~0.1 s of page faults
and copies in the benchmark's update, docs/performance.md); its backward then reads the bf16
probabilities. The scale is applied in bf16, as transformers' eager attention does (exact for a
power-of-two scale such as SmolLM2's 1/8).

It is what `train.attn_implementation=auto` loads on a CPU for a model without attention sinks
(actloop/models/attention.py). Anything it does not take — dropout, a soft cap, an additive (float)
mask, per-head masks, large scores, CUDA tensors — goes to transformers' own `sdpa_attention_forward`.
"""

from __future__ import annotations

import torch

NAME = "actloop_sdpa"
MAX_SCORES = 2**20

_registered = False


def small_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                    is_causal: bool | None = None, **kwargs):
    """transformers' attention-function signature: query [B, Hq, S, D], key / value [B, Hkv, L, D],
    attention_mask bool [B or 1, 1, S, L] (True: attend) or None (causal) -> ([B, S, Hq, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, Hq, S, D = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    mask_ok = attention_mask is None or (attention_mask.dtype == torch.bool and attention_mask.dim() == 4
                                         and attention_mask.shape[1] == 1)
    if (dropout or kwargs.get("softcap") is not None or Hq % Hkv or not mask_ok or query.device.type != "cpu"
            or B * Hq * S * L > MAX_SCORES):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    g = Hq // Hkv
    scale = scaling if scaling is not None else D**-0.5
    scores = torch.matmul(query.reshape(B, Hkv, g * S, D), key.transpose(-1, -2)).view(B, Hkv, g, S, L)
    if attention_mask is None:  # causal: the S queries are the last S of the L keys
        keep = torch.ones((S, L), dtype=torch.bool, device=query.device).tril(L - S)  # [S, L]
    else:
        keep = attention_mask.unsqueeze(2)  # [B or 1, 1, 1, S, L]
    # in the scores' own dtype: torch's CPU softmax sums a bf16 tensor in fp32 and rounds its output once
    scores = scores.mul_(scale).masked_fill_(~keep, torch.finfo(scores.dtype).min)  # [B, Hkv, g, S, L]
    probs = torch.softmax(scores, -1).to(value.dtype).view(B, Hkv, g * S, L)
    out = torch.matmul(probs, value).view(B, Hq, S, D)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make `NAME` loadable as an `attn_implementation` (its masks are SDPA's boolean ones); returns NAME."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(NAME, small_attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True
    return NAME
