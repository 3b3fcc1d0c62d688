"""RMSNorm and the MLP's SiLU(gate) x up for the update's bf16 passes, one C kernel each way.

transformers' LlamaRMSNorm (and Qwen2's, Qwen3's, Mistral's, the same code) runs, per call,
`h = x.float(); h * rsqrt(h.pow(2).mean(-1) + eps)`, casts back and scales: ~8 operators forward,
as many backward, and autograd keeps two fp32 copies of every normed activation for the backward.
Their MLP's `act_fn(gate_proj(x)) * up_proj(x)` keeps SiLU's output besides gate and up. Under
`train.bf16_mode=weights` (activations bf16, actloop.train.numerics.mixed_precision) the norms were ~0.2 s
of the benchmark's ~3 s update on the 2-core Zen 4 box, mostly the page faults of those copies
(docs/performance.md).

- `RMSNormBF16` computes the same forward (`cpu_kernel.rms_norm_fwd`, the decode kernel's maths),
  keeping only the input and one fp32 number a row, and the gradient autograd would get through
  those operators (`cpu_kernel.rms_norm_bwd`).
- `SwiGLUBF16` computes bf16(bf16(silu(gate)) * up) as the two bf16 operators round it, keeping
  gate and up, and recomputes SiLU in the backward (`cpu_kernel.swiglu_fwd` / `swiglu_bwd`).

`fused_operators(*models)` routes the norms and MLPs of those classes through them for a block; an
input they do not take (not bf16, not on the CPU, no kernel) goes the modules' own way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from actloop.rollout import cpu_kernel

# transformers classes whose forward is LlamaRMSNorm's (weight * normed, eps in `variance_epsilon`) /
# LlamaMLP's (down(act(gate(x)) * up(x))); Gemma's (1 + weight) norm and others are left alone
RMS_NORM_CLASSES = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")
MLP_CLASSES = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP")
SILU_CLASSES = ("SiLUActivation", "SiLU")  # transformers' ACT2FN["silu"], torch.nn.SiLU


class RMSNormBF16(torch.autograd.Function):
    """x [rows, n] bf16, weight [n] bf16 -> weight * RMSNorm(x), as LlamaRMSNorm computes it."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        y, rstd = cpu_kernel.rms_norm_fwd(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = cpu_kernel.rms_norm_bwd(x, weight, rstd, dy, ctx.needs_input_grad[1])
        return dx, dw, None


class SwiGLUBF16(torch.autograd.Function):
    """gate, up (bf16, one shape) -> silu(gate) * up, rounded as LlamaMLP's two bf16 operators."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return cpu_kernel.swiglu_fwd(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        return cpu_kernel.swiglu_bwd(gate, up, grad, ctx.needs_input_grad[1])


def _norm_forward(module, plain, hidden_states):
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    if not (hidden_states.is_contiguous() and cpu_kernel.can_norm_train(x, module.weight)):
        return plain(hidden_states)
    return RMSNormBF16.apply(x, module.weight, float(module.variance_epsilon)).view(hidden_states.shape)


def _mlp_forward(module, plain, x):
    gate, up = module.gate_proj(x), module.up_proj(x)
    if cpu_kernel.can_swiglu(gate, up):
        return module.down_proj(SwiGLUBF16.apply(gate, up))
    return module.down_proj(module.act_fn(gate) * up)


@contextlib.contextmanager
def fused_operators(*models) -> Iterator[None]:
    """Inside the block, the RMSNorm modules (RMS_NORM_CLASSES) and SiLU MLPs (MLP_CLASSES) of
    `models` (None skipped) go through `RMSNormBF16` / `SwiGLUBF16` where those take their inputs."""
    patched = []
    for model in models:
        if model is None:
            continue
        for m in model.modules():
            name = type(m).__name__
            if "forward" in vars(m):  # already routed (a model given twice), or patched by someone else
                continue
            if name in RMS_NORM_CLASSES:
                fn = _norm_forward
            elif name in MLP_CLASSES and type(getattr(m, "act_fn", None)).__name__ in SILU_CLASSES:
                fn = _mlp_forward
            else:
                continue
            m.forward = lambda x, m=m, plain=m.forward, fn=fn: fn(m, plain, x)
            patched.append(m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward
