"""Checkpoints a run can resume from exactly.

    RUN_DIR/checkpoints/step-000012/
        policy.safetensors   trainable parameters: the whole model, or only the LoRA adapter
        state.pt             optimizer, scheduler, critic, every RNG, the prompt sampler, KL beta,
                             step, summary so far, failure guard, `extra` (other components)
        meta.json            step, time, what the policy file holds (for people)

A checkpoint is written under `step-000012.tmp-<pid>`, fsynced, then renamed into place, so a
reader sees a whole checkpoint or none: `load_latest` ignores `.tmp-*` directories (a write
that was killed). Only then are older checkpoints deleted (the newest `keep` are kept), so at
every instant at least one complete checkpoint is on disk: a directory being replaced (the same
step written again) is first renamed aside to `step-000012.old-<pid>`, which `list_checkpoints`
still counts until its replacement is in place. A write that fails (ENOSPC: no space left)
removes its partial directory, leaves the previous checkpoint as it was and raises
`CheckpointError` naming it.

Under torchrun (`save_sharded`) the same directory holds `dcp/` (the policy and AdamW state
written by every rank with `torch.distributed.checkpoint`), `state.pt` (rank 0: scheduler,
sampler, summary, ...) and `rank-00001.pt` per rank (that rank's RNGs); all ranks write into one
temporary directory, then rank 0 renames it into place. A sharded checkpoint resumes under
torchrun with the same number of processes.

`state.pt` is a pickle (RNG states hold Python tuples and NumPy arrays): load checkpoints you
wrote, not ones from strangers.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from actloop.config import Config, ConfigError, load_config

CHECKPOINTS = "checkpoints"
_NAME = re.compile(r"^step-(\d{6,})(\.old-\d+)?$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (the disk is full, ...); the previous one is intact."""


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path

    @property
    def sharded(self) -> bool:
        """Written under torchrun (`save_sharded`): resume it under torchrun."""
        return (self.path / "dcp").is_dir()

    def load_state(self) -> dict[str, Any]:
        return torch.load(self.path / "state.pt", map_location="cpu", weights_only=False)

    def load_policy(self, model: torch.nn.Module) -> None:
        from safetensors.torch import load_file

        load_trainable(model, load_file(str(self.path / "policy.safetensors")))


# --- what a checkpoint holds ----------------------------------------------------------------


def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that train (all of them, or a LoRA adapter's), tied weights once."""
    return {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}


def load_trainable(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    expected = {n for n, p in model.named_parameters() if p.requires_grad}
    if set(tensors) != expected:
        missing, unexpected = sorted(expected - set(tensors))[:3], sorted(set(tensors) - expected)[:3]
        raise ConfigError(f"the checkpoint's policy does not fit this model (missing {missing}, unexpected "
                          f"{unexpected}): was it trained with another model or lora setting?")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, t in tensors.items():
            params[n].copy_(t)


def rng_state() -> dict[str, Any]:
    """Python `random`, NumPy, torch CPU (and CUDA when present) generator states."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def apply_optimizer_config(optimizer: torch.optim.Optimizer, scheduler: Any, lrs: list[float],
                           weight_decay: float) -> None:
    """After loading a checkpoint's optimizer and LambdaLR scheduler: the config's learning rate
    of each param group and weight decay win (their state_dicts carry the old ones, which would
    silently undo `resume=RUN_DIR train.lr=...`); the schedule continues at its step. Unchanged
    settings give back exactly the loaded values."""
    for g, lr in zip(optimizer.param_groups, lrs):
        g["initial_lr"], g["weight_decay"] = lr, weight_decay
    scheduler.base_lrs = [g["initial_lr"] for g in optimizer.param_groups]
    for g, base, fn in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        g["lr"] = base * fn(scheduler.last_epoch)  # what LambdaLR.get_lr computes
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]


# --- writing and finding --------------------------------------------------------------------


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(run_dir: str | Path, step: int, policy: torch.nn.Module, state: dict[str, Any], keep: int = 1) -> Path:
    """Write checkpoint `step` atomically, then keep the newest `keep`. Returns its directory.
    Raises `CheckpointError` (the partial write removed, older checkpoints untouched) when the
    disk is full."""
    from safetensors.torch import save_file

    root = Path(run_dir) / CHECKPOINTS
    final = root / f"step-{step:06d}"
    tmp = root / f"{final.name}.tmp-{os.getpid()}"
    with _writing(tmp, step):
        trainable = trainable_state_dict(policy)
        save_file(trainable, str(tmp / "policy.safetensors"), metadata={"format": "pt"})
        torch.save({**state, "step": step}, tmp / "state.pt")
        total = sum(p.numel() for p in policy.parameters())
        held = sum(t.numel() for t in trainable.values())
        _write_meta(tmp, step, "full model" if held >= total else f"trainable parameters only ({held} of {total})")
    install(tmp, final)
    prune(root, keep)
    return final


def _write_meta(tmp: Path, step: int, policy: str, **more: Any) -> None:
    (tmp / "meta.json").write_text(json.dumps({
        "step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "policy": policy, **more}) + "\n")


class _writing:
    """`with _writing(tmp, step):` a fresh `tmp` directory to fill; on leaving, every file in
    it is fsynced. An error inside removes `tmp`; a full disk (ENOSPC, EDQUOT, or another error
    while a probe write finds no space: torch.save reports a full disk as a RuntimeError
    "unexpected pos ...") becomes `CheckpointError`."""

    def __init__(self, tmp: Path, step: int, fresh: bool = True):
        self.tmp, self.step, self.fresh = tmp, step, fresh

    def __enter__(self) -> Path:
        try:
            self.tmp.parent.mkdir(parents=True, exist_ok=True)
            if self.fresh:
                shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp.mkdir(exist_ok=not self.fresh)
        except OSError as e:
            self._fail(e)
        return self.tmp

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is None:
            try:
                for f in self.tmp.rglob("*"):
                    if f.is_file():
                        _fsync(f)
                _fsync(self.tmp)
                return False
            except OSError as e:
                exc = e
        if isinstance(exc, Exception):
            self._fail(exc)
        return False

    def _fail(self, exc: Exception) -> None:
        full = (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)) or _no_space(self.tmp.parent)
        shutil.rmtree(self.tmp, ignore_errors=True)
        if full:
            raise _full_error(self.tmp.parent, self.step, exc) from exc
        raise exc


def _no_space(directory: Path, probe: int = 1 << 16) -> bool:
    """Whether 64 KiB more cannot be written in `directory` (a write, not statvfs: quotas count)."""
    path = directory / f".space-probe-{os.getpid()}"
    try:
        with open(path, "wb") as f:
            f.write(b"\0" * probe)
            f.flush()
            os.fsync(f.fileno())
        return False
    except OSError as e:
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    finally:
        path.unlink(missing_ok=True)


def _full_error(root: Path, step: int, exc: Exception) -> CheckpointError:
    prev = [c.step for c in list_checkpoints(root.parent)]
    kept = (f"the previous checkpoint (step {prev[-1]}, {root / f'step-{prev[-1]:06d}'}) is intact"
            if prev else "no earlier checkpoint exists")
    return CheckpointError(f"could not write the checkpoint of step {step} in {root}: no space left on device "
                           f"({exc}); the partial write was removed and {kept}. Free space, then "
                           f"continue with `actloop train resume={root.parent}`")


def install(tmp: Path, final: Path) -> None:
    """Rename the finished directory `tmp` to `final`. An existing `final` (the same step written
    again, a run's `final/` model) is renamed aside first and deleted only after `tmp` is in its
    place: a crash at any point leaves one complete copy (`list_checkpoints` reads an `.old-*`
    checkpoint whose replacement never arrived)."""
    aside = final.with_name(f"{final.name}.old-{os.getpid()}")
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    _fsync(final.parent)
    shutil.rmtree(aside, ignore_errors=True)


def save_sharded(run_dir: str | Path, step: int, dist: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 state: dict[str, Any], keep: int = 1) -> Path:
    """Under torchrun, every rank calls this (it is a collective): the sharded policy and
    optimizer through `torch.distributed.checkpoint`, each rank's `state` (RNGs, sampler, ...)
    in its own file, all into one temporary directory that rank 0 renames into place once every
    rank has finished. `run_dir` is rank 0's run directory (on a file system all ranks share).
    A write that fails on any rank fails on every rank with the same `CheckpointError`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = Path(run_dir) / CHECKPOINTS
    final = root / f"step-{step:06d}"
    tmp = root / f"{final.name}.tmp-{dist.broadcast_object(os.getpid())}"  # rank 0's pid: one name
    model_sd, optim_sd = get_state_dict(model, optimizer)  # a collective: before anything can fail
    error: str | None = None
    try:
        if dist.is_main:
            with _writing(tmp, step):
                pass
        dist.barrier()
        with _writing(tmp, step, fresh=False):
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "dcp"))
            torch.save({**state, "step": step}, tmp / ("state.pt" if dist.is_main else f"rank-{dist.rank:05d}.pt"))
            if dist.is_main:
                _write_meta(tmp, step, f"sharded by torch.distributed.checkpoint over {dist.world} ranks",
                            world=dist.world)
    except Exception as e:  # noqa: BLE001 - every rank must learn of every other's failure
        error = str(e)
    errors = [e for e in dist.all_gather_objects(error) if e]
    if errors:
        if dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        raise CheckpointError(errors[0])
    if dist.is_main:
        install(tmp, final)
        prune(root, keep)
    dist.barrier()
    return final


def load_sharded(ckpt: Checkpoint, dist: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Under torchrun: the policy and optimizer of a `save_sharded` checkpoint into this rank's
    (sharded) model and optimizer; returns this rank's own state (RNGs, sampler, ...)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    meta = json.loads((ckpt.path / "meta.json").read_text())
    if not ckpt.sharded or meta.get("world") != dist.world:
        raise ConfigError(f"cannot resume {ckpt.path} with {dist.world} processes: it was written by "
                          + (f"{meta.get('world')} (each rank's RNGs and prompts are in it; launch torchrun with "
                             f"--nproc_per_node {meta.get('world')})" if ckpt.sharded else
                             "one process (resume it without torchrun)"))
    model_sd, optim_sd = get_state_dict(model, optimizer)
    both = {"model": model_sd, "optim": optim_sd}
    dcp.load(both, checkpoint_id=str(ckpt.path / "dcp"))
    set_state_dict(model, optimizer, model_state_dict=both["model"], optim_state_dict=both["optim"])
    own = ckpt.path / ("state.pt" if dist.is_main else f"rank-{dist.rank:05d}.pt")
    return torch.load(own, map_location="cpu", weights_only=False)


def remove(ckpt: Checkpoint) -> None:
    """Delete one checkpoint."""
    shutil.rmtree(ckpt.path, ignore_errors=True)


def drop_outrun(run_dir: str | Path, last: int, every: int) -> list[Path]:
    """After a run finished at step `last`: delete the checkpoints before it that `checkpoint.every`
    did not ask for (those a stop wrote: Ctrl-C, a failure guard), now outrun by the finished run
    and its final model. Returns their paths."""
    gone = [c for c in list_checkpoints(run_dir) if c.step < last and not (every and c.step % every == 0)]
    for c in gone:
        remove(c)
    return [c.path for c in gone]


def list_checkpoints(run_dir: str | Path) -> list[Checkpoint]:
    """Complete checkpoints, oldest first (`.tmp-*` directories are writes that never finished)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found: dict[int, Path] = {}
    for p in sorted(root.iterdir(), key=lambda p: p.name):  # step-N sorts before step-N.old-*
        m = _NAME.match(p.name)
        if m and p.is_dir() and (p / "state.pt").exists() and (
                (p / "policy.safetensors").exists() or (p / "dcp" / ".metadata").exists()):
            found.setdefault(int(m.group(1)), p)  # an .old-* copy only where its replacement is missing
    return [Checkpoint(k, found[k]) for k in sorted(found)]


def load_latest(run_dir: str | Path) -> Checkpoint | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def prune(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints (never the newest), then unfinished writes
    of dead processes and `.old-*` copies that were replaced."""
    found = list_checkpoints(root.parent)
    for ckpt in found[: -max(1, keep)]:
        remove(ckpt)
    live = {c.path for c in found[-max(1, keep):]}
    for p in root.glob("step-*.old-*"):
        if p not in live:
            shutil.rmtree(p, ignore_errors=True)
    for p in root.glob("step-*.tmp-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- resuming -------------------------------------------------------------------------------


def truncate_jsonl(path: str | Path, step: int) -> int:
    """Keep the lines of a per-step JSONL file up to `step` (inclusive); drop later ones and a
    partial last line a killed process left. Returns the lines kept."""
    path = Path(path)
    if not path.exists():
        return 0
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            rec = json.loads(line)
        except ValueError:
            break  # a partial line: the process died while writing it
        if int(rec.get("step", 0)) > step:
            break
        kept.append(line if line.endswith("\n") else line + "\n")
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
    return len(kept)


# Keys a resumed run may not change: they decide what the checkpoint holds or which data comes next.
# train.beta: the checkpoint carries the (adapted) KL coefficient, and 0 decides whether a reference model loads.
FIXED_ON_RESUME = ("model", "seed", "algo", "data.", "lora.", "reward.", "ppo.critic", "train.prompts_per_step",
                   "rollout.max_staleness",
                   "train.group_size", "train.beta")


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(saved: Config, new: Config) -> tuple[list[str], list[str]]:
    """(changes that forbid resuming, changes that are allowed), as `key: old -> new` lines."""
    a, b = _flat(saved.to_dict()), _flat(new.to_dict())
    fixed, allowed = [], []
    for k in b:
        if k in ("resume", "output_dir", "run_name", "overwrite") or a.get(k) == b[k]:
            continue
        line = f"{k}: {a.get(k)!r} -> {b[k]!r}"
        (fixed if any(k == f or (f.endswith(".") and k.startswith(f)) for f in FIXED_ON_RESUME) else allowed).append(line)
    return fixed, allowed


def resume_config(run_dir: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """RUN_DIR/config.yaml, then `overrides`, with `resume` set to RUN_DIR."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").exists():
        raise ConfigError(f"cannot resume {run_dir}: no config.yaml there (is it a run directory?)")
    overrides = [o for o in overrides if not o.startswith("resume=")]
    return load_config(run_dir / "config.yaml", [*overrides, f"resume={run_dir}"])
