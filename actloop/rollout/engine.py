"""Generation engines. An engine samples continuations of token-id prompts and returns the
sampled ids with their log-probs under the sampling distribution (softmax(logits / T)).

`HFEngine` runs a transformers causal LM with a KV cache:
- the longest common prefix of a batch (the system prompt and few-shot turns every episode
  shares) is encoded once and its cache broadcast to every row;
- each row's own suffix follows, left-padded inside its block ([prefix][pad][suffix]) with
  explicit position ids, so every row's next token lands in the same column;
- rows that finish (EOS or a stop string) leave the batch, so stragglers do not make the
  finished rows pay for their decode steps.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from actloop.models.attention import layer_masks, mask_dtype, uncropped_cache, uses_layer_masks
from actloop.models.routing import RoutingTrace, install_routing


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 96
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False


@dataclass(frozen=True)
class Completion:
    token_ids: tuple[int, ...]  # [T] sampled ids, including the EOS or the stop-string token
    logprobs: tuple[float, ...]  # [T] log-prob of each sampled id under the sampling distribution
    finish_reason: Literal["stop", "length", "stop_string"]
    error: str | None = None  # the request failed (actloop.rollout.isolation): no tokens, the episode ends
    # MoE models: the top-k expert ids of every position the engine ran (prompt, then the sampled
    # tokens fed back), [len(prompt) + T - 1, MoE layers, k] int16; None for dense models
    routing: Any = None


class Engine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]: ...

    def sync_weights(self, model: Any) -> None: ...


def use_bf16(precision: str) -> bool:
    if precision == "fp32":
        return False
    if precision == "bf16":
        return True
    return not torch.cuda.is_available() or torch.cuda.is_bf16_supported()


def autocast_context(precision: str):
    """bf16 autocast when asked (or `auto` and supported); the fp32 master weights stay."""
    if not use_bf16(precision):
        return contextlib.nullcontext()
    return torch.autocast(device_type="cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16)


def cache_kwarg(model: Any) -> str:
    """The forward() keyword for a KV cache: `cache` in transformers >= 5.2x, else `past_key_values`."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"


def output_cache(out: Any) -> Any:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def common_prefix_len(seqs: list[list[int]]) -> int:
    first, n = seqs[0], min(len(s) for s in seqs)
    for i in range(n):
        t = first[i]
        if any(s[i] != t for s in seqs):
            return i
    return n


def is_peft(model: Any) -> bool:
    return hasattr(model, "get_base_model") and hasattr(model, "peft_config")


def merged_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The policy's effective weights under plain-model names: for a peft LoRA model, each
    adapted layer's base weight plus its active adapters' delta (`get_delta_weight`)."""
    if not is_peft(model):
        return model.state_dict()
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    out = {}
    for name, t in base.state_dict().items():
        if ".lora_" in name:  # adapter matrices: folded in below
            continue
        out[name.replace(".base_layer.", ".")] = t
    for name, mod in base.named_modules():
        if isinstance(mod, LoraLayer) and not getattr(mod, "merged", False):
            w = mod.get_base_layer().weight
            for adapter in mod.active_adapters:
                if adapter in mod.lora_A:
                    w = w + mod.get_delta_weight(adapter)
            out[f"{name}.weight"] = w
    return out


def sample_next(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (token [B], log-prob [B]) under softmax(logits / T), nucleus-filtered."""
    logits = logits.float()
    if params.greedy:
        return logits.argmax(-1), torch.zeros(logits.shape[0])
    logp = torch.log_softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_lp, order = logp.sort(dim=-1, descending=True)
        keep = sorted_lp.exp().cumsum(-1) - sorted_lp.exp() < params.top_p
        sorted_lp = sorted_lp.masked_fill(~keep, float("-inf"))
        logp = torch.full_like(logp, float("-inf")).scatter(-1, order, sorted_lp)
        logp = torch.log_softmax(logp, dim=-1)
    # inverse-CDF sampling: torch.multinomial is ~50x slower on a 49k-entry vocabulary on CPU
    cdf = logp.exp().cumsum(-1)
    u = torch.rand(logp.shape[0], 1) * cdf[:, -1:]
    token = torch.searchsorted(cdf, u).squeeze(-1).clamp(max=logp.shape[-1] - 1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


class HFEngine:
    """Sampling from a transformers causal LM.

    weights="copy" keeps the engine's own bf16 (or fp32) copy of the policy, refreshed by
    `sync_weights` after each update — decode is faster without autocast's per-step casts, and
    the engine's log-probs then differ slightly from the trainer's (the mismatch the
    importance-sampling correction measures). A LoRA (peft) policy is copied with its adapter
    merged into plain weights (W + scale * B A), re-merged at each sync, so decode pays neither
    the adapter's extra matmuls nor autocast's casts of the frozen base weights.
    weights="live" samples from the trainer's module itself (exactness in tests).
    """

    def __init__(self, model: Any, tokenizer: Any, eos_token_ids: tuple[int, ...], stop_strings=(),
                 precision: str = "auto", weights: Literal["copy", "live"] = "copy", max_batch: int = 128):
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.stop_strings = tuple(stop_strings)
        self.precision = precision
        self.max_batch = max_batch
        self.weights = weights
        self.model = model
        if weights == "copy":
            self.model = copy.deepcopy(model).eval()
            if is_peft(self.model):
                self.model = self.model.merge_and_unload()
            if use_bf16(precision):
                self.model.to(torch.bfloat16)
            for p in self.model.parameters():
                p.requires_grad_(False)
        self.generated_tokens = 0  # over the engine's life, for throughput metrics
        self._cache_kw = cache_kwarg(self.model)
        self._layer_masks = uses_layer_masks(self.model)  # sliding-window layers: masks from positions
        self._routing = install_routing(self.model)  # MoE: record each position's experts (routing replay)

    @torch.no_grad()
    def sync_weights(self, model: Any) -> None:
        if self.weights == "live":
            return
        src = merged_state_dict(model)
        for name, t in self.model.state_dict().items():
            t.copy_(src[name])

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        out: list[Completion] = []
        for i in range(0, len(prompts), self.max_batch):
            out += self._generate_batch(prompts[i : i + self.max_batch], params)
        return out

    def _forward(self, ids, mask, pos, cache, kpos):
        """kpos [B, columns]: the position of every key column (cache + ids), for sliding layers."""
        if self._layer_masks:  # exact sliding windows over the padded layout, cache not cropped
            cache = cache if cache is not None else uncropped_cache(self.model)
            mask = layer_masks(self.model, pos, kpos, mask, mask_dtype(self.model))
        ctx = autocast_context(self.precision) if self.weights == "live" else contextlib.nullcontext()
        with ctx:
            return self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                              **{self._cache_kw: cache})

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        was_training = self.model.training
        self.model.eval()
        try:
            return self._decode(prompts, params)
        finally:
            self.model.train(was_training)

    def _decode(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        device = next(self.model.parameters()).device
        B = len(prompts)
        P = min(common_prefix_len(prompts), min(len(p) for p in prompts) - 1)
        cache = None
        trace = RoutingTrace(B) if self._routing is not None else None
        if self._routing is not None:
            self._routing.forced = None  # the engine routes on its own (a live engine shares the trainer's modules)
        if P > 0:  # the shared prefix, once
            prefix = torch.tensor([prompts[0][:P]], device=device)
            ppos = torch.arange(P, device=device)[None]
            cache = output_cache(self._forward(prefix, torch.ones_like(prefix), ppos, None, ppos))
            if trace is not None:
                trace.prefix(self._routing.take())
            cache.batch_repeat_interleave(B)
        S = max(len(p) - P for p in prompts)
        ids = torch.zeros((B, S), dtype=torch.long)
        mask = torch.zeros((B, P + S), dtype=torch.long)
        mask[:, :P] = 1
        for i, p in enumerate(prompts):
            suffix = p[P:]
            ids[i, S - len(suffix):] = torch.tensor(suffix)
            mask[i, P + S - len(suffix):] = 1
        pos = (P + mask[:, P:].cumsum(-1) - 1).clamp(min=0)
        ids, mask, pos = ids.to(device), mask.to(device), pos.to(device)
        kpos = torch.cat([torch.arange(P, device=device).expand(B, P), pos], dim=1)  # [B, P + S]
        out = self._forward(ids, mask, pos, cache, kpos)
        if trace is not None:
            trace.block(self._routing.take(), [len(p) - P for p in prompts])
        cache, next_pos = output_cache(out), pos[:, -1] + 1

        rows = list(range(B))  # original index of each live row
        tokens: list[list[int]] = [[] for _ in range(B)]
        logps: list[list[float]] = [[] for _ in range(B)]
        reasons: list[str] = ["length"] * B
        for step in range(params.max_new_tokens):
            tok, lp = sample_next(out.logits[:, -1], params)
            done_now = []
            for j, i in enumerate(rows):
                t = int(tok[j])
                tokens[i].append(t)
                logps[i].append(float(lp[j]))
                if t in self.eos_token_ids:
                    reasons[i] = "stop"
                    done_now.append(j)
                elif self.stop_strings and self._hit_stop(tokens[i]):
                    reasons[i] = "stop_string"
                    done_now.append(j)
            if step == params.max_new_tokens - 1 or len(done_now) == len(rows):
                break
            if done_now:
                keep = [j for j in range(len(rows)) if j not in set(done_now)]
                keep_t = torch.tensor(keep, device=device)
                cache.batch_select_indices(keep_t)
                tok, mask, next_pos, kpos = tok[keep_t], mask[keep_t], next_pos[keep_t], kpos[keep_t]
                rows = [rows[j] for j in keep]
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype, device=device)], dim=1)
            kpos = torch.cat([kpos, next_pos[:, None]], dim=1)
            out = self._forward(tok[:, None].to(device), mask, next_pos[:, None], cache, kpos)
            if trace is not None:
                trace.step(self._routing.take(), rows)
            next_pos = next_pos + 1
        self.generated_tokens += sum(len(t) for t in tokens)
        return [Completion(tuple(tokens[i]), tuple(logps[i]), reasons[i], routing=trace.row(i) if trace else None)
                for i in range(B)]

    def _hit_stop(self, ids: list[int]) -> bool:
        tail = self.tokenizer.decode(ids[-4:], skip_special_tokens=False)
        if not any(s[-1] in tail for s in self.stop_strings):
            return False
        text = self.tokenizer.decode(ids[-32:], skip_special_tokens=False)
        return any(s in text for s in self.stop_strings)
