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


def test_drop_state_frees_the_moments_and_gradients():
    from actloop.train.optim import drop_state

    p = torch.nn.Parameter(torch.randn(8, 4))
    opt = adamw([p], 1e-2, 0.0)
    p.grad = torch.randn(8, 4)
    opt.step()
    assert set(opt.state[p]) >= {"exp_avg", "exp_avg_sq"}
    drop_state(opt)
    assert len(opt.state) == 0 and p.grad is None
