"""Peak memory of a training step, for the per-step metrics.

CPU: the process's resident-set high-water mark (VmHWM in /proc/self/status). Linux resets it
to the current RSS when "5" is written to /proc/self/clear_refs, so `step_peak()` reads the peak
since the previous call and starts a new window: called once at the end of each update, it
measures the whole step (rollout, scoring, update). Where the reset is refused (not Linux, or a
locked-down /proc), the value is the process's lifetime peak and `peak_mem_window` says so.

CUDA: torch.cuda.max_memory_allocated (tensors only, not the allocator's cache), reset the same
way with torch.cuda.reset_peak_memory_stats.
"""

from __future__ import annotations

import resource
import sys

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


def step_peak() -> dict[str, float]:
    """{peak_mem_mb, peak_mem_window (1 = since the last call, 0 = process lifetime)[, cuda_peak_mem_mb]}
    — then opens the next window."""
    out = {"peak_mem_mb": round(rss_peak_mb(), 1)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_peak_mem_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        torch.cuda.reset_peak_memory_stats()
    out["peak_mem_window"] = 1.0 if reset_rss_peak() else 0.0
    return out
