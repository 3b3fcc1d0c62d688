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


def test_bf16_momentum_adamw_follows_torch_adamw():
    """Same update as torch.optim.AdamW (weight decay included) up to bf16's rounding of the first
    moment; the moment is stored in bf16, the second in fp32; it stays bf16 across a state_dict
    round trip (torch casts loaded state to the parameter's dtype)."""
    from actloop.train.optim import AdamWBf16Momentum

    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(64, 32))
    b = torch.nn.Parameter(a.detach().clone())
    ours, ref = adamw([a], 1e-2, 0.1, momentum_dtype="bf16"), torch.optim.AdamW([b], lr=1e-2, weight_decay=0.1)
    assert isinstance(ours, AdamWBf16Momentum)
    start = a.detach().clone()
    for _ in range(20):
        g = torch.randn(64, 32)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    moved = (b.detach() - start).abs().mean()
    assert moved > 0.02 and (a.detach() - b.detach()).abs().max() < 0.05 * moved  # 20 steps moved it; rounding did not
    assert ours.state[a]["exp_avg"].dtype == torch.bfloat16 and ours.state[a]["exp_avg_sq"].dtype == torch.float32
    again = adamw([a], 1e-2, 0.1, momentum_dtype="bf16")
    again.load_state_dict(ours.state_dict())
    a.grad = torch.randn(64, 32)
    again.step()
    assert again.state[a]["exp_avg"].dtype == torch.bfloat16 and float(again.state[a]["step"]) == 21
