"""The chunked lm_head log-prob (recomputed in the backward) against the plain computation."""

import pytest
import torch

from actloop.train.numerics.logprobs import ChunkedHeadLogprob, head_logprobs


def reference(h, w, tgt, T):
    logp = torch.log_softmax((h @ w.T) / T, -1)
    return logp.gather(-1, tgt[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
def test_chunked_head_matches_full_softmax_values_and_gradients(chunk):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(7, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 8, generator=g, dtype=torch.float64, requires_grad=True)
    tgt = torch.randint(0, 50, (7,), generator=g)
    upstream = torch.randn(7, generator=g, dtype=torch.float64)
    lp, ent = ChunkedHeadLogprob.apply(h, w, tgt, 0.7, chunk, torch.float64)
    (lp * upstream).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    lp_ref, ent_ref = reference(h, w, tgt, 0.7)
    (lp_ref * upstream).sum().backward()
    assert torch.allclose(lp, lp_ref, atol=1e-10) and torch.allclose(ent, ent_ref.detach(), atol=1e-10)
    assert torch.allclose(gh, h.grad, atol=1e-10) and torch.allclose(gw, w.grad, atol=1e-10)
    assert not ent.requires_grad


def test_gradcheck_through_the_recomputed_backward():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 4, generator=g, dtype=torch.float64, requires_grad=True)
    tgt = torch.tensor([0, 3, 10, 3, 5])
    assert torch.autograd.gradcheck(lambda a, b: ChunkedHeadLogprob.apply(a, b, tgt, 1.3, 2, torch.float64)[0], (h, w))


def test_a_second_backward_recomputes_what_the_first_used_up():
    """One chunk: the first backward turns the kept softmax into the gradient in place; a second
    backward through the retained graph recomputes it and gets the same gradient."""
    g = torch.Generator().manual_seed(2)
    h = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, 4, generator=g, dtype=torch.float64, requires_grad=True)
    tgt = torch.randint(0, 9, (6,), generator=g)
    lp, _ = ChunkedHeadLogprob.apply(h, w, tgt, 0.9, 100, torch.float64)
    lp.sum().backward(retain_graph=True)
    gh, gw = h.grad.clone(), w.grad.clone()
    lp.sum().backward()
    assert torch.allclose(h.grad, 2 * gh, atol=1e-12) and torch.allclose(w.grad, 2 * gw, atol=1e-12)
    lp_ref, _ = reference(h, w, tgt, 0.9)
    want_h, want_w = torch.autograd.grad(lp_ref.sum(), (h, w))
    assert torch.allclose(gh, want_h, atol=1e-10) and torch.allclose(gw, want_w, atol=1e-10)


def test_plain_path_when_chunk_is_zero_gives_the_same_values():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 64, bias=False)
    h, tgt = torch.randn(9, 16), torch.randint(0, 64, (9,))
    a, ea = head_logprobs(head, h, tgt, 0.8, "fp32", chunk=0)
    b, eb = head_logprobs(head, h, tgt, 0.8, "fp32", chunk=4)
    assert torch.allclose(a, b, atol=1e-5) and torch.allclose(ea, eb, atol=1e-5)


def test_frozen_head_gets_no_weight_gradient_and_bf16_stays_close():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 64, bias=False)
    head.weight.requires_grad_(False)  # LoRA: the base lm_head is frozen
    h = torch.randn(9, 16, requires_grad=True)
    tgt = torch.randint(0, 64, (9,))
    lp, _ = head_logprobs(head, h, tgt, 1.0, "bf16", chunk=4)
    lp.sum().backward()
    assert head.weight.grad is None and h.grad is not None
    lp32, _ = head_logprobs(head, h.detach(), tgt, 1.0, "fp32", chunk=4)
    assert (lp.detach() - lp32).abs().max() < 0.05  # bf16 matmul, fp32 softmax


def test_hand_computed_two_token_vocabulary():
    # logits [0, ln 3] -> p = [1/4, 3/4]; target 1 -> log(3/4); entropy -(1/4 ln 1/4 + 3/4 ln 3/4)
    w = torch.tensor([[0.0], [float(torch.log(torch.tensor(3.0)))]])
    lp, ent = ChunkedHeadLogprob.apply(torch.ones(1, 1), w, torch.tensor([1]), 1.0, 1, torch.float32)
    assert abs(float(lp) - float(torch.log(torch.tensor(0.75)))) < 1e-6
    assert abs(float(ent) - 0.5623351) < 1e-6


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).float()


def rows_of_two_groups():
    g = torch.Generator().manual_seed(3)
    r = lambda n: torch.randint(1, 61, (n,), generator=g).tolist()  # noqa: E731
    system = r(5)
    prompts = [system + r(6), system + r(9)]  # two groups, different prompt lengths
    seqs, masks = [], []
    for p in prompts:
        for n in (3, 7, 4):  # three samples each; the second has an env turn (mask 0) inside
            c = r(n)
            seqs.append(p + c)
            masks.append([0] * len(p) + ([1, 1, 0, 0, 1, 1, 1] if n == 7 else [1] * n))
    return seqs, masks


@pytest.mark.parametrize("chunk", [0, 5])
def test_group_prefixes_give_the_full_sequence_logprobs_and_gradients(chunk):
    from actloop.train.numerics.logprobs import prefix_plan, token_logprobs

    model = tiny_llama()
    seqs, masks = rows_of_two_groups()
    lens, prefixes, owner = prefix_plan(seqs, masks)
    assert len(prefixes) == 2 and owner == [0, 0, 0, 1, 1, 1] and lens == [10, 10, 10, 13, 13, 13]

    def run(share):
        model.zero_grad()
        out = token_logprobs(model, seqs, masks, 0.9, "fp32", share_prefix=share, chunk=chunk)
        (out.logp * out.mask).sum().backward()
        packed = [out.logp[i][out.mask[i]].detach() for i in range(len(seqs))]
        return packed, {n: p.grad.clone() for n, p in model.named_parameters()}

    shared, g_shared = run(True)
    full, g_full = run(False)
    for a, b, m in zip(shared, full, masks):
        assert len(a) == sum(m) and torch.allclose(a, b, atol=1e-5)
    for n in g_full:
        assert torch.allclose(g_shared[n], g_full[n], atol=1e-5), n


def test_prefix_plan_prefers_one_common_prefix_when_every_prompt_differs():
    from actloop.train.numerics.logprobs import prefix_plan

    seqs = [[1, 2, 3, 4, 5], [1, 2, 9, 8, 7]]
    masks = [[0, 0, 0, 1, 1], [0, 0, 0, 1, 1]]
    assert prefix_plan(seqs, masks) == ([2, 2], [[1, 2]], [0, 0])


def test_gradient_checkpointing_gives_the_same_gradients():
    from actloop.train.numerics.logprobs import token_logprobs

    model = tiny_llama()
    model.train()
    seqs, masks = rows_of_two_groups()

    def grads(ckpt):
        model.zero_grad()
        out = token_logprobs(model, seqs, masks, 1.0, "fp32", chunk=4, checkpointing=ckpt)
        (out.logp * out.mask).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain, ckpt = grads(False), grads(True)
    assert model.model.is_gradient_checkpointing if not hasattr(model.model, "is_activation_checkpointing") \
        else model.model.is_activation_checkpointing
    for n in plain:
        assert torch.allclose(plain[n], ckpt[n], atol=1e-5), n


@pytest.mark.parametrize("groups", [1, 2])
def test_checkpointing_keeps_the_shared_prefix_with_exact_gradients(groups):
    """Under checkpointing the prompt prefix still runs once (replayable caches, rollout/kv.py):
    the embedding sees the prefix plus the suffixes, not every full row, and the gradients equal
    the plain path's (one prefix for all rows, and one per prompt)."""
    from actloop.train.numerics.logprobs import token_logprobs

    model = tiny_llama()
    model.train()
    seqs, masks = rows_of_two_groups()
    if groups == 1:
        seqs, masks = seqs[:3], masks[:3]
    seen = []
    model.model.embed_tokens.register_forward_hook(lambda m, i, o: seen.append(i[0].numel()))

    def grads(ckpt):
        model.zero_grad()
        seen.clear()
        out = token_logprobs(model, seqs, masks, 1.0, "fp32", chunk=4, checkpointing=ckpt)
        (out.logp * out.mask).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}, sum(seen)

    (plain, n_plain), (ckpt, n_ckpt) = grads(False), grads(True)
    assert n_ckpt == n_plain < sum(len(s) - 1 for s in seqs)  # the prefix ran once, as without checkpointing
    for n in plain:
        assert torch.allclose(plain[n], ckpt[n], atol=1e-5), n


@pytest.mark.parametrize("groups,ckpt,chunk", [(1, False, 4), (2, False, 0), (1, True, 4), (2, True, 100)])
def test_padding_to_a_multiple_changes_shapes_not_results(groups, ckpt, chunk):
    """train.pad_to_multiple: the suffix, the shared prefix and the head's rows padded to a multiple
    of 16 give the exact lengths' log-probs, entropies and gradients, and the passes ran on the
    padded shapes (the embedding saw multiples of 16 per row)."""
    from actloop.train.numerics.logprobs import token_logprobs

    model = tiny_llama()
    model.train(ckpt)
    seqs, masks = rows_of_two_groups()
    if groups == 1:
        seqs, masks = seqs[:3], masks[:3]
    widths = []
    model.model.embed_tokens.register_forward_hook(lambda m, i, o: widths.append(i[0].shape[-1]))

    def run(pad_to):
        model.zero_grad()
        widths.clear()
        out = token_logprobs(model, seqs, masks, 0.8, "fp32", chunk=chunk, checkpointing=ckpt, pad_to=pad_to)
        (out.logp * out.mask).sum().backward()
        rows = [(out.logp[i][out.mask[i]].detach(), out.entropy[i][out.mask[i]]) for i in range(len(seqs))]
        return rows, {n: p.grad.clone() for n, p in model.named_parameters()}, list(widths)

    exact, g_exact, w_exact = run(1)
    padded, g_padded, w_padded = run(16)
    assert all(w % 16 == 0 for w in w_padded) and w_padded != w_exact
    for (a, ea), (b, eb), m in zip(exact, padded, masks):
        assert len(a) == len(b) == sum(m) and torch.allclose(a, b, atol=1e-5) and torch.allclose(ea, eb, atol=1e-5)
    for n in g_exact:
        assert torch.allclose(g_exact[n], g_padded[n], atol=1e-5), n


def test_head_rows_padded_to_a_multiple_give_the_same_values_and_gradients():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 64, bias=False)
    h, tgt = torch.randn(9, 16, requires_grad=True), torch.randint(0, 64, (9,))
    out = [head_logprobs(head, h, tgt, 1.1, "fp32", chunk=4, pad_to=p) for p in (1, 8)]
    assert out[1][0].shape == (9,) and torch.allclose(out[0][0], out[1][0], atol=1e-6)
    assert torch.allclose(out[0][1], out[1][1], atol=1e-6)
    grads = [torch.autograd.grad(o[0].sum(), (h, head.weight)) for o in out]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads))


@pytest.mark.parametrize("chunk", [4, 100])  # several chunks (recomputed in the backward), one (kept)
def test_the_bf16_kernel_computes_what_the_torch_path_does(chunk, monkeypatch):
    """bf16 logits on an AVX-512 CPU take cpu_kernel.head_logprob(_grad_); the same values and
    gradients as the fp32 torch maths over the same bf16 logits, up to fp32 and bf16 rounding."""
    from actloop.rollout import cpu_kernel

    g = torch.Generator().manual_seed(5)
    h = torch.randn(9, 16, generator=g)
    w = torch.randn(300, 16, generator=g) * 0.5
    tgt = torch.randint(0, 300, (9,), generator=g)
    upstream = torch.randn(9, generator=g)
    if not cpu_kernel.can_head(torch.zeros(1, 16, dtype=torch.bfloat16)):
        pytest.skip(f"the head kernel is unavailable here: {cpu_kernel.reason('head_logprob_bf16')}")

    def run():
        a, b = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, ent = ChunkedHeadLogprob.apply(a, b, tgt, 0.8, chunk, torch.bfloat16)
        (lp * upstream).sum().backward()
        return lp.detach(), ent, a.grad, b.grad

    calls = []
    real = cpu_kernel.head_logprob_grad_
    monkeypatch.setattr(cpu_kernel, "head_logprob_grad_", lambda *a: calls.append(1) or real(*a))
    fused = run()
    assert len(calls) == (1 if chunk == 100 else 3)  # the kernel did run, once per chunk
    monkeypatch.setattr(cpu_kernel, "can_head", lambda z: False)
    plain = run()
    for x, y in zip(fused, plain):
        torch.testing.assert_close(x, y, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(fused[0], plain[0], atol=1e-5, rtol=1e-5)  # log-probs: fp32 sums over the same logits
