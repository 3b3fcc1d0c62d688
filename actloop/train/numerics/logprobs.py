"""Trainer-side log-probs of sampled tokens, with shared prompt prefixes computed once.

The episodes of a step share their system prompt and few-shot turns, and the G episodes of a
GRPO group share their whole prompt. We run each shared prefix once with gradients on, select
its KV cache into every row that shares it, and run only each row's own suffix; autograd sums
the rows' gradients back through the selection, so the gradient is the same as running every
full sequence, at a fraction of the cost (`prefix_plan` picks one prefix for all rows or one
per prompt, whichever runs fewer positions). Logits are computed only at positions that
predict a loss-masked token, and in chunks (`ChunkedHeadLogprob`): the lm_head over a 49k
vocabulary would otherwise hold N x 49k floats for the backward.

Layout: target j of row i is the token at absolute position P_i + j + 1, predicted from position
P_i + j, where P_i is row i's shared prefix length. `mask` marks the sampled (trained) targets;
reading a [B, S] tensor at `mask` row by row gives each trajectory's sampled tokens in order —
the "packed" per-trajectory form the update uses for old / reference / engine log-probs.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from actloop.algos.routing import routing_disagreement
from actloop.models.attention import layer_masks, mask_dtype, uncropped_cache, uses_layer_masks
from actloop.models.routing import require_routing, routing_state
from actloop.rollout import cpu_kernel
from actloop.rollout.engine import autocast_context, cache_kwarg, common_prefix_len, output_cache, use_bf16
from actloop.rollout.kv import replayable_cache


class _CheckpointedCacheNote(logging.Filter):
    """Drops transformers' "`use_cache=True` is incompatible with gradient checkpointing" (printed
    by every run): the prefix pass below asks for a cache on purpose and, under checkpointing, hands
    the layers a replayable one they keep (`_keep_cache`); nothing is lost that the note warns of."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is incompatible with gradient checkpointing" not in record.getMessage()


for _name in ("transformers.utils.generic", "transformers.modeling_layers"):
    logging.getLogger(_name).addFilter(_CheckpointedCacheNote())


@dataclass
class TokenLogprobs:
    logp: torch.Tensor  # [B, S] log-prob of each target token (0 where mask is 0)
    mask: torch.Tensor  # [B, S] True where the target token is trained on
    entropy: torch.Tensor  # [B, S] policy entropy at that position (detached)
    hidden: torch.Tensor | None = None  # [N, H] hidden states at the N masked positions (for a value head)
    # MoE with the engine's routing: share of trained tokens whose experts differ from the engine's, in the
    # forward that ran (0 under replay) and in the trainer's own router choice (what replay overrode)
    routing_disagreement: float | None = None
    router_disagreement: float | None = None


def backbone_and_head(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model, base.lm_head


def set_checkpointing(backbone, on: bool) -> None:
    """Turn transformers' per-layer gradient checkpointing on or off (non-reentrant, so frozen
    embeddings under LoRA need no input-grad hook)."""
    flag = "is_activation_checkpointing" if hasattr(type(backbone), "is_activation_checkpointing") else \
        "is_gradient_checkpointing"
    if bool(getattr(backbone, flag, False)) == on:
        return
    if hasattr(backbone, "activation_checkpointing_enable"):  # transformers >= 5.2's names
        if on:
            backbone.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            backbone.activation_checkpointing_disable()
    elif on:
        backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        backbone.gradient_checkpointing_disable()


@contextmanager
def _keep_cache(backbone, on: bool):
    """Let checkpointed decoder layers keep the cache they are given (transformers drops it unless
    a layer declares `_can_checkpoint_with_cache`); for the replayable caches only. The replay in
    the backward reuses the keywords the forward saw, so the flag is needed for the forward alone."""
    layers = [m for m in backbone.modules() if on and hasattr(type(m), "_can_checkpoint_with_cache")
              and "_can_checkpoint_with_cache" not in vars(m)]
    for m in layers:
        m._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for m in layers:
            del m._can_checkpoint_with_cache


def round_up(n: int, multiple: int) -> int:
    """n rounded up to a multiple of `multiple` (n itself for multiple <= 1)."""
    return -(-n // multiple) * multiple if multiple > 1 else n


def hidden_at_targets(backbone, seqs: list[list[int]], masks: list[list[int]], precision: str = "auto",
                      share_prefix: bool = True, checkpointing: bool = False, routing=None, replay: bool = False,
                      pad_to: int = 1):
    """Run the backbone; return (hidden [N, H] at positions predicting masked tokens, targets [N],
    selection (rows, cols) into [B, S], (B, S)).

    checkpointing=True recomputes each decoder layer in the backward. transformers drops the KV
    cache inside a checkpointed layer (a replay would append to it twice); the shared prefix then
    runs through replayable caches (`actloop.rollout.kv.replayable_cache`: an `update` that
    stores nothing twice), which the layers are told to keep. Sliding-window models (explicit
    layer masks) run every row in full under checkpointing instead.

    routing: per row, the engine's top-k expert ids of each input position ([n_i, L, k], -1 =
    unknown), for MoE models. The trainer's routing is compared with it (the last element
    returned: the shares of trained tokens routed differently in the forward that ran and by
    the trainer's own routers, or None), and replay=True forces it
    (actloop/models/routing.py). Rows then run in full (no shared prefix), one forced choice
    per position.

    pad_to: the padded lengths (the suffix's S and the shared prefix's) are rounded up to a
    multiple of it, so that a run's passes reuse a few tensor shapes (train.pad_to_multiple);
    right padding is masked out as keys and never a target, so the results do not change."""
    device = next(backbone.parameters()).device
    B = len(seqs)
    set_checkpointing(backbone, checkpointing)
    recompute = checkpointing and torch.is_grad_enabled()  # the backward re-runs each layer
    # transformers (5.19, vLLM's pin) also drops the cache of a no-grad pass through a model in training mode
    # with gradient checkpointing on: the prefix then goes through the replayable caches as well
    keep = recompute or (getattr(backbone, "gradient_checkpointing", False) and backbone.training)
    share_prefix = share_prefix and routing is None and not (recompute and uses_layer_masks(backbone))
    state = require_routing(backbone) if routing is not None else routing_state(backbone)
    P_row, prefixes, owner = prefix_plan(seqs, masks) if share_prefix else ([0] * B, [], [])
    Pmax = round_up(max((len(p) for p in prefixes), default=0), pad_to)  # causal: a right pad is seen by no real token
    S = round_up(max(max(len(s) - P - 1 for s, P in zip(seqs, P_row)), 1), pad_to)
    ids = torch.zeros((B, S), dtype=torch.long)
    attn = torch.zeros((B, Pmax + S), dtype=torch.long)
    tgt = torch.zeros((B, S), dtype=torch.long)
    tmask = torch.zeros((B, S), dtype=torch.bool)
    pos = torch.zeros((B, S), dtype=torch.long)
    for i, (s, m, P) in enumerate(zip(seqs, masks, P_row)):
        n = len(s) - P - 1  # suffix inputs of row i
        ids[i, :n] = torch.tensor(s[P:-1], dtype=torch.long)
        attn[i, :P] = 1
        attn[i, Pmax : Pmax + n] = 1
        tgt[i, :n] = torch.tensor(s[P + 1 :], dtype=torch.long)
        tmask[i, :n] = torch.tensor(m[P + 1 :], dtype=torch.bool)
        pos[i] = P + torch.arange(S)
    ids, attn, pos, tgt, tmask = ids.to(device), attn.to(device), pos.to(device), tgt.to(device), tmask.to(device)
    engine_routing = None
    if routing is not None:  # rows run in full: input j of row i is position j
        engine_routing = torch.full((B, S, state.num_layers, state.top_k), -1, dtype=torch.long)
        for i, r in enumerate(routing):
            if r is not None and len(r):
                n = min(len(r), S)
                engine_routing[i, :n] = torch.as_tensor(r[:n], dtype=torch.long)
    if state is not None:  # set for every call (a LoRA reference pass shares these modules)
        replayed = replay and engine_routing is not None
        state.forced = engine_routing.view(B * S, state.num_layers, state.top_k).to(device) if replayed else None
        state.seen = {}
    with autocast_context(precision):
        cache = None
        if Pmax > 0:
            pre = torch.zeros((len(prefixes), Pmax), dtype=torch.long)
            pre_attn = torch.zeros((len(prefixes), Pmax), dtype=torch.long)
            for k, p in enumerate(prefixes):  # right-padded; the pads are masked out as keys below
                pre[k, : len(p)] = torch.tensor(p, dtype=torch.long)
                pre_attn[k, : len(p)] = 1
            kw = {} if len(prefixes) == 1 else {"attention_mask": pre_attn.to(device)}
            pre_pos = torch.arange(Pmax, device=device).expand(len(prefixes), Pmax)
            masks_pre = layer_masks(backbone, pre_pos, pre_pos, pre_attn.to(device), mask_dtype(backbone))
            if masks_pre is not None:  # sliding-window layers: exact windows, every key kept
                kw = {"attention_mask": masks_pre, cache_kwarg(backbone): uncropped_cache(backbone)}
            if keep:  # filled by the layers (a model may not return a cache under checkpointing)
                kw[cache_kwarg(backbone)] = replayable_cache(backbone.config.num_hidden_layers)
            with _keep_cache(backbone, keep):
                out = backbone(input_ids=pre.to(device), use_cache=True, **kw)
            cache = kw[cache_kwarg(backbone)] if keep else output_cache(out)
            if len(prefixes) == 1:
                cache.batch_repeat_interleave(B)
            else:
                cache.batch_select_indices(torch.tensor(owner, device=device))
            if keep:  # what follows reads the prefix without storing into it
                cache = replayable_cache(backbone.config.num_hidden_layers, cache)
        k_pos = torch.cat([torch.arange(Pmax, device=device).expand(B, Pmax), pos], dim=1)  # [B, Pmax + S]
        masks_all = layer_masks(backbone, pos, k_pos, attn, mask_dtype(backbone))
        with _keep_cache(backbone, keep and cache is not None):
            hidden = backbone(input_ids=ids, attention_mask=attn if masks_all is None else masks_all, position_ids=pos,
                              use_cache=cache is not None,
                              **{cache_kwarg(backbone): cache}).last_hidden_state  # [B, S, H]
    disagreement = None
    if engine_routing is not None:
        used = torch.stack([state.used[i] for i in range(state.num_layers)], 1).cpu().view(B, S, state.num_layers, -1)
        own = state.take().view(B, S, state.num_layers, state.top_k).long()
        disagreement = (routing_disagreement(engine_routing, used.long(), tmask.cpu()),
                        routing_disagreement(engine_routing, own, tmask.cpu()))
    sel = tmask.nonzero(as_tuple=True)
    return hidden[sel], tgt[sel], sel, (B, S), tmask, disagreement


def prefix_plan(seqs: list[list[int]], masks: list[list[int]]) -> tuple[list[int], list[list[int]], list[int]]:
    """Which prompt prefix each row shares: (prefix length per row, the distinct prefixes, row ->
    prefix index).

    A row's prefix may reach the token before its first trained one. Two plans: one prefix common
    to every row (the system prompt and few-shot turns), or one per distinct prompt (the G rows
    of a GRPO group share theirs). The plan that runs fewer token positions, padding included,
    wins."""
    B = len(seqs)
    limits = [max((m.index(1) if 1 in m else len(m)) - 1, 0) for m in masks]
    common = min(common_prefix_len(seqs), min(limits))
    keys: dict[tuple[int, ...], int] = {}
    owner = [keys.setdefault(tuple(s[:lim]), len(keys)) for s, lim in zip(seqs, limits)]
    per_prompt = len(keys) * max(limits) + B * max(len(s) - lim for s, lim in zip(seqs, limits))
    shared = common + B * (max(len(s) for s in seqs) - common)
    if len(keys) < B and per_prompt < shared:
        return limits, [list(k) for k in keys], owner
    return [common] * B, ([seqs[0][:common]] if common > 0 else []), [0] * B


def token_logprobs(model, seqs: list[list[int]], masks: list[list[int]], temperature: float = 1.0,
                   precision: str = "auto", share_prefix: bool = True, return_hidden: bool = False,
                   chunk: int = 1024, checkpointing: bool = False, routing=None, replay: bool = False,
                   pad_to: int = 1) -> TokenLogprobs:
    """seqs[i] = full token ids of trajectory i, masks[i] its loss mask (same length); routing /
    replay: the engine's MoE routing per row, compared and optionally replayed; pad_to: lengths and
    the head's row count rounded up to a multiple of it (hidden_at_targets, head_logprobs)."""
    backbone, head = backbone_and_head(model)
    h, tgt, sel, (B, S), tmask, disagreement = hidden_at_targets(backbone, seqs, masks, precision, share_prefix,
                                                                 checkpointing, routing, replay, pad_to)
    lp, ent = head_logprobs(head, h, tgt, temperature, precision, chunk, pad_to)
    logp = torch.zeros((B, S), device=lp.device, dtype=lp.dtype).index_put(sel, lp)
    entropy = torch.zeros((B, S), device=lp.device).index_put(sel, ent)
    return TokenLogprobs(logp=logp, mask=tmask, entropy=entropy, hidden=h if return_hidden else None,
                         routing_disagreement=disagreement[0] if disagreement else None,
                         router_disagreement=disagreement[1] if disagreement else None)


def head_logprobs(head, h: torch.Tensor, tgt: torch.Tensor, temperature: float = 1.0, precision: str = "auto",
                  chunk: int = 1024, pad_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [N, H], targets [N] -> (log-prob of each target under softmax(head(h) / T) [N], with
    gradient; entropy of that distribution [N], detached).

    chunk > 0 with a plain bias-free linear head goes through `ChunkedHeadLogprob`: `chunk` rows
    of [N, V] logits at a time, nothing of size V kept for the backward (it recomputes each
    chunk's logits), so memory does not grow with N x vocabulary. chunk = 0, or another head (a
    LoRA-wrapped lm_head), takes the plain path: full [N, V] logits under autocast, kept by
    autograd for the backward. pad_to > 1 rounds N up with zero rows, cut off again (their
    gradient is zero), so the head's matmuls see a few shapes."""
    n = h.shape[0]
    if round_up(n, pad_to) > n:
        extra = round_up(n, pad_to) - n
        lp, ent = head_logprobs(head, torch.cat([h, h.new_zeros(extra, h.shape[1])]),
                                torch.cat([tgt, tgt.new_zeros(extra)]), temperature, precision, chunk)
        return lp[:n], ent[:n]
    if chunk > 0 and type(head) is torch.nn.Linear and head.bias is None:
        dtype = torch.bfloat16 if use_bf16(precision) else head.weight.dtype
        return ChunkedHeadLogprob.apply(h, head.weight, tgt, float(temperature), int(chunk), dtype)
    with autocast_context(precision):
        logits = head(h).float() / temperature  # [N, V]
    logp_all = torch.log_softmax(logits, dim=-1)
    lp = logp_all.gather(-1, tgt[:, None]).squeeze(-1)  # [N]
    with torch.no_grad():
        ent = -(logp_all.exp() * logp_all).sum(-1)
    return lp, ent


class ChunkedHeadLogprob(torch.autograd.Function):
    """log softmax(h W^T / T)[target] and the entropy, over row chunks; W [V, H] is the lm_head.

    Forward keeps h, W, targets and the log-normaliser per row; backward recomputes each chunk's
    logits z and uses d logp[t] / dz = (onehot(t) - softmax(z)) / T. When all rows fit in one
    chunk, the softmax is kept instead of recomputed (at most chunk x V floats either way) and the
    backward turns it into the gradient in place. Matmuls run in `dtype` (bf16 under mixed
    precision), softmax maths in fp32; with one chunk W's gradient is one product in W's dtype,
    with several it is summed in fp32.

    Per chunk of c rows the forward allocates two [c, V] fp32 buffers (the logits, shifted by their
    row max, and the softmax) and the backward one (the bf16 copy of the gradient): each is ~100 MB
    for 512 rows of a 49k vocabulary, and each fresh one is paid in page faults (docs/performance.md).
    bf16 logits on a CPU with AVX-512 skip all three: `cpu_kernel.head_logprob` reads the softmax's
    sums off the bf16 logits, and `cpu_kernel.head_logprob_grad_` writes the gradient over them (the
    kept or recomputed chunk), the same maths in fp32 lanes."""

    @staticmethod
    def forward(ctx, h, weight, tgt, temperature: float, chunk: int, dtype):
        step = max(chunk, 1)
        w = weight.to(dtype)
        acc = torch.promote_types(dtype, torch.float32)  # softmax maths: fp32 (fp64 in tests)
        lp, ent, lse = (torch.empty(h.shape[0], device=h.device, dtype=acc) for _ in range(3))
        p = None
        fused = None  # the kernel path (bf16 logits, AVX-512), decided on the first chunk
        for s in range(0, h.shape[0], step):  # at most two [c, V] floats alive: z and p
            z = h[s : s + step].to(dtype) @ w.T  # [c, V] in dtype
            if fused is None:
                fused = acc == torch.float32 and cpu_kernel.can_head(z)
            if fused:  # the bf16 logits are kept instead of the softmax
                lp[s : s + step], lse[s : s + step], ent[s : s + step] = cpu_kernel.head_logprob(
                    z, tgt[s : s + step], temperature)
                p = z
                continue
            z = z.to(acc)
            if temperature != 1.0:
                z.div_(temperature)
            top = z.amax(-1, keepdim=True)  # [c, 1]
            z.sub_(top)  # z - max, <= 0
            p = z.exp()  # [c, V] unnormalised
            total = p.sum(-1, keepdim=True)  # [c, 1]
            p.div_(total)  # softmax
            log_total = total.log()  # [c, 1]; log-normaliser = top + log_total
            lse[s : s + step] = (top + log_total).squeeze(-1)
            lp[s : s + step] = (z.gather(-1, tgt[s : s + step, None]) - log_total).squeeze(-1)
            ent[s : s + step] = log_total.squeeze(-1) - torch.einsum("cv,cv->c", p, z)  # -sum p log p; no [c, V] product
            del z
        ctx.save_for_backward(h, weight, tgt, lse)
        ctx.softmax = p if h.shape[0] <= step else None  # an intermediate: the backward may write into it
        ctx.temperature, ctx.step, ctx.dtype, ctx.fused = temperature, step, dtype, bool(fused)
        ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, _grad_ent):
        h, weight, tgt, lse = ctx.saved_tensors
        T, step, dtype = ctx.temperature, ctx.step, ctx.dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        kept, ctx.softmax = ctx.softmax, None  # used up here: a second backward (retain_graph) recomputes
        w = weight.to(dtype)
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = None
        one_chunk = h.shape[0] <= step
        for s in range(0, h.shape[0], step):
            hc = h[s : s + step].to(dtype)
            if ctx.fused:  # the gradient written over the kept (or recomputed) bf16 logits
                g = cpu_kernel.head_logprob_grad_(kept if kept is not None else hc @ w.T, tgt[s : s + step],
                                                  lse[s : s + step], grad_lp[s : s + step], T)
            else:
                if kept is not None:
                    g = kept.neg_()  # -softmax, in the forward's buffer
                else:  # recomputed in place: one [c, V] float buffer
                    g = (hc @ w.T).to(lse.dtype).div_(T).sub_(lse[s : s + step, None]).exp_().neg_()
                g.scatter_add_(-1, tgt[s : s + step, None], torch.ones_like(lse[s : s + step, None]))
                g.mul_(grad_lp[s : s + step, None] / T)
                g = g.to(dtype)
            if need_h:
                grad_h[s : s + step] = (g @ w).to(h.dtype)
            if need_w:
                gw = g.T @ hc  # [V, H] in dtype
                if one_chunk:
                    grad_w = gw.to(weight.dtype)
                elif grad_w is None:
                    grad_w = gw.to(lse.dtype)
                else:
                    grad_w += gw
        return grad_h, (grad_w.to(weight.dtype) if need_w else None), None, None, None, None


def pack(values: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-trajectory 1-D tensors -> (padded [B, T], mask [B, T]); the packed layout."""
    T = max((len(v) for v in values), default=0)
    out = torch.zeros((len(values), T))
    mask = torch.zeros((len(values), T), dtype=torch.bool)
    for i, v in enumerate(values):
        out[i, : len(v)] = v
        mask[i, : len(v)] = True
    return out, mask


def place(flat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """flat [N] (one value per True of `mask`, row-major) -> [B, T] in the layout of `mask`, 0
    elsewhere; differentiable. With a token_logprobs mask it puts values read at the forward's
    positions into the packed layout, or back."""
    out = torch.zeros(mask.shape, device=flat.device, dtype=flat.dtype)
    return out.index_put(mask.nonzero(as_tuple=True), flat)
