"""Record and replay mixture-of-experts routing on transformers models: the model side of
rollout routing replay (R3). The maths (gate weights over a replayed choice, disagreement) are
in actloop/algos/routing.py; this module only reaches into the router modules.

`install_routing(model)` wraps each supported router's forward once (idempotent; a deep copy of
the model gets its own wrappers and state). Afterwards `routing_state(model)`:

- records, for every forward, each MoE layer's own top-k ids of every token (`take()` returns
  them as [N, L, k] with N = the flattened batch x sequence of that forward);
- replays, while `forced` is set to an [N, L, k] tensor (-1 = not recorded), those ids with
  gate weights from the model's own router logits. `forced` stays set until the next call sets
  it, so a gradient-checkpointing recompute in the backward routes like the forward did.

Supported routers (class name -> gate): `GptOssTopKRouter` (softmax over the k chosen logits).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

import torch

from actloop.algos.routing import replay_topk
from actloop.models.resolve import ModelError

ROUTERS = ("GptOssTopKRouter",)  # forward(h [N, H]) -> (logits [N, E], gate weights [N, k], ids [N, k])


class RoutingError(ModelError):
    """Routing replay asked of a model it cannot serve; the message says why."""


@dataclass
class RoutingState:
    num_layers: int
    top_k: int
    forced: torch.Tensor | None = None  # [N, L, k] ids to replay in the next forwards, -1 = own choice
    seen: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [N, k] own top-k of the last forward
    used: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [N, k] top-k the forward used

    def take(self, which: str = "seen") -> torch.Tensor:
        """The last forward's top-k ids, [N, L, k] (int16, on CPU): the routers' own choice
        (`seen`) or the one used after replay (`used`); clears both."""
        got = getattr(self, which)
        if len(got) != self.num_layers:
            raise RoutingError(f"routing recorded for {len(got)} of {self.num_layers} MoE layers")
        out = torch.stack([got[i] for i in range(self.num_layers)], dim=1).to("cpu", torch.int16)
        self.seen, self.used = {}, {}
        return out


def moe_routers(model: Any) -> list[torch.nn.Module]:
    """The supported router modules of `model`, in layer order."""
    return [m for _, m in model.named_modules() if type(m).__name__ in ROUTERS]


def is_moe(model: Any) -> bool:
    return bool(moe_routers(model))


def _routed_forward(self, hidden_states):
    state: RoutingState = self._actloop_routing
    logits, weights, idx = type(self).forward(self, hidden_states)
    layer = self._actloop_layer
    state.seen[layer] = idx.detach()
    if state.forced is not None:
        forced = state.forced[:, layer]  # [N, k]
        if forced.shape[0] != idx.shape[0]:
            raise RoutingError(f"replayed routing covers {forced.shape[0]} tokens, the forward runs {idx.shape[0]}")
        gate, idx = replay_topk(logits, idx, forced.to(idx.device))
        weights = gate.to(weights.dtype)
    state.used[layer] = idx.detach()
    return logits, weights, idx


def install_routing(model: Any) -> RoutingState | None:
    """Wrap the routers of `model` (once); its RoutingState, or None for a model without MoE."""
    routers = moe_routers(model)
    if not routers:
        return None
    state = getattr(routers[0], "_actloop_routing", None)
    if state is not None and all(getattr(r, "_actloop_routing", None) is state for r in routers):
        return state
    state = RoutingState(num_layers=len(routers), top_k=int(routers[0].top_k))
    for layer, router in enumerate(routers):
        router._actloop_routing = state
        router._actloop_layer = layer
        router.forward = types.MethodType(_routed_forward, router)
    return state


def routing_state(model: Any) -> RoutingState | None:
    routers = moe_routers(model)
    return getattr(routers[0], "_actloop_routing", None) if routers else None


def require_routing(model: Any) -> RoutingState:
    """install_routing, or a clear error for a model whose routers actloop cannot replay."""
    state = install_routing(model)
    if state is None:
        names = sorted({type(m).__name__ for m in model.modules() if "router" in type(m).__name__.lower()
                        or type(m).__name__.endswith("Gate")})
        raise RoutingError("train.routing_replay needs a mixture-of-experts model with a supported router "
                           f"({', '.join(ROUTERS)}); this model has {names or 'none'}")
    return state


class RoutingTrace:
    """Per-row routing of one engine batch, in the order the engine ran the positions: the
    shared prefix, each row's own prompt suffix, then each sampled token that was fed back.
    `row(i)` is [len(prompt_i) + len(sampled_i) - 1, L, k] (the last sampled token is never
    an input)."""

    def __init__(self, batch: int):
        self.parts: list[list[torch.Tensor]] = [[] for _ in range(batch)]

    def prefix(self, ids: torch.Tensor) -> None:  # [P, L, k], shared by every row
        for p in self.parts:
            p.append(ids)

    def block(self, ids: torch.Tensor, lengths: list[int]) -> None:  # [B * S, L, k], rows left-padded
        per_row = ids.view(len(lengths), -1, *ids.shape[1:])
        for i, n in enumerate(lengths):
            self.parts[i].append(per_row[i, per_row.shape[1] - n :])

    def step(self, ids: torch.Tensor, rows: list[int]) -> None:  # [len(rows), L, k], one token per row
        for j, i in enumerate(rows):
            self.parts[i].append(ids[j : j + 1])

    def row(self, i: int) -> torch.Tensor:
        return torch.cat(self.parts[i]) if self.parts[i] else torch.empty(0, dtype=torch.int16)
