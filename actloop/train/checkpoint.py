"""Checkpoints a run can resume from exactly.

    RUN_DIR/checkpoints/step-000012/
        policy.safetensors   trainable parameters: the whole model, or only the LoRA adapter
        state.pt             optimizer, scheduler, critic, every RNG, the prompt sampler, KL beta,
                             step, summary so far, failure guard, `extra` (other components)
        meta.json            step, time, what the policy file holds (for people)

A checkpoint is written under `step-000012.tmp-<pid>`, fsynced, then renamed into place, so a
reader sees a whole checkpoint or none: `load_latest` ignores `.tmp-*` directories (a write
that was killed). The newest `keep` checkpoints are kept.

`state.pt` is a pickle (RNG states hold Python tuples and NumPy arrays): load checkpoints you
wrote, not ones from strangers.
"""

from __future__ import annotations

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
_NAME = re.compile(r"^step-(\d{6,})$")


@dataclass(frozen=True)
class Checkpoint:
    step: int
    path: Path

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
    """Write checkpoint `step` atomically and keep the newest `keep`. Returns its directory."""
    from safetensors.torch import save_file

    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f"{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    trainable = trainable_state_dict(policy)
    save_file(trainable, str(tmp / "policy.safetensors"), metadata={"format": "pt"})
    torch.save({**state, "step": step}, tmp / "state.pt")
    total = sum(p.numel() for p in policy.parameters())
    held = sum(t.numel() for t in trainable.values())
    (tmp / "meta.json").write_text(json.dumps({
        "step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "policy": "full model" if held >= total else f"trainable parameters only ({held} of {total})"}) + "\n")
    for f in tmp.iterdir():
        _fsync(f)
    _fsync(tmp)
    if final.exists():  # the same step written again (a resumed run that re-reached it)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(root)
    prune(root, keep)
    return final


def list_checkpoints(run_dir: str | Path) -> list[Checkpoint]:
    """Complete checkpoints, oldest first (`.tmp-*` directories are writes that never finished)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_dir() and (p / "state.pt").exists() and (p / "policy.safetensors").exists():
            found.append(Checkpoint(int(m.group(1)), p))
    return sorted(found, key=lambda c: c.step)


def load_latest(run_dir: str | Path) -> Checkpoint | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def prune(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints, and unfinished writes of dead processes."""
    for ckpt in list_checkpoints(root.parent)[:-keep]:
        shutil.rmtree(ckpt.path, ignore_errors=True)
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
        if k in ("resume", "output_dir", "run_name") or a.get(k) == b[k]:
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
