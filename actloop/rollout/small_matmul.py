"""`SmallBatchLinear`: nn.Linear for decode on a CPU, where a step multiplies a few rows by every
weight matrix.

For few rows, MKL's fp32 GEMM is much faster with the weight as the left operand: y = (W x^T)^T
instead of y = x W^T (the same products; MKL may sum them in another order: equal to ~1e-6):
~1.7x at 8 rows over SmolLM2-135M's matrices (docs/performance.md, "Figures the docstrings carried").
One row is no faster (a GEMV either way) and at a few hundred rows the decoder's matrices are within noise,
so only 2..`max_rows` fp32 rows take the transposed form (in bf16 oneDNN's x W^T is the faster one;
CUDA keeps `F.linear`). Up to `cpu_kernel.max_rows(dtype)` rows go to actloop's own kernels where they
could be built (`rollout/cpu_kernel.py`: fp32 on AVX2, bf16 on AVX512-BF16), which stream each
weight row once for all rows. The engine's own copy of the policy gets these modules
(`use_small_batch_linears`), and its lean decode forward calls `linear` directly; the trainer's modules
are never touched.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from actloop.rollout import cpu_kernel


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, w, bias) for decode on the CPU without autograd: 1..cpu_kernel.max_rows rows through
    actloop's kernel of the dtype (fp32: AVX2, bf16: AVX512-BF16), 2..SmallBatchLinear.max_rows fp32 rows
    as (W x^T)^T; F.linear otherwise (and whenever autograd would need the graph)."""
    rows = x.numel() // x.shape[-1] if x.dim() > 0 and x.shape[-1] else 0
    if not (0 < rows <= SmallBatchLinear.max_rows) or x.device.type != "cpu" \
            or x.dtype not in (torch.float32, torch.bfloat16) or w.dtype != x.dtype \
            or (bias is not None and bias.dtype != x.dtype) \
            or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)):
        return F.linear(x, w, bias)
    if rows <= cpu_kernel.max_rows(x.dtype) and w.is_contiguous() and cpu_kernel.small_linear(x.dtype) is not None:
        y = cpu_kernel.linear(x.reshape(rows, x.shape[-1]).contiguous(), w,
                              bias.contiguous() if bias is not None else None)
        return y.view(*x.shape[:-1], w.shape[0])
    if rows == 1 or x.dtype != torch.float32:  # bf16: oneDNN's x W^T is the faster form (docs/performance.md)
        return F.linear(x, w, bias)
    y = torch.mm(w, x.reshape(rows, x.shape[-1]).t()).t()  # [rows, out]: a transposed view
    if bias is not None:
        y = y + bias
    return y.contiguous().view(*x.shape[:-1], w.shape[0])


class SmallBatchLinear(torch.nn.Linear):
    """nn.Linear whose forward is `linear` above (the decode kernels for few CPU rows)."""

    max_rows = 64

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def use_small_batch_linears(model: Any) -> int:
    """Make every plain nn.Linear of `model` a SmallBatchLinear (same parameters, in place);
    returns how many. Subclasses of nn.Linear (peft's LoRA layers, quantized linears) are left."""
    n = 0
    for mod in model.modules():
        if type(mod) is torch.nn.Linear:
            mod.__class__ = SmallBatchLinear
            n += 1
    return n
