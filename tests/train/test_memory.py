"""Per-step peak memory: the RSS high-water mark, reset between steps."""

import os

import pytest
import torch

from actloop.train.memory import reset_rss_peak, step_peak

pytestmark = pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK) or not reset_rss_peak(),
                                reason="needs Linux's /proc/self/clear_refs to reset the high-water mark")


def test_peak_of_a_step_sees_a_freed_allocation_and_the_next_window_does_not():
    step_peak()  # open a window
    base = step_peak()["peak_mem_mb"]
    x = torch.ones(300 * 2**20 // 4)  # 300 MiB, touched
    del x
    during = step_peak()
    after = step_peak()
    assert during["peak_mem_window"] == 1.0
    assert during["peak_mem_mb"] >= base + 250, (base, during)
    assert after["peak_mem_mb"] < during["peak_mem_mb"] - 200, (during, after)
