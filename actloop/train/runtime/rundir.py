"""A run directory belongs to one run at a time.

`claim(run_dir)` takes an exclusive `fcntl.flock` on `RUN_DIR/.lock` (without waiting) and writes
who holds it (pid, host, start time, command line) into the file. A second run into the same
directory — a new run or a `resume=RUN_DIR` — fails at once with a message naming the holder,
instead of two processes interleaving `metrics.jsonl` and checkpoints. The kernel drops the lock
when the holding process ends, however it ends (a SIGKILL included), so a stale `.lock` file
never blocks anyone; the text in it is only there to name the holder.

`prepare_new(run_dir, overwrite)` is the new-run side: an existing run directory with anything
in it is refused unless `overwrite` (`actloop train --overwrite`), which empties it first.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from actloop.config import ConfigError

LOCK = ".lock"
_held: dict[Path, int] = {}  # run directory -> the locked file descriptor, for this process's lifetime


class RunDirInUse(ConfigError):
    """Another live process holds the run directory."""


def claim(run_dir: str | Path) -> Path:
    """Lock `run_dir` for this process (idempotent); raise `RunDirInUse` naming the holder."""
    run_dir = Path(run_dir).resolve()
    if run_dir in _held:
        return run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        os.close(fd)
        raise RunDirInUse(f"run directory {run_dir} is in use by another run: {describe(holder)}. Wait for it to "
                          "finish, stop it, or choose another run_name") from None
    info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                       "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(sys.argv)})
    os.ftruncate(fd, 0)
    os.pwrite(fd, (info + "\n").encode(), 0)
    _held[run_dir] = fd
    return run_dir


def describe(holder: str) -> str:
    try:
        h = json.loads(holder)
        return f"pid {h['pid']} on {h['host']}, started {h['started']} ({h['command']})"
    except (ValueError, KeyError, TypeError):
        return holder or "a process that has not written its name yet"


def release(run_dir: str | Path | None = None) -> None:
    """Drop this process's lock on `run_dir` (all of them with None)."""
    for d in [Path(run_dir).resolve()] if run_dir is not None else list(_held):
        fd = _held.pop(d, None)
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def prepare_new(run_dir: str | Path, overwrite: bool = False) -> Path:
    """Claim `run_dir` for a new run. A directory that already holds anything (a run, or what a
    run that failed at start left) is refused unless `overwrite`, which empties it."""
    run_dir = claim(run_dir)
    present = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK)
    if present and not overwrite:
        release(run_dir)
        shown = ", ".join(present[:5]) + (", ..." if len(present) > 5 else "")
        raise ConfigError(f"run directory {run_dir} already exists (it holds {shown}): choose another run_name, "
                          f"continue it with `actloop train resume={run_dir}`, or replace it with "
                          "`actloop train --overwrite ...` (overwrite=true)")
    for name in present:
        p = run_dir / name
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    return run_dir
