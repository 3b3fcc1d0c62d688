"""Peak memory per phase of a run (model load, greedy evaluation, rollout, update, checkpoint).

CPU: the process's resident-set high-water mark (VmHWM in /proc/self/status). Linux resets it
to the current RSS when "5" is written to /proc/self/clear_refs, so each phase of `PhasePeaks`
opens a new window when it starts and reads the peak when it ends: the metrics then say which
phase held the memory (`peak_mem_mb/rollout`, `peak_mem_mb/update`, ...; `peak_mem_mb` is the
step's largest). Where the reset is refused (not Linux, or a locked-down /proc), every value is
the process's lifetime peak so far and `peak_mem_window` is 0.

CUDA: torch.cuda.max_memory_allocated (tensors only, not the allocator's cache), reset the same
way with torch.cuda.reset_peak_memory_stats.
"""

from __future__ import annotations

import ctypes
import gc
import resource
import sys
from contextlib import contextmanager

import torch


def rss_peak_mb() -> float:
    """Peak RSS of this process in MiB since the last reset (VmHWM), else its lifetime peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (2**20 if sys.platform == "darwin" else 1024)


def reset_rss_peak() -> bool:
    """Start a new high-water-mark window; False where the OS does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def release_freed_memory() -> bool:
    """Hand the C heap's free pages back to the OS (glibc `malloc_trim(0)`, after a garbage
    collection). PyTorch's CPU tensors live on the C heap; after a phase that freed gigabytes
    (an update's activations, an evaluation's KV caches) glibc keeps much of it mapped, so the
    RSS stays near that phase's peak and the next phase's peak adds to it. False where there is no
    glibc (macOS, musl) or nothing was returned."""
    gc.collect()
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


@contextmanager
def frozen_gc():
    """Exempt every Python object alive now from the cyclic garbage collector for the block
    (`gc.freeze()`): the models, tokenizer, engine and imported libraries of a run are ~370k
    objects, and each full collection walked them all: 0.20-0.24 s per `gc.collect()` on the
    2-core box, twice a step in `release_freed_memory` (docs/performance.md). Objects made inside
    the block are collected as usual; the frozen ones still go by reference counting, and are
    unfrozen at the end unless the caller had frozen objects before (then theirs stay so)."""
    outer = gc.get_freeze_count() > 0
    gc.freeze()
    try:
        yield
    finally:
        if not outer:
            gc.unfreeze()


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter (malloc.h)


def set_mmap_threshold(mib: float) -> bool:
    """Give every C-heap allocation of at least `mib` MiB its own mapping, returned to the OS when
    it is freed (glibc `mallopt(M_MMAP_THRESHOLD)`; 0: leave glibc's default). glibc starts at
    128 KiB and raises the threshold itself, up to 32 MiB, each time a large block is freed; from
    then on a rollout's KV tensors and an update's activations come from the heap, whose freed
    holes the next, slightly larger tensor does not fit, so the footprint ran far above the live
    tensors. Measured on the demo's rollout of 32 episodes: 1.3-1.4 GB over the baseline at its end
    with 0.36 GB of tensors alive (the prefix cache), 0.6-0.9 GB with a 1 MiB threshold, and the
    peak ~250 MB lower; but each large allocation then faults in fresh pages: ~15% more time in the
    rollout and in the update (docs/performance.md), hence off by default. False where there is no
    glibc, or `mib` is 0."""
    if mib <= 0:
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, int(mib * 2**20)))
    except (OSError, AttributeError):
        return False


GLIBC_MMAP_THRESHOLD_MAX_MIB = 32.0  # where glibc's own threshold ends up once large blocks were freed (64-bit)


@contextmanager
def mmap_threshold(mib: float):
    """`set_mmap_threshold(mib)` for the block, then GLIBC_MMAP_THRESHOLD_MAX_MIB, where glibc's
    dynamic threshold sits once a phase has freed large blocks, so the other phases keep the
    allocation pattern that is fast for them. Used around the update
    (train.update_mmap_threshold_mb): measured on demo-like runs with 8-bit AdamW, the update's
    peak fell by 0.4-0.7 GB with 1 MiB (4 MiB: nothing); the update's tensors then fault in fresh
    pages: 15% of its time alone, 40-60% with other jobs on the 2 cores (docs/performance.md).
    A no-op for mib = 0."""
    if mib <= 0:
        yield
        return
    set_mmap_threshold(mib)
    try:
        yield
    finally:
        set_mmap_threshold(GLIBC_MMAP_THRESHOLD_MAX_MIB)


class PhasePeaks:
    """`with peaks("rollout"): ...` records the peak RSS (MiB) of that phase; `step_metrics()`
    returns this step's phases and starts the next step; `run` keeps each phase's peak over the
    whole run (for summary.json). trim: `release_freed_memory()` when each phase ends
    (train.malloc_trim)."""

    def __init__(self, trim: bool = False):
        self.trim = trim
        self.step: dict[str, float] = {}
        self.run: dict[str, float] = {}
        self.windowed = True
        self._cuda = torch.cuda.is_available()

    @contextmanager
    def __call__(self, name: str):
        self.windowed = reset_rss_peak() and self.windowed
        if self._cuda and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()
        try:
            yield
        finally:
            mb = round(rss_peak_mb(), 1)
            self.step[name] = max(self.step.get(name, 0.0), mb)
            self.run[name] = max(self.run.get(name, 0.0), mb)
            if self._cuda and torch.cuda.is_initialized():
                cuda = round(torch.cuda.max_memory_allocated() / 2**20, 1)
                self.step[f"cuda:{name}"] = max(self.step.get(f"cuda:{name}", 0.0), cuda)
            if self.trim:
                release_freed_memory()

    def step_metrics(self) -> dict[str, float]:
        """{peak_mem_mb (the step's largest phase), peak_mem_mb/PHASE, peak_mem_window
        [, cuda_peak_mem_mb]}; then the next step starts empty."""
        cpu = {k: v for k, v in self.step.items() if not k.startswith("cuda:")}
        out = {f"peak_mem_mb/{k}": v for k, v in cpu.items()}
        out["peak_mem_mb"] = max(cpu.values(), default=0.0)
        cuda = [v for k, v in self.step.items() if k.startswith("cuda:")]
        if cuda:
            out["cuda_peak_mem_mb"] = max(cuda)
        out["peak_mem_window"] = 1.0 if self.windowed else 0.0
        self.step = {}
        return out
