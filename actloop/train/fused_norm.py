"""RMSNorm for the update's bf16 passes in one C kernel each way (`rollout/rms_norm_train_bf16.c`).

transformers' LlamaRMSNorm (and Qwen2's, Qwen3's, Mistral's, the same code) runs, per call,
`h = x.float(); h * rsqrt(h.pow(2).mean(-1) + eps)`, casts back and scales: ~8 operators forward,
as many backward, and autograd keeps two fp32 copies of every normed activation for the backward.
Under `train.bf16_mode=weights` (activations bf16, actloop.train.mixed_precision) that was ~0.1 s of
the benchmark's 2.5-3 s update on the 2-core Zen 4 box (docs/performance.md). `RMSNormBF16` computes
the same forward (`cpu_kernel.rms_norm_fwd`, the decode kernel's maths) keeping only the input and
one fp32 number a row, and the gradient autograd would get through those operators
(`cpu_kernel.rms_norm_bwd`).

`fused_rms_norms(model)` routes those classes' modules through it for a block; an input it does not
take (not bf16, not on the CPU, no kernel) goes to the module's own forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from actloop.rollout import cpu_kernel

# transformers classes whose forward is LlamaRMSNorm's (weight * normed, eps in `variance_epsilon`);
# Gemma's (1 + weight) and others are left alone
RMS_NORM_CLASSES = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")


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


def _forward(module, plain, hidden_states):
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    if not (hidden_states.is_contiguous() and cpu_kernel.can_norm_train(x, module.weight)):
        return plain(hidden_states)
    return RMSNormBF16.apply(x, module.weight, float(module.variance_epsilon)).view(hidden_states.shape)


@contextlib.contextmanager
def fused_rms_norms(*models) -> Iterator[None]:
    """Inside the block, the RMSNorm modules of `models` (None skipped) of RMS_NORM_CLASSES run
    through `RMSNormBF16` where it takes their input."""
    patched = []
    for model in models:
        if model is None:
            continue
        for m in model.modules():
            if type(m).__name__ in RMS_NORM_CLASSES and "forward" not in vars(m):
                plain = m.forward
                m.forward = lambda h, m=m, plain=plain: _forward(m, plain, h)
                patched.append(m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward
