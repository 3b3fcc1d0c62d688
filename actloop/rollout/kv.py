"""A KV-cache layer with spare columns, for the continuous-batching decode (`engine.HFEngine`).

transformers' `DynamicLayer` grows by `torch.cat` at every decode step: each step allocates a new
[B, H, S + 1, D] tensor per layer for keys and for values, copies the old one into it and frees
it (for SmolLM2 and 32 rows of ~500 tokens, 60 copies of ~6 MB per generated token).

`SlackLayer` keeps each layer's keys and values in a buffer with `slack` spare columns: a decode
step writes its column in place (no allocation), and only every `slack`-th step re-allocates (one
copy, amortised). `keys` / `values` read as views of the filled columns, and assigning them (what
the engine's join / leave / select do) installs the tensor as the new buffer, so everything that
works on a `DynamicLayer` works unchanged. Measured on the demo's rollout (32 calculator episodes,
old engine against new, alternating): ~10% faster, the same peak memory (docs/performance.md).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

DEFAULT_SLACK = 64  # spare columns: 64 x 23 KB per token for SmolLM2 = 1.5 MB per row of the batch


class _Filled:
    """`layer.keys` / `layer.values` of a SlackLayer: reads the buffer's filled columns; assigning
    a tensor makes it the buffer, all of it filled (no spare columns until the next append)."""

    def __init__(self, buf: str, n: str):
        self.buf, self.n = buf, n

    def __get__(self, layer: Any, owner: type | None = None) -> torch.Tensor | None:
        buf = getattr(layer, self.buf)
        return None if buf is None else buf[:, :, : getattr(layer, self.n)]

    def __set__(self, layer: Any, t: torch.Tensor | None) -> None:
        setattr(layer, self.buf, t)
        setattr(layer, self.n, 0 if t is None else t.shape[-2])


class SlackLayer(DynamicLayer):
    """A DynamicLayer whose [B, H, capacity, D] buffers keep `slack` free columns after the filled
    ones (`keys` / `values`: [B, H, n, D] views)."""

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None,
                 slack: int = DEFAULT_SLACK):
        super().__init__()  # sets keys = values = None through the setters below
        self.slack = slack
        if keys is not None:
            self.keys, self.values = keys, values
            self.device, self.is_initialized = keys.device, True

    keys = _Filled("_k", "_n_k")
    values = _Filled("_v", "_n_v")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.is_initialized = key_states.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        """Append [B, H, m, D] keys and values; return the [B, H, n + m, D] views."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._k, self._n_k = _append(self._k, self._n_k, key_states, self.slack)
        self._v, self._n_v = _append(self._v, self._n_v, value_states, self.slack)
        return self.keys, self.values

    def reserve(self, m: int) -> bool:
        """Room for m more columns in both buffers (re-allocated with `slack` spare columns when
        they lack it, as an append would), to be written in place and then counted with
        `advance(m)`; False (nothing done) when the layer holds no buffers yet."""
        if self._k is None or self._v is None:
            return False
        self._k = _with_room(self._k, self._n_k, m, self.slack, self._k)
        self._v = _with_room(self._v, self._n_v, m, self.slack, self._v)
        return True

    def advance(self, m: int) -> None:
        """Count m columns written in place after the filled ones (after `reserve(m)`)."""
        self._n_k += m
        self._n_v += m

    def get_seq_length(self) -> int:
        return self._n_k if self.is_initialized else 0

    def keep(self, rows: list[int], first: int) -> None:
        """Keep batch rows `rows` (ascending) and the columns from `first` on, in place: the kept
        rows move to the front of the buffer (each lands at or before where it was, so no copy
        overwrites a row still to move) and the buffer becomes a view of them."""
        for name in ("_k", "_v"):
            buf = getattr(self, name)
            for j, src in enumerate(rows):
                if j != src:
                    buf[j].copy_(buf[src])
            setattr(self, name, buf[: len(rows), :, first:])
        self._n_k -= first
        self._n_v -= first


def _append(buf: torch.Tensor | None, n: int, new: torch.Tensor, slack: int) -> tuple[torch.Tensor, int]:
    """Write `new` ([B, H, m, D]) after the n filled columns of `buf`, re-allocating with `slack`
    spare columns when it does not fit (or the batch size changed)."""
    m = new.shape[-2]
    buf = _with_room(buf, n, m, slack, new)
    buf[:, :, n : n + m] = new
    return buf, n + m


def _with_room(buf: torch.Tensor | None, n: int, m: int, slack: int, like: torch.Tensor) -> torch.Tensor:
    """`buf`, or a new buffer holding its n filled columns with room for m more and `slack` spare
    ones, when it lacks the room or differs from `like` ([B, H, *, D]) in batch, heads or dtype."""
    if buf is None or buf.shape[:2] != like.shape[:2] or n + m > buf.shape[-2] or buf.dtype != like.dtype:
        grown = like.new_empty((*like.shape[:2], n + m + slack, like.shape[-1]))
        if buf is not None and n:
            grown[:, :, :n] = buf[:, :, :n]
        buf = grown
    return buf


def with_slack(cache: Any, slack: int = DEFAULT_SLACK) -> Any:
    """Swap a DynamicCache's plain layers for SlackLayers holding the same tensors (in place;
    returns the cache). Layers of other kinds (sliding windows, linear attention) are left as they
    are."""
    cache.layers = [SlackLayer(layer.keys, layer.values, slack)
                    if type(layer) is DynamicLayer and layer.is_initialized else layer
                    for layer in cache.layers]
    return cache


# ------------------------------------------------- caches a checkpointed training forward can replay
#
# Gradient checkpointing re-runs each decoder layer in the backward. A layer that appends to a KV
# cache would append a second time on that replay, which is why transformers drops the cache in a
# checkpointed layer (and the trainer's shared prompt prefix with it: every row then ran its whole
# prompt, ~2.4x the update's compute on the demo). These two layers make the cache's `update` a
# pure function of its inputs, so the replay computes exactly what the forward did:
#   - `KeepLayer` (the prefix pass): `update` stores the new keys / values (overwriting, not
#     appending) and returns them;
#   - `PrefixLayer` (the completion pass): holds the prefix's keys / values (with their autograd
#     history: the gradient reaches the prefix) and returns prefix + new without storing anything.


class KeepLayer(DynamicLayer):
    """`update(k, v)` keeps (k, v) as this layer's keys / values and returns them."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = key_states, value_states
        return key_states, value_states


class PrefixLayer(DynamicLayer):
    """Fixed prefix keys / values ([B, H, P, D]); `update(k, v)` returns them with k, v appended
    and stores nothing."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.keys, self.values = keys, values
        self.device, self.is_initialized = keys.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


def replayable_cache(num_layers: int, prefix: Any | None = None) -> Any:
    """A DynamicCache a checkpointed forward can replay: of `KeepLayer`s (to run a prefix), or of
    `PrefixLayer`s over `prefix`'s keys / values (to run what follows it)."""
    cache = DynamicCache()
    cache.layers = ([KeepLayer() for _ in range(num_layers)] if prefix is None
                    else [PrefixLayer(layer.keys, layer.values) for layer in prefix.layers])
    return cache
