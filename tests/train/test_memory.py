"""Peak memory per phase: the RSS high-water mark, reset when each phase starts."""

import os

import pytest

from actloop.train.runtime.memory import reset_rss_peak

pytestmark = pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK) or not reset_rss_peak(),
                                reason="needs Linux's /proc/self/clear_refs to reset the high-water mark")


_PHASES = """
import json, torch
from actloop.train.runtime.memory import PhasePeaks
peaks = PhasePeaks()
with peaks("model_load"):
    pass
base = peaks.step["model_load"]
with peaks("rollout"):
    x = torch.ones(300 * 2**20 // 4)  # 300 MiB, touched
    del x
with peaks("update"):
    pass
m = peaks.step_metrics()
print(json.dumps({"base": base, "m": m, "step": peaks.step, "run": peaks.run}))
"""


def test_each_phase_sees_its_own_freed_allocation_and_not_the_others():
    """In a fresh process: a pytest worker that ran other tests first holds freed heap chunks
    larger than 300 MiB, and the allocation reused those resident pages (CI, stop 29)."""
    import json
    import subprocess
    import sys

    out = json.loads(subprocess.run([sys.executable, "-c", _PHASES], capture_output=True, text=True,
                                    check=True).stdout.splitlines()[-1])
    m, base = out["m"], out["base"]
    assert m["peak_mem_window"] == 1.0
    assert m["peak_mem_mb/rollout"] >= base + 250, m
    assert m["peak_mem_mb/update"] < m["peak_mem_mb/rollout"] - 200, m
    assert m["peak_mem_mb"] == m["peak_mem_mb/rollout"]
    assert out["step"] == {} and out["run"]["rollout"] == m["peak_mem_mb/rollout"]  # the run keeps each phase's peak


_PLACEMENT = """
import ctypes, json
from actloop.train.runtime.memory import mmap_threshold
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def in_heap(ptr):
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return True
    return False
def where(mib):
    ptr = libc.malloc(int(mib * 2**20))
    out = "heap" if in_heap(ptr) else "own mapping"
    libc.free(ptr)
    return out
where(20)  # freed: glibc's own dynamic threshold rises past 20 MiB, so 2 and 8 MiB would come from the heap
with mmap_threshold(1.0):
    inside = [where(2), where(8)]
after = [where(2), where(8)]
with mmap_threshold(0):  # 0: the block leaves glibc's threshold alone
    untouched = [where(2), where(8)]
print(json.dumps({"inside": inside, "after": after, "untouched": untouched}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads the [heap] mapping from /proc")
def test_the_update_threshold_maps_large_allocations_inside_its_block_only():
    """train.update_mmap_threshold_mb: inside `mmap_threshold(1.0)` every allocation of 1 MiB or more
    gets its own mapping (returned to the OS when freed); after the block glibc's settled 32 MiB holds
    again and 2 and 8 MiB come from the heap. Where an allocation lands, not how much memory the machine
    gives back (that is benchmarks/allocator.py)."""
    import json
    import subprocess
    import sys

    from actloop.train.runtime.memory import set_mmap_threshold

    if not set_mmap_threshold(32.0):
        pytest.skip("no glibc mallopt here")
    out = json.loads(subprocess.run([sys.executable, "-c", _PLACEMENT], capture_output=True, text=True,
                                    check=True).stdout.splitlines()[-1])
    assert out["inside"] == ["own mapping", "own mapping"], out
    assert out["after"] == ["heap", "heap"] and out["untouched"] == ["heap", "heap"], out
