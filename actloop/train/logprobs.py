"""Trainer-side log-probs of sampled tokens, with the shared prompt prefix computed once.

The episodes of a step share their system prompt and few-shot turns. We run that prefix once
(batch 1) with gradients on, broadcast its KV cache to every row, and run only each row's own
suffix; autograd sums the rows' gradients back through the broadcast, so the gradient is the
same as running every full sequence, at a fraction of the cost. Logits are computed only at
positions that predict a loss-masked token (the lm_head over a 49k vocabulary is a large part
of a small model's compute).

Layout: target j of row i is the token at absolute position P + j + 1, predicted from position
P + j, where P is the shared prefix length. `mask` marks the sampled (trained) targets; reading
a [B, S] tensor at `mask` row by row gives each trajectory's sampled tokens in order — the
"packed" per-trajectory form the update uses for old / reference / engine log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actloop.rollout.engine import autocast_context, cache_kwarg, common_prefix_len, output_cache


@dataclass
class TokenLogprobs:
    logp: torch.Tensor  # [B, S] log-prob of each target token (0 where mask is 0)
    mask: torch.Tensor  # [B, S] True where the target token is trained on
    entropy: torch.Tensor  # [B, S] policy entropy at that position (detached)
    hidden: torch.Tensor | None = None  # [N, H] hidden states at the N masked positions (for a value head)


def backbone_and_head(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model, base.lm_head


def hidden_at_targets(backbone, seqs: list[list[int]], masks: list[list[int]], precision: str = "auto",
                      share_prefix: bool = True):
    """Run the backbone; return (hidden [N, H] at positions predicting masked tokens, targets [N],
    selection (rows, cols) into [B, S], (B, S))."""
    device = next(backbone.parameters()).device
    B = len(seqs)
    first_loss = min((m.index(1) if 1 in m else len(m)) for m in masks)
    P = max(min(common_prefix_len(seqs), first_loss - 1), 0) if share_prefix else 0
    S = max(len(s) for s in seqs) - P - 1
    ids = torch.zeros((B, S), dtype=torch.long)
    attn = torch.zeros((B, P + S), dtype=torch.long)
    tgt = torch.zeros((B, S), dtype=torch.long)
    tmask = torch.zeros((B, S), dtype=torch.bool)
    attn[:, :P] = 1
    for i, (s, m) in enumerate(zip(seqs, masks)):
        n = len(s) - P - 1  # suffix inputs of row i
        ids[i, :n] = torch.tensor(s[P:-1])
        attn[i, P : P + n] = 1
        tgt[i, :n] = torch.tensor(s[P + 1 :])
        tmask[i, :n] = torch.tensor(m[P + 1 :], dtype=torch.bool)
    pos = (P + torch.arange(S))[None].expand(B, S)
    ids, attn, pos, tgt, tmask = ids.to(device), attn.to(device), pos.to(device), tgt.to(device), tmask.to(device)
    with autocast_context(precision):
        cache = None
        if P > 0:
            prefix = torch.tensor([seqs[0][:P]], device=device)
            cache = output_cache(backbone(input_ids=prefix, use_cache=True))
            cache.batch_repeat_interleave(B)
        hidden = backbone(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=cache is not None,
                          **{cache_kwarg(backbone): cache}).last_hidden_state  # [B, S, H]
    sel = tmask.nonzero(as_tuple=True)
    return hidden[sel], tgt[sel], sel, (B, S), tmask


def token_logprobs(model, seqs: list[list[int]], masks: list[list[int]], temperature: float = 1.0,
                   precision: str = "auto", share_prefix: bool = True, return_hidden: bool = False) -> TokenLogprobs:
    """seqs[i] = full token ids of trajectory i, masks[i] its loss mask (same length)."""
    backbone, head = backbone_and_head(model)
    h, tgt, sel, (B, S), tmask = hidden_at_targets(backbone, seqs, masks, precision, share_prefix)
    with autocast_context(precision):
        logits = head(h).float() / temperature  # [N, V]
    logp_all = torch.log_softmax(logits, dim=-1)
    lp = logp_all.gather(-1, tgt[:, None]).squeeze(-1)  # [N]
    with torch.no_grad():
        ent = -(logp_all.exp() * logp_all).sum(-1)
    logp = torch.zeros((B, S), device=lp.device, dtype=lp.dtype).index_put(sel, lp)
    entropy = torch.zeros((B, S), device=lp.device).index_put(sel, ent)
    return TokenLogprobs(logp=logp, mask=tmask, entropy=entropy, hidden=h if return_hidden else None)


def pack(values: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-trajectory 1-D tensors -> (padded [B, T], mask [B, T]); the packed layout."""
    T = max((len(v) for v in values), default=0)
    out = torch.zeros((len(values), T))
    mask = torch.zeros((len(values), T), dtype=torch.bool)
    for i, v in enumerate(values):
        out[i, : len(v)] = v
        mask[i, : len(v)] = True
    return out, mask


def scatter(values: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """Per-trajectory 1-D tensors -> the [B, S] layout of `mask` (a token_logprobs mask)."""
    out = torch.zeros(mask.shape, device=mask.device)
    if values:
        out[mask] = torch.cat([v.to(mask.device).float() for v in values])
    return out
