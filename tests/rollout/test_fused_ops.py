"""RMSNorm and SiLU(gate) x up for the update's bf16 passes (actloop/rollout/fused_ops.py): the kernels
compute what transformers' LlamaRMSNorm and LlamaMLP compute through autograd, values and gradients."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from actloop.rollout import cpu_kernel
from actloop.rollout import fused_ops
from actloop.rollout.fused_ops import RMSNormBF16, SwiGLUBF16, fused_operators

needs_swiglu = pytest.mark.skipif(
    not cpu_kernel.can_swiglu(*(torch.zeros(2, dtype=torch.bfloat16),) * 2),
    reason=f"the SwiGLU kernel is unavailable here: {cpu_kernel.reason('swiglu_fwd_bf16')}")
needs_kernel = pytest.mark.skipif(
    not cpu_kernel.can_norm_train(torch.zeros(1, 16, dtype=torch.bfloat16), torch.zeros(16, dtype=torch.bfloat16)),
    reason=f"the RMSNorm kernel is unavailable here: {cpu_kernel.reason('rms_norm_fwd_bf16')}")


@needs_kernel
@pytest.mark.parametrize("n", [16, 40])  # 40: a row that is not a multiple of the kernel's 16 lanes
def test_forward_and_gradients_are_llama_rms_norms(n):
    g = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(n, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n, generator=g) * 0.5 + 1)
    x = (torch.randn(37, n, generator=g) * 3).bfloat16()
    dy = torch.randn(37, n, generator=g).bfloat16()
    x1 = x.clone().requires_grad_()
    want = norm(x1)
    want.backward(dy)
    w2 = norm.weight.detach().clone().requires_grad_()
    x2 = x.clone().requires_grad_()
    got = RMSNormBF16.apply(x2, w2, 1e-5)
    got.backward(dy)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=0, rtol=2**-7)  # the same maths, a sum in another order
    torch.testing.assert_close(x2.grad, x1.grad, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(w2.grad, norm.weight.grad, atol=5e-2, rtol=2e-2)
    # against the exact gradient (fp64 through the same formula): no worse than autograd's bf16 one
    xd, wd = x.double().requires_grad_(), norm.weight.detach().double().requires_grad_()
    (wd * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5))).backward(dy.double())
    assert (x2.grad.double() - xd.grad).abs().max() <= 1.5 * (x1.grad.double() - xd.grad).abs().max() + 1e-3


@needs_kernel
@needs_swiglu
def test_a_model_trains_the_same_through_the_fused_norms(monkeypatch):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.randint(0, 61, (3, 9))
    calls, swiglu = [], []
    real, real_swiglu = RMSNormBF16.apply, SwiGLUBF16.apply
    monkeypatch.setattr(RMSNormBF16, "apply", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(SwiGLUBF16, "apply", lambda *a: swiglu.append(1) or real_swiglu(*a))

    def loss_and_grads():
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    plain_loss, plain_grads = loss_and_grads()
    with fused_operators(model, None):
        fused_loss, fused_grads = loss_and_grads()
    assert len(calls) == 2 * 2 + 1  # two per layer and the final norm: every norm took the kernel
    assert len(swiglu) == 2  # every MLP
    assert not any("forward" in vars(m) for m in model.modules())  # put back
    torch.testing.assert_close(fused_loss, plain_loss, atol=1e-2, rtol=1e-2)
    for a, b in zip(fused_grads, plain_grads):
        torch.testing.assert_close(a, b, atol=3e-2, rtol=5e-2)


def test_inputs_it_does_not_take_go_to_the_modules_own_forward(monkeypatch):
    norm = LlamaRMSNorm(16)  # fp32
    monkeypatch.setattr(RMSNormBF16, "apply", lambda *a: pytest.fail("fp32 must not take the bf16 kernel"))
    x = torch.randn(2, 3, 16)
    want = norm(x)
    with fused_operators(norm):
        got = norm(x)
    torch.testing.assert_close(got, want)
    assert "LlamaRMSNorm" in fused_ops.RMS_NORM_CLASSES


@needs_swiglu
def test_swiglu_is_llama_mlps_silu_times_up_values_and_gradients():
    g = torch.Generator().manual_seed(2)
    gate, up = ((torch.randn(5, 7, 37, generator=g) * 3).bfloat16() for _ in range(2))  # 37: not 16 lanes
    da = torch.randn(5, 7, 37, generator=g).bfloat16()
    g1, u1 = gate.clone().requires_grad_(), up.clone().requires_grad_()
    want = torch.nn.functional.silu(g1) * u1
    want.backward(da)
    g2, u2 = gate.clone().requires_grad_(), up.clone().requires_grad_()
    got = SwiGLUBF16.apply(g2, u2)
    got.backward(da)
    # the same two roundings; exp differs from torch's in the last fp32 bit, so a bf16 value may differ by one step
    torch.testing.assert_close(got, want, atol=0, rtol=2**-7)
    assert (got != want).float().mean() < 0.01
    torch.testing.assert_close(u2.grad, u1.grad, atol=0, rtol=2**-7)
    torch.testing.assert_close(g2.grad, g1.grad, atol=1e-3, rtol=2**-7)


def test_the_updates_bf16_weights_context_routes_the_norms_and_mlps():
    """update_precision (what every update pass runs in) turns the routing on under bf16 weights, and
    only there: with the fp32 / autocast recipes the modules keep their own forward."""
    from actloop.train.numerics.mixed_precision import update_precision

    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    routed = lambda: sorted({type(m).__name__ for m in model.modules() if "forward" in vars(m)})  # noqa: E731
    with update_precision("bf16", "weights", model):
        assert routed() == ["LlamaMLP", "LlamaRMSNorm"]
    assert routed() == []
    for precision, mode in (("fp32", "weights"), ("bf16", "autocast")):
        with update_precision(precision, mode, model):
            assert routed() == []
