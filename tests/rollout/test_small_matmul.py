"""SmallBatchLinear: the fp32 and bf16 kernels (`rollout/cpu_kernel.py`) and (W x^T)^T for a few rows on
the CPU equal nn.Linear's x W^T."""

import pytest
import torch
import torch.nn.functional as F

from actloop.rollout import cpu_kernel
from actloop.rollout import engine as engine_mod
from actloop.rollout.small_matmul import SmallBatchLinear, use_small_batch_linears

needs_kernel = pytest.mark.skipif(cpu_kernel.small_linear() is None,
                                  reason=f"the fp32 decode kernel is unavailable here: {cpu_kernel.unavailable_reason()}")
needs_bf16_kernel = pytest.mark.skipif(
    cpu_kernel.small_linear(torch.bfloat16) is None,
    reason=f"the bf16 decode kernel is unavailable here: {cpu_kernel.unavailable_reason(torch.bfloat16)}")


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 16])
@pytest.mark.parametrize("n_in,n_out", [(576, 192), (13, 5), (8, 1), (40, 37)])  # K % 8 != 0: the scalar tail
@pytest.mark.parametrize("bias", [True, False])
def test_kernel_equals_linear(rows, n_in, n_out, bias):
    torch.manual_seed(rows)
    x, w = torch.randn(rows, n_in), torch.randn(n_out, n_in)
    b = torch.randn(n_out) if bias else None
    got = cpu_kernel.linear(x, w, b)
    assert got.shape == (rows, n_out)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_small_batches_take_the_kernel(monkeypatch):
    lin = torch.nn.Linear(24, 37)
    use_small_batch_linears(lin)
    calls = []
    real = cpu_kernel.linear
    monkeypatch.setattr(cpu_kernel, "linear", lambda *a: calls.append(a[0].shape) or real(*a))
    x = torch.randn(2, 3, 24)[:, ::2]  # a non-contiguous [2, 2, 24] view: copied for the kernel
    with torch.no_grad():
        got = lin(x)
        lin(torch.randn(17, 24))  # above MAX_ROWS: the transposed form
    assert calls == [(4, 24)]
    torch.testing.assert_close(got, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    w = lin.weight
    lin(torch.randn(3, 24)).sum().backward()  # autograd on: the plain path, and the gradient arrives
    assert calls == [(4, 24)] and w.grad is not None


@needs_bf16_kernel
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 16])
@pytest.mark.parametrize("n_in,n_out", [(576, 192), (1536, 64), (13, 5), (40, 37), (70, 3)])  # K % 32 != 0: the masked tail
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_kernel_equals_linear(rows, n_in, n_out, bias):
    """bf16 in and out, summed in fp32: the kernel's output is the fp32 sum of the bf16 products rounded
    to bf16 (to within one bf16 step: the summation order differs), as oneDNN's F.linear gives."""
    torch.manual_seed(rows + n_in)
    x, w = torch.randn(rows, n_in).bfloat16(), torch.randn(n_out, n_in).bfloat16()
    b = torch.randn(n_out).bfloat16() if bias else None
    got = cpu_kernel.linear(x, w, b)
    assert got.shape == (rows, n_out) and got.dtype == torch.bfloat16
    exact = x.double() @ w.double().T + (b.double() if bias else 0)  # [rows, n_out]
    assert torch.allclose(got.double(), exact, rtol=2 ** -7, atol=1e-3 * exact.abs().max().item())
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=2 ** -7, atol=1e-3 * exact.abs().max().item())


@needs_bf16_kernel
def test_bf16_small_batches_take_the_bf16_kernel(monkeypatch):
    lin = torch.nn.Linear(64, 40).bfloat16()
    use_small_batch_linears(lin)
    calls = []
    real = cpu_kernel.linear
    monkeypatch.setattr(cpu_kernel, "linear", lambda *a: calls.append((a[0].shape, a[0].dtype)) or real(*a))
    x = torch.randn(2, 3, 64).bfloat16()
    with torch.no_grad():
        got = lin(x)
        lin(torch.randn(cpu_kernel.max_rows(torch.bfloat16) + 1, 64).bfloat16())  # above max_rows: F.linear
        lin.float()(torch.randn(3, 64))  # fp32 again: the fp32 kernel
    assert calls == [((6, 64), torch.bfloat16), ((3, 64), torch.float32)]
    torch.testing.assert_close(got, F.linear(x, lin.weight.bfloat16(), lin.bias.bfloat16()), rtol=2 ** -7, atol=1e-2)


def test_without_the_kernel_decode_keeps_torch(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_kernel, "_state", {})
    monkeypatch.setenv("ACTLOOP_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert cpu_kernel.small_linear() is None
    assert any(w in cpu_kernel.unavailable_reason() for w in ("no C compiler", "only", "lacks"))
    lin = torch.nn.Linear(24, 37)
    use_small_batch_linears(lin)
    x = torch.randn(4, 24)
    with torch.no_grad():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(cpu_kernel, "_state", {})
    monkeypatch.setenv("ACTLOOP_CPU_KERNELS", "0")
    assert cpu_kernel.small_linear() is None and cpu_kernel.unavailable_reason() == "ACTLOOP_CPU_KERNELS=0"


@needs_kernel
def test_a_broken_compiler_is_a_reason_not_a_crash(monkeypatch, tmp_path):
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\necho 'cc: internal error' >&2\nexit 1\n")
    cc.chmod(0o755)
    monkeypatch.setattr(cpu_kernel, "_state", {})
    monkeypatch.setenv("ACTLOOP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(cc))
    assert cpu_kernel.small_linear() is None
    assert "internal error" in cpu_kernel.unavailable_reason()
    assert not list((tmp_path / "cache" / "kernels").glob("*.so"))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 24), (2, 24), (8, 1, 24), (3, 5, 24), (64, 24), (65, 24), (4, 40, 24)])
def test_equals_linear(shape, bias):
    torch.manual_seed(0)
    lin = torch.nn.Linear(24, 37, bias=bias)
    x = torch.randn(shape)
    want = F.linear(x, lin.weight, lin.bias)
    use_small_batch_linears(lin)
    assert type(lin) is SmallBatchLinear
    with torch.no_grad():
        got = lin(x)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bf16_and_large_batches_take_the_plain_path(monkeypatch):
    monkeypatch.setattr(cpu_kernel, "small_linear", lambda dtype=None: None)  # the transposed form, not the kernel
    lin = torch.nn.Linear(8, 4)
    use_small_batch_linears(lin)
    calls = []
    monkeypatch.setattr(torch, "mm", lambda *a: calls.append(a) or torch.matmul(*a))
    with torch.no_grad():
        lin(torch.randn(3, 8))
        assert len(calls) == 1  # the transposed form
        lin(torch.randn(200, 8))
        lin.to(torch.bfloat16)(torch.randn(3, 8, dtype=torch.bfloat16))
    lin.float()(torch.randn(3, 8))  # autograd on: plain
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
