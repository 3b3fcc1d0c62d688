"""The optimizer every trainer uses: AdamW over the fp32 master weights, its state in fp32, bf16
(first moment) or blockwise 8 bits (`train.optimizer`).

torch's fused AdamW kernel runs where every parameter is a plain tensor on CPU or CUDA: on this
2-core CPU it steps 135M parameters in 0.08 s against 0.30 s for the default per-tensor loop (and
0.47 s for `foreach`), about 0.2-0.9 s of each GRPO step back. FSDP's sharded (DTensor)
parameters, or a device without the kernel, take the default loop.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

from actloop.config import OptimizerName, choices


_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def fusable(tensors: list[torch.Tensor]) -> bool:
    """Plain floating-point tensors on CPU or CUDA: what torch's fused AdamW kernel steps
    (its constructor accepts more and fails at the first step instead)."""
    return all(t.device.type in ("cpu", "cuda") and t.dtype in _FUSED_DTYPES and not hasattr(t, "device_mesh")
               for t in tensors)


OPTIMIZERS = choices(OptimizerName)  # train.optimizer's values


def resolve_optimizer(kind: str, tensors: list[torch.Tensor]) -> str:
    """"auto": adamw_8bit where bitsandbytes can step these tensors (plain CPU/CUDA tensors: one
    process, or torchrun without FSDP), else adamw (FSDP's sharded DTensors, another device, or
    bitsandbytes missing, which is said once on stderr)."""
    if kind != "auto":
        return kind
    if not plain(tensors):
        return "adamw"
    try:
        import actloop.train.numerics.optim8bit  # noqa: F401
    except ImportError as e:
        print(f"train.optimizer=auto: bitsandbytes unavailable ({e}); fp32 AdamW moments instead", file=sys.stderr)
        return "adamw"
    return "adamw_8bit"


def plain(tensors: list[torch.Tensor]) -> bool:
    return all(t.device.type in ("cpu", "cuda") and not hasattr(t, "device_mesh") for t in tensors)


def adamw(params: Any, lr: float, weight_decay: float, fused: bool = True,
          kind: str = "adamw") -> torch.optim.Optimizer:
    """`params`: tensors or param-group dicts, as for torch.optim.AdamW. kind:
    - "adamw": torch.optim.AdamW, both moments fp32 (8 bytes a parameter), fused where it can be;
    - "adamw_bf16_momentum": `AdamWBf16Momentum` (6 bytes a parameter);
    - "adamw_8bit": block-wise 8-bit moments on bitsandbytes (`adamw_8bit`, ~2 bytes a parameter);
    - "auto": `resolve_optimizer`."""
    params = list(params)
    tensors = [t for g in params for t in (g["params"] if isinstance(g, dict) else [g])]
    kind = resolve_optimizer(kind, tensors)
    if kind == "adamw_bf16_momentum":
        return AdamWBf16Momentum(params, lr=lr, weight_decay=weight_decay)
    if kind == "adamw_8bit":
        return adamw_8bit(params, tensors, lr=lr, weight_decay=weight_decay)
    if kind != "adamw":
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, not {kind!r}")
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=bool(fused and fusable(tensors)) or None)


def adamw_8bit(params: list[Any], tensors: list[torch.Tensor], lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW with both moments stored in 8 bits (Dettmers et al. 2022, arXiv:2110.02861) on
    bitsandbytes: each moment in blocks of 256 values, one fp32 absmax per block and a dynamic
    (tree) quantization code, so small and large values keep their relative precision; the update
    itself runs in fp32 (de-quantize, torch.optim.AdamW's update, re-quantize). ~2 bytes a
    parameter instead of 8: for the 135M model 0.27 GB of state instead of 1.08 GB. The paper
    matches 32-bit Adam across language-model pre-training and fine-tuning. On CPU, stepped in
    chunks (`actloop.train.numerics.optim8bit`)."""
    if not plain(tensors):
        raise ValueError("train.optimizer=adamw_8bit needs plain CPU or CUDA tensors (not FSDP's sharded "
                         "DTensors): use adamw or adamw_bf16_momentum under torchrun")
    try:
        from actloop.train.numerics.optim8bit import AdamW8bit
    except ImportError as e:  # a dependency of actloop; a broken install lands here
        raise RuntimeError(f"train.optimizer=adamw_8bit needs bitsandbytes (pip install bitsandbytes): {e}") from e
    return AdamW8bit(params, lr=lr, weight_decay=weight_decay)


class AdamWBf16Momentum(torch.optim.Optimizer):
    """AdamW (Loshchilov & Hutter 2019, decoupled weight decay; torch.optim.AdamW's update) with
    the first moment stored in bf16 and the second in fp32, over fp32 parameters.

    Per step t, for a parameter p with gradient g (every tensor the shape of p):
        m = beta1 * m + (1 - beta1) * g            # computed in fp32, stored rounded to bf16
        v = beta2 * v + (1 - beta2) * g * g        # fp32
        p = p * (1 - lr * wd) - lr / (1 - beta1^t) * m / (sqrt(v / (1 - beta2^t)) + eps)
    Why only m: with beta1 = 0.9 the EMA moves by 10% of its value a step, far above bf16's
    rounding (2^-8 = 0.4% relative), so rounding only adds 0.4% noise to each step's direction;
    with beta2 = 0.999, v moves by 0.1% a step, which bf16 would round away entirely (the second
    moment would stop following the gradients). Saves 2 bytes per parameter: 269 MB for the 135M
    model, out of AdamW's 1076. Steps each tensor in turn (no fused kernel: ~0.3 s a step more for
    135M parameters on this CPU)."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            (b1, b2), lr, eps, wd = group["betas"], group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                if state["exp_avg"].dtype != torch.bfloat16:  # a resumed state_dict comes back in p's dtype
                    state["exp_avg"] = state["exp_avg"].to(torch.bfloat16)
                state["step"] += 1
                t = float(state["step"])
                g = p.grad.float()
                m = state["exp_avg"].float().lerp_(g, 1 - b1)  # [p] fp32 for this step
                state["exp_avg"].copy_(m)
                v = state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                if wd:
                    p.mul_(1 - lr * wd)
                # m / (sqrt(v / bc2) + eps) = sqrt(bc2) * m / (sqrt(v) + eps * sqrt(bc2)): one pass fewer
                root_bc2 = math.sqrt(1 - b2**t)
                p.addcdiv_(m, v.sqrt().add_(eps * root_bc2), value=-lr * root_bc2 / (1 - b1**t))
        return loss


def drop_state(optimizer: torch.optim.Optimizer) -> None:
    """Drop the optimizer's state and the gradients once no step follows: AdamW's two moments are
    twice the fp32 weights (1 GB for the 135M model), which would otherwise sit under the final
    evaluation's peak."""
    optimizer.state.clear()
    optimizer.zero_grad(set_to_none=True)


def warmup_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int):
    """A linear warm-up of the learning rate over `warmup_steps` optimizer steps, then constant."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup_steps) if warmup_steps else 1.0)
