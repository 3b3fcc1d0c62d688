"""A lean no-grad forward for the HF engine's decode: the same modules and weights as the
transformers model, called layer by layer without the library's per-call machinery.

A decode step of SmolLM2-135M (30 layers, 8 rows, one new token each) spent ~40 of its ~88 ms
outside the matrix products and attention on the 2-core box: ~100 small aten ops per layer
(views, slices, casts, the seven-op RMSNorm) and the Python around them (kwarg deprecation
wrappers, output records, the mask builder, module hooks). This forward runs the same
computation with `F.rms_norm`, one boolean attention mask built once per call, and the
attention's own projections, rotary embedding, KV cache and MLP modules:

    x = embed(ids)                                                   # [B, T, H]
    per layer:  h = rms(x); q, k, v = proj(h)                         # [B, heads, T, D]
                (Qwen3: q, k = rms_head(q), rms_head(k))
                q, k = rope(q, k); k, v = cache.update(k, v)          # [B, kv_heads, L, D]
                x = x + o_proj(sdpa(q, k, v, mask))
                x = x + mlp(rms(x))
    logits = lm_head(rms(x[:, -1:]))                                  # [B, 1, V]

For a bf16 copy on an AVX-512 CPU the small operators go through actloop's kernels
(`cpu_kernel`): each residual add with the RMSNorm after it is one call (`rms_norm`, 8 torch
operators otherwise), RoPE runs in place on q and k (`rope_`, bit for bit transformers'), the
attention reads the bf16 cache (`attention`) and the projections are few-row matmuls (`linear`).
A decode step (one new token per row) of such a copy whose projections are fused
(`fuse_projections`) runs all its layers in one call of the same kernels (`_stacked_step`,
`cpu_kernel.decode_layers`): SmolLM2-135M, 8 rows, 2-core Zen 4, 27.3-36.1 -> 19.2-23.6 ms a step,
the same logits and cache bit for bit (docs/performance.md).

It applies to the dense, full-attention decoder families whose layers have exactly this shape
(`lean_supported`: Llama, Qwen2, Qwen3, Mistral without a sliding window); anything else — a
sliding-window or MoE layer, attention sinks, another architecture — keeps the transformers
forward. Tests compare logits and caches with transformers' forward on tiny random models of
each family (fp32, 1e-5), padded rows and a reused prefix included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from actloop.models import cpu_attention
from actloop.rollout import cpu_kernel
from actloop.rollout.kv import SlackLayer
from actloop.rollout.small_matmul import SmallBatchLinear, linear

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass
class LeanOutput:
    logits: torch.Tensor  # [B, 1, V]: the last position only (the engine's logits_to_keep=1)
    past_key_values: Any


def lean_supported(model: Any) -> str:
    """'' when `lean_forward` computes what the transformers forward computes for `model`, else why not."""
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in FAMILIES:
        return f"model type {kind!r} is not one of {', '.join(FAMILIES)}"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", kind != "qwen2"):
        return "sliding-window attention"
    if getattr(cfg, "_attn_implementation", "sdpa") not in ("sdpa", "eager", cpu_attention.NAME):
        return f"attention implementation {cfg._attn_implementation!r}"
    if getattr(cfg, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "rotary_emb") or not hasattr(model, "lm_head"):
        return "not a <Family>ForCausalLM with model.rotary_emb and lm_head"
    for layer in base.layers:
        a = getattr(layer, "self_attn", None)
        if a is None or not all(hasattr(a, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")):
            return "a layer without q/k/v/o projections"
        if getattr(a, "sliding_window", None):
            return "sliding-window attention"
        if not (_is_rms(layer.input_layernorm) and _is_rms(layer.post_attention_layernorm)):
            return "a layer norm that is not an RMSNorm"
        if not all(hasattr(layer.mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return "an MLP that is not gate/up/down"
    return ""


def _is_rms(mod: Any) -> bool:
    return type(mod).__name__.endswith("RMSNorm") and hasattr(mod, "variance_epsilon") and hasattr(mod, "weight")


def _rms(x: torch.Tensor, mod: Any) -> torch.Tensor:
    """transformers' RMSNorm: normalised in fp32, cast back, then scaled by the weight."""
    if x.dtype == torch.float32 and mod.weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), mod.weight, mod.variance_epsilon)
    return mod.weight * F.rms_norm(x.float(), (x.shape[-1],), None, mod.variance_epsilon).to(x.dtype)


def _add_rms(x: torch.Tensor, r: torch.Tensor | None, mod: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, rms(s)) with s = x + r (x itself when r is None): transformers' residual add and RMSNorm, in
    one kernel call for bf16 rows (`cpu_kernel.rms_norm`: 8 torch operators, 34 us, otherwise)."""
    n = x.shape[-1]
    x2, r2 = x.reshape(-1, n), None if r is None else r.reshape(-1, n)
    if cpu_kernel.can_norm(x2, mod.weight, r2):
        s, y = cpu_kernel.rms_norm(x2, mod.weight, mod.variance_epsilon, r2)
        return s.view(x.shape), y.view(x.shape)
    s = x if r is None else x + r
    return s, _rms(s, mod)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def attention_mask(mask: torch.Tensor, T: int) -> torch.Tensor:
    """mask [B, L] (1 = a real key, 0 = left padding) for T new queries at the end -> [B, 1, T, L]
    bool: query t sees key j when j is real and j <= L - T + t, and always itself, so that a
    padding query has a key (a row of the mask all False would make its output, and through
    the next layer's keys every output, NaN); nothing reads a padding position's output."""
    B, L = mask.shape
    keys = mask.bool()[:, None, None, :]  # [B, 1, 1, L]
    if T == 1:
        return keys
    j = torch.arange(L, device=mask.device)[None, :]  # [1, L]
    q = (L - T + torch.arange(T, device=mask.device))[:, None]  # [T, 1]
    return (keys & (j <= q)[None, None]) | (j == q)[None, None]  # [B, 1, T, L]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA of q [B, heads, T, D] over k, v [B, kv_heads, L, D] with a boolean mask [B, 1, T, L]. One
    bf16 query per row on the CPU: actloop's kernel (`cpu_kernel.attention`, fp32 maths over the bf16
    cache) where it is built, else SDPA in fp32. torch's bf16 flash kernel for the CPU took 829 us for
    8 rows x 9 heads x 140 keys on the 2-core Zen 4 box, 184 us cast to fp32 and back (30 layers:
    ~19 ms of a ~94 ms decode step; docs/performance.md)."""
    gqa = k.shape[1] != q.shape[1]
    if q.shape[2] == 1 and q.dtype == torch.bfloat16 and q.device.type == "cpu":
        if mask.shape[1] == 1 and cpu_kernel.can_attend(q, k, v):
            return cpu_kernel.attention(q, k, v, mask.expand(q.shape[0], 1, 1, k.shape[2])[:, 0, 0], scale)
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale,
                                              enable_gqa=gqa).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def fuse_projections(model: Any) -> int:
    """Give every layer of an engine's own copy one [q + k + v, H] weight and one [gate + up, H] weight
    whose row blocks are the projections' own weights (the modules' parameters become views into
    them, so `state_dict`, `sync_weights`, `sleep` and `wake` reach the same storage by the same
    names): `lean_forward` then runs 4 matmuls a layer instead of 7, each over more rows of W (fewer
    kernel calls and Python dispatches per decode step). Only for `lean_supported` models whose
    weights belong to the copy alone (not the trainer's, not autograd's); returns the layers fused."""
    n = 0
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        qkv, gate_up = _fuse([a.q_proj, a.k_proj, a.v_proj]), _fuse([m.gate_proj, m.up_proj])
        if qkv is not None and gate_up is not None:
            a._actloop_fused, m._actloop_fused = qkv, gate_up
            n += 1
    return n


def _fuse(mods: list[Any]) -> tuple[torch.Tensor, torch.Tensor | None, list[int]] | None:
    """(the stacked weight [sum N, K], the stacked bias or None, each module's N), the modules' weights
    (and biases) now views into them; None (nothing changed) for modules that do not stack."""
    ws = [m.weight for m in mods]
    biases = [m.bias for m in mods]
    if any(type(m) is not SmallBatchLinear for m in mods) or len({(w.dtype, w.shape[1]) for w in ws}) != 1 \
            or any(w.requires_grad for w in ws) or (any(b is None for b in biases) and any(b is not None for b in biases)):
        return None
    w = torch.cat([t.detach() for t in ws])  # [sum N, K]
    b = None if biases[0] is None else torch.cat([t.detach() for t in biases])
    sizes, start = [t.shape[0] for t in ws], 0
    for mod, size in zip(mods, sizes):
        mod.weight = torch.nn.Parameter(w[start : start + size], requires_grad=False)
        if b is not None:
            mod.bias = torch.nn.Parameter(b[start : start + size], requires_grad=False)
        start += size
    return w, b, sizes


def _proj(mod: Any, x: torch.Tensor) -> torch.Tensor:
    """mod(x) for a decode projection, straight to `linear` for the engine's SmallBatchLinears."""
    return linear(x, mod.weight, mod.bias) if type(mod) is SmallBatchLinear else mod(x)


@torch.no_grad()
def lean_forward(model: Any, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any) -> LeanOutput:
    """ids [B, T], mask [B, L] over cache + ids, pos [B, T] position ids, cache a transformers Cache
    (a new DynamicCache when None) -> logits at the last position and the cache, as
    `model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
    use_cache=True, logits_to_keep=1)` would give."""
    from transformers.cache_utils import DynamicCache

    base = model.model
    if cache is None:
        cache = DynamicCache(config=model.config)
    x = base.embed_tokens(ids)  # [B, T, H]
    cos, sin = base.rotary_emb(x, pos)  # [B, T, D]
    stacked = _stacked_step(model, x, cos, sin, mask, cache) if ids.shape[1] == 1 else None
    x, r = stacked if stacked is not None else _layers(base, x, cos, sin, mask, cache)
    _, h = _add_rms(x[:, -1:], None if r is None else r[:, -1:], base.norm)
    logits = _proj(model.lm_head, h)  # [B, 1, V]
    return LeanOutput(logits=logits, past_key_values=cache)


def _layers(base: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, cache: Any
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The decoder layers, one operator at a time: (the residual stream x [B, T, H] before the last
    layer's MLP output is added, that output r)."""
    B, T = x.shape[:2]
    rope_kernel = None  # whether cpu_kernel.rope_ takes this model's q and k (decided at the first layer)
    attn = attention_mask(mask, T)
    r = None  # the MLP output not yet added to the residual stream x (added with the next norm)
    for i, layer in enumerate(base.layers):
        a = layer.self_attn
        x, h = _add_rms(x, r, layer.input_layernorm)
        shape = (B, T, -1, a.head_dim)
        if (fused := getattr(a, "_actloop_fused", None)) is not None:  # one matmul for q, k and v
            q, k, v = linear(h, fused[0], fused[1]).split(fused[2], dim=-1)
        else:
            q, k, v = _proj(a.q_proj, h), _proj(a.k_proj, h), _proj(a.v_proj, h)
        q, k, v = q.view(shape), k.view(shape), v.view(shape)  # [B, T, heads, D]
        if hasattr(a, "q_norm"):  # Qwen3: RMSNorm over each head's D
            q, k = _rms(q, a.q_norm), _rms(k, a.k_norm)
        if rope_kernel is None:
            rope_kernel = cpu_kernel.can_rope(q, cos, sin) and cpu_kernel.can_rope(k, cos, sin)
        if rope_kernel:  # in place, before the transpose
            q, k = cpu_kernel.rope_(q, cos, sin), cpu_kernel.rope_(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
        if not rope_kernel:
            q = q * cos[:, None] + _rotate_half(q) * sin[:, None]
            k = k * cos[:, None] + _rotate_half(k) * sin[:, None]
        k, v = cache.update(k, v, i)  # [B, kv_heads, L, D]
        o = attention(q, k, v, attn, a.scaling)  # [B, heads, T, D]
        x, h = _add_rms(x, _proj(a.o_proj, o.transpose(1, 2).reshape(B, T, -1)), layer.post_attention_layernorm)
        m = layer.mlp
        if (fused := getattr(m, "_actloop_fused", None)) is not None:  # one matmul for gate and up
            gate, up = linear(h, fused[0], fused[1]).split(fused[2], dim=-1)
        else:
            gate, up = _proj(m.gate_proj, h), _proj(m.up_proj, h)
        r = _proj(m.down_proj, m.act_fn(gate) * up)
    return x, r


@dataclass(frozen=True)
class _Stack:
    """What `cpu_kernel.decode_layers` needs of a model, checked once (`_stack`)."""

    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float


def _addr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _bf16(*ts: torch.Tensor | None) -> bool:
    return all(t is None or (t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous()) for t in ts)


def _stack(model: Any) -> _Stack | None:
    """The shapes `cpu_kernel.decode_layers` runs every layer of `model` with, or None when a layer
    is not of its one shape: q/k/v and gate/up fused (`fuse_projections`), bf16 contiguous weights,
    no per-head norm (Qwen3), SiLU, one eps and one attention scale; and the kernel built."""
    layers = model.model.layers
    a0 = layers[0].self_attn
    qkv0, gu0 = getattr(a0, "_actloop_fused", None), getattr(layers[0].mlp, "_actloop_fused", None)
    if qkv0 is None or gu0 is None or len(qkv0[2]) != 3 or len(gu0[2]) != 2:
        return None
    D = a0.head_dim
    spec = _Stack(qkv0[2][0] // D, qkv0[2][1] // D, D, gu0[2][0], float(layers[0].input_layernorm.variance_epsilon),
                  float(a0.scaling))
    if D > cpu_kernel.MAX_HEAD_DIM or D % 2 or spec.kv_heads == 0 or spec.heads % spec.kv_heads:
        return None
    qkv_sizes = [spec.heads * D, spec.kv_heads * D, spec.kv_heads * D]  # every layer's fused row blocks
    gu_sizes = [spec.intermediate, spec.intermediate]
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        qkv, gu = getattr(a, "_actloop_fused", None), getattr(m, "_actloop_fused", None)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if qkv is None or gu is None or list(qkv[2]) != qkv_sizes or list(gu[2]) != gu_sizes \
                or hasattr(a, "q_norm") or type(m.act_fn).__name__ not in ("SiLUActivation", "SiLU") \
                or type(a.o_proj) is not SmallBatchLinear or type(m.down_proj) is not SmallBatchLinear \
                or not _bf16(qkv[0], qkv[1], gu[0], gu[1], a.o_proj.weight, a.o_proj.bias, m.down_proj.weight,
                             m.down_proj.bias, *(n.weight for n in norms)) \
                or any(float(n.variance_epsilon) != spec.eps for n in norms) or float(a.scaling) != spec.scale:
            return None
    return spec if cpu_kernel.load("decode_layers_bf16") is not None else None


def _stacked_step(model: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, cache: Any
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A decode step's layers in one `cpu_kernel.decode_layers` call: (x, r) as `_layers` returns
    them, the new keys and values written into the cache's spare column; None (nothing done) when
    the step does not qualify: a model `_stack` refuses, more than `cpu_kernel.MAX_ROWS_STACKED` rows,
    a cache other than `SlackLayer`s of bf16 [B, kv_heads, *, D] with one length."""
    if "_actloop_stack" not in model.__dict__:  # the engine's copy does not change shape: checked once
        model.__dict__["_actloop_stack"] = _stack(model)
    spec = model.__dict__["_actloop_stack"]
    B, _, H = x.shape
    layers = getattr(cache, "layers", None)
    if spec is None or not 0 < B <= cpu_kernel.MAX_ROWS_STACKED or not layers \
            or len(layers) != len(model.model.layers) or x.dtype != torch.bfloat16 \
            or cos.shape != (B, 1, spec.head_dim) or sin.shape != cos.shape or cos.stride() != sin.stride() \
            or cos.dtype != torch.bfloat16 or sin.dtype != torch.bfloat16 or cos.stride(-1) != 1:
        return None
    n = layers[0].get_seq_length()
    kv_shape = (B, spec.kv_heads)
    for layer in layers:
        if type(layer) is not SlackLayer or layer._k is None or layer._v is None or layer._n_k != n \
                or layer._n_v != n or tuple(layer._k.shape[:2]) != kv_shape or tuple(layer._v.shape[:2]) != kv_shape \
                or layer._k.shape[-1] != spec.head_dim or layer._v.shape[-1] != spec.head_dim \
                or layer._k.dtype != torch.bfloat16 or layer._v.dtype != torch.bfloat16 \
                or layer._k.stride(-1) != 1 or layer._v.stride(-1) != 1:
            return None
    if tuple(mask.shape) != (B, n + 1):
        return None
    for layer in layers:
        layer.reserve(1)
    caches = torch.tensor([[layer._k.data_ptr(), layer._v.data_ptr(), *layer._k.stride()[:3], *layer._v.stride()[:3]]
                           for layer in layers], dtype=torch.int64)
    weights = torch.tensor([[layer.input_layernorm.weight.data_ptr(), layer.self_attn._actloop_fused[0].data_ptr(),
                             _addr(layer.self_attn._actloop_fused[1]), layer.self_attn.o_proj.weight.data_ptr(),
                             _addr(layer.self_attn.o_proj.bias), layer.post_attention_layernorm.weight.data_ptr(),
                             layer.mlp._actloop_fused[0].data_ptr(), _addr(layer.mlp._actloop_fused[1]),
                             layer.mlp.down_proj.weight.data_ptr(), _addr(layer.mlp.down_proj.bias)]
                            for layer in model.model.layers], dtype=torch.int64)
    x2 = x.reshape(B, H).contiguous()
    keep = mask.bool().to(torch.uint8).contiguous()
    r = cpu_kernel.decode_layers(x2, weights, caches, cos[:, 0], sin[:, 0], keep, spec.heads, spec.kv_heads,
                                 spec.head_dim, spec.intermediate, spec.eps, spec.scale)
    for layer in layers:
        layer.advance(1)
    return x2.view(B, 1, H), r.view(B, 1, H)
