"""Peak memory per phase: the RSS high-water mark, reset when each phase starts."""

import os

import pytest
import torch

from actloop.train.memory import PhasePeaks, reset_rss_peak

pytestmark = pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK) or not reset_rss_peak(),
                                reason="needs Linux's /proc/self/clear_refs to reset the high-water mark")


def test_each_phase_sees_its_own_freed_allocation_and_not_the_others():
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
    assert m["peak_mem_window"] == 1.0
    assert m["peak_mem_mb/rollout"] >= base + 250, m
    assert m["peak_mem_mb/update"] < m["peak_mem_mb/rollout"] - 200, m
    assert m["peak_mem_mb"] == m["peak_mem_mb/rollout"]
    assert peaks.step == {} and peaks.run["rollout"] == m["peak_mem_mb/rollout"]  # the run keeps each phase's peak
