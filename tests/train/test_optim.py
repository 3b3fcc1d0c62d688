import torch

from actloop.train.optim import adamw


def test_fused_adamw_on_cpu_takes_the_same_step_as_the_loop():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(64, 32))
    b = torch.nn.Parameter(a.detach().clone())
    fused, loop = adamw([a], 1e-2, 0.1), adamw([b], 1e-2, 0.1, fused=False)
    assert fused.defaults["fused"] is True and not loop.defaults.get("fused")
    for _ in range(3):
        g = torch.randn(64, 32)
        a.grad, b.grad = g.clone(), g.clone()
        fused.step()
        loop.step()
    assert torch.allclose(a, b, atol=1e-6) and not torch.equal(a.detach(), torch.zeros(64, 32))


def test_tensors_without_the_fused_kernel_take_the_loop():
    for t in (torch.randn(4, dtype=torch.complex64), torch.randn(4, device="meta")):
        opt = adamw([{"params": [torch.nn.Parameter(t)]}], 1e-3, 0.0)
        assert not opt.defaults.get("fused")
    assert adamw([{"params": [torch.nn.Parameter(torch.randn(4))]}], 1e-3, 0.0).defaults["fused"] is True
