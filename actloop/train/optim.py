"""The optimizer every trainer uses: AdamW over the fp32 master weights.

torch's fused AdamW kernel runs where every parameter is a plain tensor on CPU or CUDA: on this
2-core CPU it steps 135M parameters in 0.08 s against 0.30 s for the default per-tensor loop (and
0.47 s for `foreach`), about 0.2-0.9 s of each GRPO step back. FSDP's sharded (DTensor)
parameters, or a device without the kernel, take the default loop.
"""

from __future__ import annotations

from typing import Any

import torch


_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def fusable(tensors: list[torch.Tensor]) -> bool:
    """Plain floating-point tensors on CPU or CUDA: what torch's fused AdamW kernel steps
    (its constructor accepts more and fails at the first step instead)."""
    return all(t.device.type in ("cpu", "cuda") and t.dtype in _FUSED_DTYPES and not hasattr(t, "device_mesh")
               for t in tensors)


def adamw(params: Any, lr: float, weight_decay: float, fused: bool = True) -> torch.optim.Optimizer:
    """`params`: tensors or param-group dicts, as for torch.optim.AdamW."""
    params = list(params)
    tensors = [t for g in params for t in (g["params"] if isinstance(g, dict) else [g])]
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=bool(fused and fusable(tensors)) or None)


def drop_state(optimizer: torch.optim.Optimizer) -> None:
    """Drop the optimizer's state and the gradients once no step follows: AdamW's two moments are
    twice the fp32 weights (1 GB for the 135M model), which would otherwise sit under the final
    evaluation's peak."""
    optimizer.state.clear()
    optimizer.zero_grad(set_to_none=True)
