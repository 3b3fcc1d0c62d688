"""Which attention kernel a model may use: models with attention sinks need one that keeps them.

GPT-OSS adds one learned logit per head (a "sink") to every attention softmax. In transformers,
`eager` implements the sinks; `sdpa` and flash-attention 2 have no sinks (transformers refuses
sdpa for GPT-OSS, FA2 would silently drop them); flex attention takes them on CUDA but refuses
them on CPU; on CUDA the vLLM flash-attention 3 kernel from the hub (`kernels-community/
vllm-flash-attn3`, loaded by transformers through the `kernels` package) has a forward and a
backward with sinks. Training without sinks while sampling with them is the mismatch the GPT-OSS
retrospective traced its KL and entropy blow-ups to, so a kernel that drops sinks is refused
here with a message naming the fix, not discovered after a run went wrong.

`auto` (the default of `train.attn_implementation`) picks: sdpa for models without sinks; for sink
models the hub FA3 sink kernel on a CUDA GPU where `kernels` is installed, else eager.
"""

from __future__ import annotations

import importlib.util
from typing import Any

SINK_MODEL_TYPES = ("gpt_oss",)  # config.model_type of families whose attention has learned sinks
SINK_KERNEL = "kernels-community/vllm-flash-attn3"  # the CUDA kernel with sinks (fwd + bwd), via `kernels`

ATTN_IMPLEMENTATIONS = {  # name -> (import name of the kernel package, pip name), None = built into torch
    "auto": None,
    "sdpa": None,
    "eager": None,
    "flex_attention": None,
    "flash_attention_2": ("flash_attn", "flash-attn"),
    "flash_attention_3": ("flash_attn_interface", "flash-attn-3 (built from the flash-attention repo's hopper/)"),
    SINK_KERNEL: ("kernels", "kernels"),
}
CUDA_ONLY = ("flash_attention_2", "flash_attention_3", SINK_KERNEL)


class AttentionError(RuntimeError):
    """An attention implementation this model or machine cannot use; the message names the fix."""


def has_sinks(config: Any) -> bool:
    """Whether a transformers config describes a model with attention sinks."""
    return getattr(config, "model_type", None) in SINK_MODEL_TYPES


def sink_kernel_available(cuda: bool) -> bool:
    return cuda and importlib.util.find_spec("kernels") is not None


def choose_attn_implementation(name: str, config: Any | None = None, *, cuda: bool | None = None) -> str:
    """The kernel to load `config`'s model with for `train.attn_implementation=name`.

    Raises AttentionError for an unknown name, a CUDA kernel without CUDA or its package, and a
    kernel that would drop a sink model's sinks."""
    import torch

    if cuda is None:
        cuda = torch.cuda.is_available()
    if name not in ATTN_IMPLEMENTATIONS:
        raise AttentionError(f"unknown attention implementation `{name}` (choose one of {', '.join(ATTN_IMPLEMENTATIONS)})")
    sinks = config is not None and has_sinks(config)
    if name == "auto":
        if not sinks:
            return "sdpa"
        return SINK_KERNEL if sink_kernel_available(cuda) else "eager"
    if sinks:
        fix = (f"use train.attn_implementation=eager (exact, any device) or auto"
               f"{f' / {SINK_KERNEL} (CUDA, pip install kernels)' if not cuda else f' / {SINK_KERNEL}'}")
        kind = config.model_type
        if name in ("sdpa", "flash_attention_2", "flash_attention_3"):
            raise AttentionError(f"attn_implementation={name} has no attention sinks, which {kind} models need "
                                 f"(training without the sinks the model samples with diverges); {fix}")
        if name == "flex_attention" and not cuda:
            raise AttentionError(f"attn_implementation=flex_attention cannot apply {kind}'s attention sinks on CPU; {fix}")
    need = ATTN_IMPLEMENTATIONS[name]
    if name in CUDA_ONLY and not cuda:
        alt = "eager" if sinks else "sdpa"
        raise AttentionError(f"attn_implementation={name} needs a CUDA GPU; use `{alt}` (or `auto`) on this machine")
    if need is not None and importlib.util.find_spec(need[0]) is None:
        raise AttentionError(f"attn_implementation={name} needs the `{need[0]}` package: pip install {need[1]}; "
                             "or use `auto`")
    return name
