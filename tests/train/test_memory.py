"""Peak memory per phase: the RSS high-water mark, reset when each phase starts."""

import os

import pytest

from actloop.train.memory import reset_rss_peak

pytestmark = pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK) or not reset_rss_peak(),
                                reason="needs Linux's /proc/self/clear_refs to reset the high-water mark")


_PHASES = """
import json, torch
from actloop.train.memory import PhasePeaks
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


_FRAGMENT = """
import sys, torch
from actloop.train.memory import set_mmap_threshold
def rss():
    return int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0]) // 1024
if sys.argv[1] == "fixed":
    assert set_mmap_threshold(1.0)
x = torch.ones(5 * 2**20)  # 20 MiB, freed: glibc's own threshold rises past it (when not fixed)
del x
base = rss()
blocks = [torch.ones(2**21) for _ in range(40)]  # 40 x 8 MiB, touched
last = blocks[-1]
del blocks  # all freed but the last one
print(rss() - base)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS from /proc")
def test_a_fixed_mmap_threshold_returns_freed_tensors_below_the_heap_top():
    """The rollout's pattern: many multi-MiB tensors freed while a later one lives. With glibc's
    dynamic threshold they came from the heap and stay mapped; with the threshold fixed at 1 MiB
    each had its own mapping and went back to the OS."""
    import subprocess
    import sys

    from actloop.train.memory import set_mmap_threshold

    if not set_mmap_threshold(1.0):
        pytest.skip("no glibc mallopt here")
    kept = {mode: int(subprocess.run([sys.executable, "-c", _FRAGMENT, mode], capture_output=True, text=True,
                                     check=True).stdout.split()[-1]) for mode in ("dynamic", "fixed")}
    assert kept["dynamic"] > 200 and kept["fixed"] < 60, kept


_SCOPED = """
import torch
from actloop.train.memory import mmap_threshold
def rss():
    return int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0]) // 1024
def fragment():
    base = rss()
    blocks = [torch.ones(2**21) for _ in range(40)]  # 40 x 8 MiB, touched
    last = blocks[-1]
    del blocks  # all freed but the last one
    kept = rss() - base
    del last
    return kept
x = torch.ones(5 * 2**20)  # 20 MiB, freed: glibc's own threshold rises past it
del x
with mmap_threshold(1.0):
    inside = fragment()
print(inside, fragment())
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads VmRSS from /proc")
def test_the_update_threshold_holds_inside_its_block_only():
    """train.update_mmap_threshold_mb: inside the block, freed multi-MiB tensors go back to the OS;
    after it, the threshold is glibc's settled 32 MiB again and 8 MiB tensors come from the heap."""
    import subprocess
    import sys

    from actloop.train.memory import set_mmap_threshold

    if not set_mmap_threshold(32.0):
        pytest.skip("no glibc mallopt here")
    out = subprocess.run([sys.executable, "-c", _SCOPED], capture_output=True, text=True, check=True).stdout
    inside, after = (int(v) for v in out.split()[-2:])
    assert inside < 60 and after > 200, (inside, after)
