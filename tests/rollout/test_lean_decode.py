"""The lean decode forward against transformers' own forward, on tiny random models of each family."""

import pytest
import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config,
                          Qwen3MoeConfig)
from transformers.cache_utils import DynamicCache

from actloop.rollout import cpu_kernel
from actloop.rollout.lean_decode import attention, attention_mask, fuse_projections, lean_forward, lean_supported
from actloop.rollout.small_matmul import use_small_batch_linears

_COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=True)


def _model(cls, **kw):
    torch.manual_seed(0)
    cfg = cls(**{**_COMMON, **kw})
    cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(cfg).eval()


FAMILIES = {
    "llama": lambda: _model(LlamaConfig),
    "llama-bias-rope-scaling": lambda: _model(LlamaConfig, attention_bias=True,
                                              rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen2": lambda: _model(Qwen2Config),
    "qwen3": lambda: _model(Qwen3Config, head_dim=16),
    "mistral": lambda: _model(MistralConfig, sliding_window=None),
}


def _hf(model, ids, mask, pos, cache):
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                logits_to_keep=1)
    return out.logits, out.past_key_values


def _copy(cache):
    return DynamicCache([(layer.keys.clone(), layer.values.clone()) for layer in cache.layers])


@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.no_grad()
def test_prefill_and_padded_decode_match_transformers(family):
    model = FAMILIES[family]()
    assert lean_supported(model) == "", lean_supported(model)
    g = torch.Generator().manual_seed(1)
    # prefill one row of 7 tokens after a cached 5-token prefix
    prefix = torch.randint(0, 97, (1, 5), generator=g)
    _, cache = _hf(model, prefix, torch.ones(1, 5, dtype=torch.long), torch.arange(5)[None], None)
    suffix = torch.randint(0, 97, (1, 7), generator=g)
    args = (suffix, torch.ones(1, 12, dtype=torch.long), torch.arange(5, 12)[None])
    ref_logits, ref_cache = _hf(model, *args, _copy(cache))
    logits = lean_forward(model, *args, _copy(cache)).logits
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    # a batch of 3 left-padded rows (2, 0 and 4 pads), prefilled without a cache, then 3 decode steps
    lens = [6, 8, 4]
    L = max(lens)
    ids = torch.zeros((3, L), dtype=torch.long)
    mask = torch.zeros((3, L), dtype=torch.long)
    pos = torch.zeros((3, L), dtype=torch.long)
    for i, n in enumerate(lens):
        ids[i, L - n:] = torch.randint(1, 97, (n,), generator=g)
        mask[i, L - n:] = 1
        pos[i, L - n:] = torch.arange(n)
    ref_logits, ref_cache = _hf(model, ids, mask, pos, None)
    out = lean_forward(model, ids, mask, pos, None)
    lean_cache = out.past_key_values
    for i, n in enumerate(lens):  # the padded positions' outputs are never read; the rows' last ones are
        torch.testing.assert_close(out.logits[i], ref_logits[i], atol=1e-5, rtol=1e-5)
    next_pos = torch.tensor([[n] for n in lens])
    for _ in range(3):
        tok = out.logits[:, -1].argmax(-1, keepdim=True)  # [3, 1]
        mask = torch.cat([mask, torch.ones((3, 1), dtype=torch.long)], 1)
        ref_logits, ref_cache = _hf(model, tok, mask, next_pos, ref_cache)
        out = lean_forward(model, tok, mask, next_pos, lean_cache)
        lean_cache = out.past_key_values
        torch.testing.assert_close(out.logits, ref_logits, atol=1e-5, rtol=1e-5)
        for a, b in zip(lean_cache.layers, ref_cache.layers):
            real = mask[:, :, None].bool()  # [3, L, 1]: compare the real keys only
            for x, y in ((a.keys, b.keys), (a.values, b.values)):
                torch.testing.assert_close(x.transpose(1, 2)[real[..., 0]], y.transpose(1, 2)[real[..., 0]],
                                           atol=1e-5, rtol=1e-5)
        next_pos = next_pos + 1


@torch.no_grad()
def test_it_matches_with_the_engines_small_batch_linears_and_in_bf16():
    model = FAMILIES["qwen3"]()
    ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(2))
    mask, pos = torch.ones_like(ids), torch.arange(6).expand(2, 6)
    ref, _ = _hf(model, ids, mask, pos, None)
    use_small_batch_linears(model)  # the engine's fp32 copy: the AVX2 kernel where it builds
    torch.testing.assert_close(lean_forward(model, ids, mask, pos, None).logits, ref, atol=1e-4, rtol=1e-4)
    model.to(torch.bfloat16)
    ref16, _ = _hf(model, ids, mask, pos, None)
    out16 = lean_forward(model, ids, mask, pos, DynamicCache(config=model.config))
    lean16 = out16.logits
    assert lean16.dtype == torch.bfloat16
    torch.testing.assert_close(lean16.float(), ref16.float(), atol=0.05, rtol=0.02)
    # a bf16 decode step (one query per row: the fp32 attention path and the bf16 kernel's rows)
    nxt = lean16[:, -1].argmax(-1)[:, None]  # [2, 1]
    mask2, pos2 = torch.ones((2, 7), dtype=torch.long), torch.full((2, 1), 6)
    step_ref, _ = _hf(model, torch.cat([ids, nxt], 1), mask2, torch.arange(7).expand(2, 7), None)
    step16 = lean_forward(model, nxt, mask2, pos2, out16.past_key_values).logits
    torch.testing.assert_close(step16.float(), step_ref.float(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("D", [16, 24])  # 24: a head_dim that is not a multiple of the kernel's 16 lanes
def test_one_bf16_query_attends_in_fp32_as_sdpa_does(kernel, D, monkeypatch):
    if kernel and not cpu_kernel.can_attend(*(torch.zeros(1, 2, 1, 16, dtype=torch.bfloat16),) * 3):
        pytest.skip(f"the bf16 decode attention kernel is unavailable here: {cpu_kernel.reason('attention_bf16')}")
    calls = []
    real = cpu_kernel.attention
    monkeypatch.setattr(cpu_kernel, "attention", lambda *a: calls.append(1) or real(*a))
    if not kernel:
        monkeypatch.setattr(cpu_kernel, "can_attend", lambda *a: False)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 1, 6, D, generator=g).bfloat16().transpose(1, 2)  # [B, heads, 1, D], as the forward's view
    k, v = (torch.randn(3, 2, 12, D, generator=g).bfloat16()[:, :, :9] for _ in range(2))  # a slack buffer's columns
    mask = attention_mask(torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 9, [0] * 8 + [1]]), 1)  # left padding
    got = attention(q, k, v, mask, 0.25)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 6, 1, D) and len(calls) == int(kernel)
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask,
                                                            scale=0.25, enable_gqa=True)
    torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=2 ** -7)
    # the padded keys of row 0 do not count: its output is the same without them
    alone = attention(q[:1], k[:1, :, 2:], v[:1, :, 2:], torch.ones((1, 1, 1, 7), dtype=torch.bool), 0.25)
    torch.testing.assert_close(got[:1], alone, atol=1e-2, rtol=2 ** -7)


@pytest.mark.parametrize("family", ["llama", "qwen2", "llama-bias-rope-scaling"])  # qwen2: q/k/v biases
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_fused_projections_compute_what_the_separate_ones_do(family, dtype):
    """An engine copy's q/k/v and gate/up stacked into one weight each: the same logits and cache, the
    same state_dict names, and a write through a module's weight lands in the stacked one."""
    import copy

    model = FAMILIES[family]().to(dtype).requires_grad_(False)  # as the engine's copy
    use_small_batch_linears(model)
    fused = copy.deepcopy(model)
    assert fuse_projections(fused) == 2
    assert list(fused.state_dict()) == list(model.state_dict())
    ids = torch.randint(0, 97, (3, 5), generator=torch.Generator().manual_seed(4))
    mask, pos = torch.ones_like(ids), torch.arange(5).expand(3, 5)
    want, got = lean_forward(model, ids, mask, pos, None), lean_forward(fused, ids, mask, pos, None)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
    torch.testing.assert_close(got.logits, want.logits, **tol)
    step = torch.tensor([[1], [2], [3]])  # a decode step: one row each, the kernel path
    w2 = lean_forward(model, step, torch.ones((3, 6)), torch.full((3, 1), 5), want.past_key_values).logits
    g2 = lean_forward(fused, step, torch.ones((3, 6)), torch.full((3, 1), 5), got.past_key_values).logits
    torch.testing.assert_close(g2, w2, **tol)
    a = fused.model.layers[1].self_attn
    a.k_proj.weight.copy_(torch.ones_like(a.k_proj.weight))  # what sync_weights does, by name
    w, _, sizes = a._actloop_fused
    assert bool((w[sizes[0] : sizes[0] + sizes[1]] == 1).all()) and not bool((w[: sizes[0]] == 1).all())


def test_models_it_does_not_cover_say_why():
    sliding = _model(MistralConfig, sliding_window=4)
    assert "sliding" in lean_supported(sliding)
    moe = _model(Qwen3MoeConfig, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    assert "qwen3_moe" in lean_supported(moe)


def test_the_mask_is_causal_over_the_new_queries_and_hides_padding():
    m = attention_mask(torch.tensor([[0, 1, 1, 1]]), 2)  # 1 pad, 1 cached key, 2 new queries
    assert m.shape == (1, 1, 2, 4)
    assert m[0, 0].tolist() == [[False, True, True, False], [False, True, True, True]]
    pads = attention_mask(torch.tensor([[0, 0, 1]]), 3)  # a padded query still sees itself (no NaN rows)
    assert pads[0, 0].tolist() == [[True, False, False], [False, True, False], [False, False, True]]
    assert attention_mask(torch.tensor([[0, 1, 1]]), 1)[0, 0].tolist() == [[False, True, True]]


def _need(name):
    if cpu_kernel.load(name) is None:
        pytest.skip(f"the {name} kernel is unavailable here: {cpu_kernel.reason(name)}")


@pytest.mark.parametrize("D", [64, 40])  # 40: half a head is not a multiple of the kernel's 16 lanes
def test_the_rope_kernel_is_transformers_rope_bit_for_bit(D):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    _need("rope_bf16")
    g = torch.Generator().manual_seed(0)
    B, T, Hq, Hkv = 3, 4, 6, 2
    qkv = (torch.randn(B, T, (Hq + 2 * Hkv) * D, generator=g) * 4).bfloat16()  # a fused projection's output
    q, k = qkv[..., : Hq * D].view(B, T, Hq, D), qkv[..., Hq * D : (Hq + Hkv) * D].view(B, T, Hkv, D)
    angle = (torch.arange(T)[None, :, None] + 5 * torch.arange(B)[:, None, None]) * torch.rand(D // 2, generator=g)
    cos, sin = torch.cat([angle, angle], -1).cos().bfloat16(), torch.cat([angle, angle], -1).sin().bfloat16()
    want_q, want_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [B, heads, T, D]
    assert cpu_kernel.can_rope(q, cos, sin) and cpu_kernel.can_rope(k, cos, sin)
    cpu_kernel.rope_(q, cos, sin)
    cpu_kernel.rope_(k, cos, sin)
    assert torch.equal(q.transpose(1, 2), want_q) and torch.equal(k.transpose(1, 2), want_k)
    assert not cpu_kernel.can_rope(q, cos[..., : D // 2], sin[..., : D // 2])  # a partial rotary: torch's path


@pytest.mark.parametrize("n", [64, 40])
def test_the_norm_kernel_is_the_residual_add_and_rmsnorm_in_bf16(n):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    _need("rms_norm_bf16")
    g = torch.Generator().manual_seed(1)
    norm = LlamaRMSNorm(n, eps=1e-6).to(torch.bfloat16)
    norm.weight.data = (torch.rand(n, generator=g) + 0.5).bfloat16()
    x = (torch.randn(4, 3, n, generator=g) * 3).bfloat16()[:, -1]  # [4, n], rows 3n apart (a last position)
    r = torch.randn(4, n, generator=g).bfloat16()
    s, y = cpu_kernel.rms_norm(x, norm.weight, norm.variance_epsilon, r)
    assert torch.equal(s, x + r)
    with torch.no_grad():
        want = norm(x + r)
    # the same bf16 up to the order of the fp32 sum of squares: at most one rounding step apart
    assert (y != want).float().mean() < 0.02
    torch.testing.assert_close(y.float(), want.float(), atol=0, rtol=2 ** -7)
    s0, y0 = cpu_kernel.rms_norm(x, norm.weight, norm.variance_epsilon)
    assert s0 is x
    with torch.no_grad():
        torch.testing.assert_close(y0.float(), norm(x).float(), atol=0, rtol=2 ** -7)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@torch.no_grad()
def test_a_bf16_forward_through_the_norm_and_rope_kernels_matches_torchs(family, monkeypatch):
    _need("rms_norm_bf16")
    _need("rope_bf16")
    model = FAMILIES[family]().to(torch.bfloat16).requires_grad_(False)
    ids = torch.randint(0, 97, (3, 5), generator=torch.Generator().manual_seed(4))
    mask, pos = torch.ones_like(ids), torch.arange(5).expand(3, 5)
    calls = {"rms_norm": 0, "rope_": 0}
    for name in calls:
        real = getattr(cpu_kernel, name)
        monkeypatch.setattr(cpu_kernel, name, lambda *a, _r=real, _n=name: calls.__setitem__(_n, calls[_n] + 1) or _r(*a))
    got = lean_forward(model, ids, mask, pos, None)
    step = lean_forward(model, torch.tensor([[1], [2], [3]]), torch.ones((3, 6)), torch.full((3, 1), 5),
                        got.past_key_values).logits
    assert calls == {"rms_norm": 2 * (2 * 2 + 1), "rope_": 2 * 2 * 2}  # 2 norms a layer + the final one; q and k
    monkeypatch.setattr(cpu_kernel, "can_norm", lambda *a: False)
    monkeypatch.setattr(cpu_kernel, "can_rope", lambda *a: False)
    want = lean_forward(model, ids, mask, pos, None)
    want_step = lean_forward(model, torch.tensor([[1], [2], [3]]), torch.ones((3, 6)), torch.full((3, 1), 5),
                             want.past_key_values).logits
    torch.testing.assert_close(got.logits.float(), want.logits.float(), atol=0.05, rtol=0.02)
    torch.testing.assert_close(step.float(), want_step.float(), atol=0.05, rtol=0.02)


def _engine_copy(family):
    """A bf16 model as the HF engine's own copy has it: no autograd, SmallBatchLinears, fused projections."""
    model = FAMILIES[family]().to(torch.bfloat16).requires_grad_(False)
    use_small_batch_linears(model)
    fuse_projections(model)
    return model


@pytest.mark.parametrize("family", ["llama", "qwen2", "llama-bias-rope-scaling"])  # q/k/v (and o) biases
@torch.no_grad()
def test_a_decode_step_in_one_kernel_call_is_the_layer_by_layer_step(family, monkeypatch):
    """`cpu_kernel.decode_layers` (every layer of a decode step in one call) against the per-operator
    layers: the same logits and the same cache, over left-padded rows, several steps, a spare-column
    re-allocation and a row leaving the batch (a strided view of the cache)."""
    import actloop.rollout.lean_decode as LD
    from actloop.rollout.kv import with_slack

    _need("decode_layers_bf16")
    model = _engine_copy(family)
    assert LD._stack(model) is not None
    calls = []
    real_layers = cpu_kernel.decode_layers
    monkeypatch.setattr(cpu_kernel, "decode_layers", lambda *a: calls.append(1) or real_layers(*a))
    ids = torch.randint(0, 97, (3, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6, [0, 1, 1, 1, 1, 1]])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = lean_forward(model, ids, mask, pos, None)  # the prefill: per operator (T > 1)
    assert not calls
    caches = [with_slack(out.past_key_values, slack=2), with_slack(_copy(out.past_key_values), slack=2)]
    tok, nxt = out.logits[:, -1].argmax(-1)[:, None], pos[:, -1:]
    for step in range(5):
        if step == 3:  # row 1 leaves: the caches keep rows 0 and 2 (a view of the buffer)
            for c in caches:
                for layer in c.layers:
                    layer.keep([0, 2], 0)
            tok, nxt, mask = tok[[0, 2]], nxt[[0, 2]], mask[[0, 2]]
        mask, nxt = torch.cat([mask, torch.ones_like(mask[:, :1])], 1), nxt + 1
        got = lean_forward(model, tok, mask, nxt, caches[0]).logits
        assert len(calls) == step + 1
        with monkeypatch.context() as m:
            m.setattr(LD, "_stacked_step", lambda *a: None)
            want = lean_forward(model, tok, mask, nxt, caches[1]).logits
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2 ** -7)
        for a, b in zip(caches[0].layers, caches[1].layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        tok = want[:, -1].argmax(-1)[:, None]


def test_decode_steps_the_one_call_does_not_take_go_layer_by_layer():
    import actloop.rollout.lean_decode as LD
    from actloop.rollout.kv import with_slack

    _need("decode_layers_bf16")
    assert LD._stack(_engine_copy("qwen3")) is None  # a per-head q/k norm
    assert LD._stack(FAMILIES["llama"]().requires_grad_(False)) is None  # fp32, nothing fused
    model = _engine_copy("llama")
    most = cpu_kernel.MAX_ROWS_STACKED  # more rows than one call takes: layer by layer
    for rows in (most, most + 1):
        ids = torch.randint(0, 97, (rows, 4), generator=torch.Generator().manual_seed(6))
        mask, pos = torch.ones_like(ids), torch.arange(4).expand(rows, 4)
        cache = with_slack(lean_forward(model, ids, mask, pos, None).past_key_values)
        x = model.model.embed_tokens(ids[:, :1])
        cos, sin = model.model.rotary_emb(x, pos[:, :1] + 4)
        assert (LD._stacked_step(model, x, cos, sin, torch.ones(rows, 5), cache) is None) == (rows > most)
