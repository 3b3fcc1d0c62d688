"""bf16 weights for the update's passes, fp32 master weights and gradients for the optimizer.

`train.precision` bf16 has two recipes (`train.bf16_mode`):

- `weights` (default): for the span of one optimizer step's forwards and backwards, every fp32
  floating parameter of the model holds a bf16 copy of itself (`param.data` swapped; the
  Parameter objects, which the optimizer and tied weights share, stay the same). Activations and
  the residual stream are bf16; RMSNorm, RoPE and softmax still compute in fp32 inside their ops
  (RMSNorm and the MLP's SiLU x up through actloop's kernels where they apply: actloop.rollout.fused_ops).
  Each bf16 gradient that autograd accumulates is summed at once into an fp32 buffer (a
  post-accumulate-grad hook) and the buffer becomes `param.grad` when the fp32 master is put
  back, before clipping and the optimizer step. This is mixed precision as FSDP's
  `MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)` (verl's default) and Megatron-LM's bf16
  with fp32 main parameters and gradients (Narayanan et al. 2021) do it, and what a bf16
  inference engine computes: the trainer's log-probs use the same bf16 weights and bf16
  residual stream as the engine's decode.
- `autocast`: `torch.autocast` over the fp32 weights (the residual stream stays fp32; each
  forward casts the weights it multiplies). What transformers' Trainer does with `bf16=True`.

`weights` is the faster of the two on a CPU with native bf16 (a bench-sized update's backward
~10% shorter; docs/performance.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from actloop.rollout.engine import use_bf16
from actloop.rollout.fused_ops import fused_operators

def _kept_fp32(model: nn.Module) -> set[int]:
    """ids of the parameters of the modules a transformers model keeps in fp32
    (`_keep_in_fp32_modules`, e.g. an MoE router): those stay fp32 under `bf16_weights`."""
    names = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    if not names:
        return set()
    return {id(p) for n, p in model.named_parameters() if any(k in n.split(".") for k in names)}


def _castable(*models: nn.Module | None) -> list[nn.Parameter]:
    """The parameters `bf16_weights` computes in bf16: every fp32 one (each once: tied weights are
    one Parameter) but those `_kept_fp32`; buffers (RoPE's inverse frequencies) stay as they are."""
    params: list[nn.Parameter] = []
    seen: set[int] = set()
    for model in models:
        if model is None:
            continue
        keep = _kept_fp32(model)
        for p in model.parameters():
            if id(p) not in seen and id(p) not in keep and p.dtype == torch.float32:
                seen.add(id(p))
                params.append(p)
    return params


def hold_in_bf16(model: nn.Module) -> None:
    """Cast a model that never trains (the full fine-tuning reference) to what `bf16_weights` would
    make of it at every update, once and for good: half its memory, no cast per step, the same
    log-probs (bf16_weights then leaves its parameters alone: they are no longer fp32)."""
    for p in _castable(model):
        p.data = p.data.to(torch.bfloat16)


@contextlib.contextmanager
def bf16_weights(*models: nn.Module | None, buffers: dict[int, torch.Tensor] | None = None) -> Iterator[None]:
    """Inside the block the fp32 parameters of `models` (None entries skipped) are bf16 copies;
    gradients accumulate in fp32. On exit the fp32 masters are back and each trainable one's
    `.grad` is the fp32 sum of the block's gradients (added to a gradient it had on entry).

    buffers: {id(parameter): a bf16 tensor of its shape} to cast into instead of allocating (the
    engine's weight copy, `Engine.lend_weights`); their values are the masters' afterwards.
    Every backward that reads these parameters must finish inside the block. Not for FSDP-sharded
    models (their DTensor parameters get FSDP's own mixed precision)."""
    params = _castable(*models)
    masters: list[torch.Tensor] = []
    sums: dict[int, torch.Tensor] = {}
    hooks = []

    def accumulate(p: torch.Tensor) -> None:  # autograd just set p.grad (bf16) for one backward
        total = sums.get(id(p))
        if total is None:
            sums[id(p)] = p.grad.float()
        else:
            total.add_(p.grad)
        p.grad = None

    try:
        for p in params:
            if p.grad is not None:  # a gradient from before the block: the sum starts from it
                sums[id(p)] = p.grad
                p.grad = None
            masters.append(p.data)
            buf = (buffers or {}).get(id(p))
            if buf is not None and buf.shape == p.shape and buf.dtype == torch.bfloat16:
                p.data = buf.copy_(p.data)  # the fp32 master rounded into the lent tensor
            else:
                p.data = p.data.to(torch.bfloat16)
            if p.requires_grad:
                hooks.append(p.register_post_accumulate_grad_hook(accumulate))
        yield
    finally:
        for h in hooks:
            h.remove()
        for p, master in zip(params, masters):
            p.data = master
            p.grad = sums.get(id(p))


def uses_bf16_weights(precision: str, mode: str, sharded: bool = False) -> bool:
    """Whether an update runs under `bf16_weights`: `precision` resolves to bf16, `mode`
    (train.bf16_mode) is `weights`, and the policy is not FSDP-sharded."""
    return mode == "weights" and not sharded and use_bf16(precision)


def update_precision(precision: str, mode: str, *models: nn.Module | None, sharded: bool = False,
                     buffers: dict[int, torch.Tensor] | None = None):
    """The context an update's passes run in: `bf16_weights(*models, buffers=buffers)` and their
    norms and MLPs through `fused_operators` where `uses_bf16_weights`, else nothing (the passes then
    autocast as `train.precision` says)."""
    if uses_bf16_weights(precision, mode, sharded):
        stack = contextlib.ExitStack()
        stack.enter_context(bf16_weights(*models, buffers=buffers))
        stack.enter_context(fused_operators(*models))  # bf16 activations: the norm and SwiGLU kernels take them
        return stack
    return contextlib.nullcontext()
