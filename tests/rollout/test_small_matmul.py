"""SmallBatchLinear: (W x^T)^T for a few fp32 rows on the CPU equals nn.Linear's x W^T."""

import pytest
import torch
import torch.nn.functional as F

from actloop.rollout import engine as engine_mod
from actloop.rollout.small_matmul import SmallBatchLinear, use_small_batch_linears


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 24), (2, 24), (8, 1, 24), (3, 5, 24), (64, 24), (65, 24), (4, 40, 24)])
def test_equals_linear(shape, bias):
    torch.manual_seed(0)
    lin = torch.nn.Linear(24, 37, bias=bias)
    x = torch.randn(shape)
    want = F.linear(x, lin.weight, lin.bias)
    use_small_batch_linears(lin)
    assert type(lin) is SmallBatchLinear
    got = lin(x)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bf16_and_large_batches_take_the_plain_path(monkeypatch):
    lin = torch.nn.Linear(8, 4)
    use_small_batch_linears(lin)
    calls = []
    monkeypatch.setattr(torch, "mm", lambda *a: calls.append(a) or torch.matmul(*a))
    lin(torch.randn(3, 8))
    assert len(calls) == 1  # the transposed form
    lin(torch.randn(200, 8))
    lin.to(torch.bfloat16)(torch.randn(3, 8, dtype=torch.bfloat16))
    assert len(calls) == 1


def test_only_plain_linears_are_swapped():
    class Sub(torch.nn.Linear):
        pass

    m = torch.nn.Sequential(torch.nn.Linear(4, 4), Sub(4, 4), torch.nn.ReLU())
    assert use_small_batch_linears(m) == 1
    assert type(m[0]) is SmallBatchLinear and type(m[1]) is Sub


def test_auto_precision_follows_the_cpus_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for fast in (True, False):
        monkeypatch.setattr(engine_mod, "cpu_has_fast_bf16", lambda fast=fast: fast)
        assert engine_mod.use_bf16("auto") is fast
        assert engine_mod.use_bf16("bf16") and not engine_mod.use_bf16("fp32")
