"""Which attention kernel a model may use: models with attention sinks need one that keeps them.

GPT-OSS adds one learned logit per head (a "sink") to every attention softmax. In transformers,
`eager` implements the sinks; `sdpa` and flash-attention 2 have no sinks (transformers refuses
sdpa for GPT-OSS, FA2 would silently drop them); flex attention takes them on CUDA but refuses
them on CPU; on CUDA the vLLM flash-attention 3 kernel from the hub (`kernels-community/
vllm-flash-attn3`, loaded by transformers through the `kernels` package) has a forward and a
backward with sinks. Training without sinks while sampling with them is the mismatch the GPT-OSS
retrospective traced its KL and entropy blow-ups to, so a kernel that drops sinks is refused
here with a message naming the fix, not discovered after a run went wrong.

`auto` (the default of `train.attn_implementation`) picks: for models without sinks `actloop_sdpa` on
a CPU (SDPA with a matmul path for small score tensors, where torch's bf16 flash kernel is slow:
actloop/models/cpu_attention.py) and sdpa on CUDA; for sink models the hub FA3 sink kernel on a
CUDA GPU where `kernels` is installed, else eager.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from actloop.models import cpu_attention

SINK_MODEL_TYPES = ("gpt_oss",)  # config.model_type of families whose attention has learned sinks
SINK_KERNEL = "kernels-community/vllm-flash-attn3"  # the CUDA kernel with sinks (fwd + bwd), via `kernels`

ATTN_IMPLEMENTATIONS = {  # name -> (import name of the kernel package, pip name), None = built into torch
    "auto": None,
    "sdpa": None,
    cpu_attention.NAME: None,
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
            return "sdpa" if cuda else cpu_attention.register()
        return SINK_KERNEL if sink_kernel_available(cuda) else "eager"
    if sinks:
        fix = (f"use train.attn_implementation=eager (exact, any device) or auto"
               f"{f' / {SINK_KERNEL} (CUDA, pip install kernels)' if not cuda else f' / {SINK_KERNEL}'}")
        kind = config.model_type
        if name in ("sdpa", cpu_attention.NAME, "flash_attention_2", "flash_attention_3"):
            raise AttentionError(f"attn_implementation={name} has no attention sinks, which {kind} models need "
                                 f"(training without the sinks the model samples with diverges); {fix}")
        if name == "flex_attention" and not cuda:
            raise AttentionError(f"attn_implementation=flex_attention cannot apply {kind}'s attention sinks on CPU; {fix}")
    if name == cpu_attention.NAME:
        return cpu_attention.register()
    need = ATTN_IMPLEMENTATIONS[name]
    if name in CUDA_ONLY and not cuda:
        alt = "eager" if sinks else "sdpa"
        raise AttentionError(f"attn_implementation={name} needs a CUDA GPU; use `{alt}` (or `auto`) on this machine")
    if need is not None and importlib.util.find_spec(need[0]) is None:
        raise AttentionError(f"attn_implementation={name} needs the `{need[0]}` package: pip install {need[1]}; "
                             "or use `auto`")
    return name


# -- sliding-window layers: exact masks from positions, caches that keep every key ------------------
#
# transformers builds a sliding layer's mask in *column* space (key column > query column - window)
# and, given a config, its DynamicCache keeps only the last `window` keys of a sliding layer. Both
# are right for one unpadded row. They are wrong for the layouts actloop runs: the engine's
# [prefix][pad][suffix] blocks, the trainer's right-padded per-prompt prefixes followed by the
# suffixes. There a pad column counts as a token of the window (a row sees fewer real keys than the
# window), and a cropped cache keeps pads instead of real keys. So for models with sliding layers
# actloop passes (a) a cache without cropping (`uncropped_cache`) and (b) one 4-D mask per layer
# type computed from the tokens' *positions* (`layer_masks`): key k is visible to query q when k is
# a real token, pos_k <= pos_q, and, in a sliding layer, pos_q - pos_k < window — the rule one
# unpadded sequence gets, whatever the padding layout. Kernels that take no 4-D masks (flash,
# the hub sink kernel) keep transformers' own masks.

EXPLICIT_MASK_KERNELS = ("eager", "sdpa", cpu_attention.NAME)


def sliding_window(config: Any) -> int | None:
    """The window of a model whose layers include sliding-window attention, else None."""
    types = getattr(config, "layer_types", None) or ()
    window = getattr(config, "sliding_window", None)
    return int(window) if window and "sliding_attention" in types else None


def uses_layer_masks(model: Any) -> bool:
    """Whether `model` (a transformers model, peft-wrapped or not, or its backbone) gets explicit
    per-layer masks and an uncropped cache from actloop."""
    config = model.config
    return sliding_window(config) is not None and getattr(config, "_attn_implementation", None) in EXPLICIT_MASK_KERNELS


def uncropped_cache(model: Any):
    """A DynamicCache that keeps every key of every layer (no sliding-window cropping), for a model
    that `uses_layer_masks`; None (let transformers make its own) otherwise."""
    if not uses_layer_masks(model):
        return None
    from transformers import DynamicCache

    return DynamicCache()


def layer_masks(model: Any, q_pos, k_pos, k_valid, dtype) -> dict | None:
    """Per-layer-type additive masks [B, 1, q, kv] for a model that `uses_layer_masks`, else None.

    q_pos [B, q]: positions of the queries; k_pos [B, kv], k_valid [B, kv]: positions and
    realness of every key column (the cache's columns followed by the queries' own). A query
    with no visible key (a pad) attends to every column, so no row of the softmax is empty (no
    NaN reaches the real rows through a pad's value vector); its output is never read."""
    import torch

    window = sliding_window(model.config)
    if window is None or not uses_layer_masks(model):
        return None
    q = q_pos[:, :, None]  # [B, q, 1]
    k = k_pos[:, None, :]  # [B, 1, kv]
    causal = k_valid.bool()[:, None, :] & (k <= q)  # [B, q, kv]
    sliding = causal & (q - k < window)  # [B, q, kv]
    low = torch.finfo(dtype).min
    out = {}
    for name, allowed in (("full_attention", causal), ("sliding_attention", sliding)):
        allowed = allowed | ~allowed.any(-1, keepdim=True)  # pad queries: see everything, read nothing
        out[name] = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, low)[:, None]
    return out


def mask_dtype(model: Any):
    """The dtype transformers would build masks in: that of the input embeddings."""
    return model.get_input_embeddings().weight.dtype
