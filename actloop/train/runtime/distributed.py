"""Several processes, one training loop: torchrun detection, the process group, FSDP2 sharding.

`actloop train` is one process by default (and `breakpoint()` works in it). Launched by
`torchrun --nproc_per_node N -m actloop train ...`, every rank runs the same loop
(`actloop.train.rl.loop.train_online`) on its own share of each step's prompts:

- prompts are split in contiguous blocks of whole groups (`Dist.shard`), so group advantages
  are computed locally and equal the one-process ones;
- loss normalisers that depend on batch totals (trajectories, tokens) are all-reduced before the
  backward (`Dist.sum_ints`), and gradients are SUMMED over ranks (not averaged), so the
  gradient equals the one-process gradient up to float reduction order;
- with FSDP2 (`distributed.fsdp`, the default) each decoder layer is one `fully_shard` unit and
  the root (embeddings, tied head, final norm) another. The update calls the backbone and the
  head directly (`actloop.train.numerics.logprobs`), never the root's forward, so a forward pre-hook on the
  backbone unshards the root and FSDP's post-backward callback reduce-scatters and reshards it;
- every rank must run the same collectives in the same order: each rank runs as many forward /
  backward passes per optimizer step as the busiest rank (`Dist.missing` + `Dist.dummy_pass`),
  and the update turns off shared-prefix KV caching (its extra backbone call depends on data);
- after each update the full weights are all-gathered into every rank's engine copy
  (`Dist.sync_engine`); rank 0 alone writes the run directory, metrics and the final model.

Single process, `Dist()` is a no-op object: `rank 0, world 1`, and `UpdateContext.dist` is None,
so the one-process update path is untouched.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from actloop.algos import ALGORITHMS
from actloop.config import Config, ConfigError
from actloop.rollout.factory import TORCHRUN_ENGINES
from actloop.train.numerics.logprobs import token_logprobs


def launched_by_torchrun(env: dict[str, str] | None = None) -> bool:
    """True when RANK / WORLD_SIZE / LOCAL_RANK say this process is one of several."""
    env = os.environ if env is None else env
    return all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")) and int(env["WORLD_SIZE"]) > 1


def resolve_backend(backend: str) -> str:
    """`auto` -> nccl where CUDA is available, else gloo."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def check_supported(cfg: Config, world: int) -> None:
    """Refuse, with the reason, what the multi-process update does not reproduce exactly."""
    t = cfg.train
    problems = []
    if t.prompts_per_step % world:
        problems.append(f"train.prompts_per_step ({t.prompts_per_step}) must be a multiple of the world size ({world})")
    alg = ALGORITHMS[cfg.algo]
    if not alg.torchrun:
        names = [k for k, a in ALGORITHMS.items() if a.torchrun]
        ok = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
        problems.append(f"algo={cfg.algo}: only {ok} run under torchrun (their advantages are per group)")
    elif alg.params.get("scale") == "train.adv_scale" and t.adv_scale == "batch":
        problems.append("train.adv_scale=batch normalises over the whole batch; use group or none under torchrun")
    if t.minibatch_size:
        problems.append("train.minibatch_size must be 0 under torchrun (one optimizer step per epoch: each "
                        "rank's mini-batches would be cut from its own share, not from the whole batch as one "
                        "process cuts them, so the steps would differ from one process; not implemented)")
    if t.entropy_coef:
        problems.append("train.entropy_coef must be 0 under torchrun")
    if cfg.lora.enabled:
        problems.append("lora.enabled is not supported under torchrun (the engine copy is the base with the "
                        "adapter merged in, while the FSDP sync copies gathered tensors by name; gathering and "
                        "merging a sharded adapter is not implemented, and a 135M-2B LoRA run fits one device)")
    if cfg.rollout.engine not in TORCHRUN_ENGINES:
        problems.append(f"rollout.engine={cfg.rollout.engine}: only the engines {', '.join(TORCHRUN_ENGINES)} run "
                        "under torchrun")
    if problems:
        raise ConfigError("; ".join(problems))


@dataclass
class Dist:
    """This process's place among the ranks. The default is one process: every helper is a no-op."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    backend: str | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    fsdp: bool = False  # the policy is sharded with FSDP2 (set by `wrap`)
    root: Any = None  # the FSDP root module, once wrapped

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    # ---- collectives (no-ops in one process) ----------------------------------------------

    def barrier(self) -> None:
        if self.active:
            torch.distributed.barrier()

    def sum_ints(self, *xs: int | float) -> tuple:
        """Totals over ranks of a few numbers (one all-reduce)."""
        if not self.active:
            return xs
        t = torch.tensor([float(x) for x in xs], dtype=torch.float64)
        torch.distributed.all_reduce(t)
        return tuple(int(v) if isinstance(x, int) else float(v) for x, v in zip(xs, t.tolist()))

    def max_int(self, x: int) -> int:
        if not self.active:
            return x
        t = torch.tensor([x], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return int(t)

    def all_gather_objects(self, obj: Any) -> list[Any]:
        """[rank 0's obj, rank 1's obj, ...] on every rank."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def gather_lists(self, xs: list) -> list:
        """The ranks' lists concatenated in rank order (= prompt order, see `shard`)."""
        return [x for part in self.all_gather_objects(xs) for x in part]

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's obj on every rank."""
        if not self.active:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def shard(self, rows: list) -> list:
        """This rank's contiguous block of `rows` (whole groups when rows are prompts)."""
        if not self.active:
            return rows
        if len(rows) % self.world:
            raise ValueError(f"{len(rows)} rows cannot be split evenly over {self.world} ranks")
        n = len(rows) // self.world
        return rows[self.rank * n : (self.rank + 1) * n]

    # ---- FSDP2 -------------------------------------------------------------------------------

    def wrap(self, model: Any, reshard_after_forward: bool = True, mixed_precision: str = "auto") -> Any:
        """Shard a transformers causal LM with FSDP2: each decoder layer, then the root.

        Gradients are summed over ranks (divide factor 1, sum-only collectives): the update's
        loss weights already use global totals. Returns the same module, now an FSDPModule."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not self.active:
            return model
        mesh = init_device_mesh(self.device.type, (self.world,))
        mp = mixed_precision_policy(mixed_precision, self.device.type)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        layers = list(base.model.layers)
        kw = dict(mesh=mesh, mp_policy=mp or MixedPrecisionPolicy())
        for layer in layers:
            fully_shard(layer, reshard_after_forward=reshard_after_forward, **kw)
        fully_shard(model, **kw)
        for m in [*layers, model]:
            m.set_force_sum_reduction_for_comms(True)
            m.set_gradient_divide_factor(1.0)
        # The update calls base.model (the backbone) and base.lm_head directly, not the root's
        # forward: unshard the root's own parameters (embeddings, tied head, final norm) before
        # the backbone runs; FSDP's end-of-backward callback reduce-scatters and reshards them.
        base.model.register_forward_pre_hook(lambda module, args: model.unshard())
        # Lazy init from the root (one token through the root's forward), so the root is the
        # root and the layers share its state; otherwise the first layer to run would claim it.
        with torch.no_grad():
            model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=self.device))
        model.reshard()  # the root keeps its gathered weights after forward: back to shards, so that
        # model.parameters() (what the optimizer is built from) are the sharded DTensors
        self.fsdp, self.root = True, model
        return model

    def full_state_dict(self, model: Any) -> dict[str, torch.Tensor]:
        """The unsharded weights on every rank (a collective: every rank must call it)."""
        if not self.fsdp:
            return model.state_dict()
        from torch.distributed.tensor import DTensor

        model.reshard()
        state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in model.state_dict().items()}
        # tied parameters (embeddings and lm_head) come back as separate copies: tie them again, so
        # that save_pretrained writes one tensor
        first: dict[int, str] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in first and name in state and first[id(p)] in state:
                state[name] = state[first[id(p)]]
            first.setdefault(id(p), name)
        return state

    @torch.no_grad()
    def sync_engine(self, engine: Any, model: Any) -> None:
        """New weights into the engine's copy (the engine's own `sync_weights` when unsharded)."""
        if not self.fsdp:
            engine.sync_weights(model)
            return
        if engine.weights == "live":
            raise ConfigError("an FSDP-sharded policy cannot be sampled live; the engine needs weights='copy'")
        engine.load_weights(self.full_state_dict(model).items())

    def clip_grad_norm_(self, params: list[torch.Tensor], max_norm: float) -> float:
        """Clip by the global norm of the whole (sharded or replicated) gradient; return it.

        FSDP2 gradients are DTensor shards: their norm is a partial DTensor made whole with
        `full_tensor()` (as torchtitan does). Without FSDP each rank holds full gradients of its
        own data: they are summed over ranks first."""
        if not self.active:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        if not self.fsdp:  # replicated: sum every gradient (zeros where this rank had none)
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                torch.distributed.all_reduce(p.grad)
        grads = [p.grad for p in params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, 2.0)
        if hasattr(total, "full_tensor"):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return float(total)

    def missing(self, n_local: int) -> int:
        """How many extra passes this rank runs so that every rank runs as many as the busiest
        (call before the passes: it is a collective)."""
        if not self.fsdp:
            return 0
        return self.max_int(n_local) - n_local

    def dummy_pass(self, ctx: Any, grad: bool) -> None:
        """One forward (and backward, with `grad`) of a two-token sequence with zero loss: the
        same FSDP all-gathers and reduce-scatters as a real micro-batch, zero gradient."""
        # (gradient checkpointing and head chunking change no collective: left at their defaults)
        with torch.set_grad_enabled(grad):
            out = token_logprobs(ctx.models.policy, [[0, 0]], [[0, 1]], 1.0, ctx.cfg.train.precision,
                                 share_prefix=False)
            if grad:
                (out.logp.sum() * 0.0).backward()

    def gather_update_metrics(self, acc: dict[str, list[float]], metrics: dict[str, float],
                              n_work: int) -> tuple[dict[str, list[float]], dict[str, float], int]:
        """An update's metrics over all ranks: per-micro-batch lists concatenated in rank order,
        per-rank means averaged (the ranks hold equal numbers of trajectories), counts summed."""
        parts = self.all_gather_objects((acc, metrics, n_work))
        merged: dict[str, list[float]] = {}
        for a, _, _ in parts:
            for k, v in a.items():
                merged.setdefault(k, []).extend(v)
        keys = {k for _, m, _ in parts for k in m}
        means = {k: sum(m[k] for _, m, _ in parts if k in m) / sum(k in m for _, m, _ in parts) for k in keys}
        return merged, means, sum(n for _, _, n in parts)

    # ---- the trainer's hand-offs -----------------------------------------------------------

    def prepare(self, cfg: Config, models: Any, engine: Any) -> Any:
        """Under torchrun: the engine's copy onto this rank's device, then the policy sharded
        (after the engine copied it: FSDP modules cannot be deep-copied). Returns the policy."""
        if not self.active:
            return models.policy
        torch.manual_seed(cfg.seed + self.rank)  # ranks sample their own prompts with their own draws
        if hasattr(engine, "to"):  # an engine holding its own copy in this process: onto this rank's device
            engine.to(self.device)
        if models.reference is not None:
            models.reference.to(self.device)
        if not cfg.distributed.fsdp:
            return models.policy.to(self.device)
        return self.wrap(models.policy, cfg.distributed.reshard_after_forward, cfg.distributed.mixed_precision)

    def sampler(self, sampler: Any) -> Any:
        """The trainer's prompt sampler, handing this rank its block of each step's prompts."""
        return ShardedSampler(sampler, self) if self.active else sampler

    def scratch_dir(self) -> Any:
        """Where a rank other than 0 lets the loop write what rank 0 writes for real (deleted at
        `close`)."""
        import tempfile
        from pathlib import Path

        self._scratch = Path(tempfile.mkdtemp(prefix=f"actloop-rank{self.rank}-"))
        return self._scratch

    def printer(self, print_fn: Any) -> Any:
        return print_fn if self.is_main else (lambda *args, **kwargs: None)

    def main_only(self, cfg: Config) -> Config:
        """`cfg` on rank 0; elsewhere without the external metric sinks (TensorBoard, W&B)."""
        import dataclasses

        if self.is_main:
            return cfg
        return dataclasses.replace(cfg, monitor=dataclasses.replace(cfg.monitor, tensorboard=False, wandb_project=None))

    def first(self, value: Any) -> Any:
        """The first non-None of the ranks' values, on every rank (a stop decision all ranks share)."""
        if not self.active:
            return value
        return next((v for v in self.all_gather_objects(value) if v is not None), None)

    def save_pretrained(self, model: Any, out: Any) -> None:
        """The full model as a transformers checkpoint, written by rank 0 (every rank gathers)."""
        if not self.fsdp:
            if self.is_main:
                model.save_pretrained(out)
            return
        state = self.full_state_dict(model)
        if self.is_main:
            model.save_pretrained(out, state_dict=state)

    def close(self) -> None:
        scratch = getattr(self, "_scratch", None)
        if scratch is not None:
            import shutil

            shutil.rmtree(scratch, ignore_errors=True)
        if self.active and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class ShardedSampler:
    """Every rank draws the same prompts (same seed, same calls) and keeps its own block."""

    def __init__(self, inner: Any, dist: Dist):
        self.inner, self.dist = inner, dist

    def next(self, n: int) -> list:
        rows = self.inner.next(n)
        if n % self.dist.world:  # a refill round (dynamic sampling) may ask for a few prompts
            rows = rows + self.inner.next(self.dist.world - n % self.dist.world)
        return self.dist.shard(rows)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.inner.load_state_dict(d)


def mixed_precision_policy(mode: str, device_type: str):
    """`auto`: bf16 parameters with fp32 gradient reduction on CUDA, none on CPU (CPU training
    keeps fp32 master weights and the trainer's own bf16 autocast)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mode == "none" or (mode == "auto" and device_type != "cuda"):
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def init_distributed(cfg: Config, env: dict[str, str] | None = None) -> Dist:
    """A `Dist` for this process: the process group when launched by torchrun, else one process."""
    env = os.environ if env is None else env
    if not launched_by_torchrun(env):
        return Dist()
    rank, world, local_rank = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
    check_supported(cfg, world)
    backend = resolve_backend(cfg.distributed.backend)
    device = torch.device("cpu")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ConfigError("distributed.backend=nccl needs CUDA; use gloo on CPU")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend=backend, rank=rank, world_size=world)
    return Dist(rank=rank, world=world, local_rank=local_rank, backend=backend, device=device)
