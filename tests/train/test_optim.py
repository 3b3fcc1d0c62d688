import pytest
import torch

from actloop.train.numerics.optim import adamw


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
    from actloop.train.numerics.optim import drop_state

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
    from actloop.train.numerics.optim import AdamWBf16Momentum

    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(64, 32))
    b = torch.nn.Parameter(a.detach().clone())
    ours, ref = adamw([a], 1e-2, 0.1, kind="adamw_bf16_momentum"), torch.optim.AdamW([b], lr=1e-2, weight_decay=0.1)
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
    again = adamw([a], 1e-2, 0.1, kind="adamw_bf16_momentum")
    again.load_state_dict(ours.state_dict())
    a.grad = torch.randn(64, 32)
    again.step()
    assert again.state[a]["exp_avg"].dtype == torch.bfloat16 and float(again.state[a]["step"]) == 21


def test_8bit_adamw_follows_torch_adamw_and_stores_8_bits():
    """bitsandbytes' block-wise 8-bit AdamW: the moments of a large tensor are uint8 (plus one
    absmax per 256 values), the update tracks torch.optim.AdamW's within the quantization noise,
    and the state survives a state_dict round trip (exact resume)."""
    pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(256, 64))
    b = torch.nn.Parameter(a.detach().clone())
    small = torch.nn.Parameter(torch.randn(16))
    ours = adamw([{"params": [a, small]}], 1e-2, 0.1, kind="adamw_8bit")
    ref = torch.optim.AdamW([b], lr=1e-2, weight_decay=0.1)
    start = a.detach().clone()
    for _ in range(20):
        g = torch.randn(256, 64)
        a.grad, b.grad, small.grad = g.clone(), g.clone(), torch.randn(16)
        ours.step()
        ref.step()
    moved = (b.detach() - start).abs().mean()
    assert moved > 0.02 and (a.detach() - b.detach()).abs().mean() < 0.05 * moved
    st = ours.state[a]
    assert st["state1"].dtype == torch.uint8 and st["state2"].dtype == torch.uint8
    assert st["state1"].numel() == a.numel() and st["absmax1"].numel() == a.numel() // 256
    assert ours.state[small]["state1"].dtype == torch.float32  # under 4096 values: fp32 moments
    again = adamw([{"params": [a, small]}], 1e-2, 0.1, kind="adamw_8bit")
    again.load_state_dict(ours.state_dict())
    assert torch.equal(again.state[a]["state1"], st["state1"]) and again.state[a]["state1"].dtype == torch.uint8
    a2 = a.detach().clone()
    g = torch.randn(256, 64)
    a.grad, small.grad = g.clone(), torch.randn(16)
    ours.step()
    after_ours = a.detach().clone()
    a.data.copy_(a2)
    a.grad = g.clone()
    again.step()
    assert torch.equal(a.detach(), after_ours)  # the reloaded state takes the same step


def test_unknown_optimizer_is_a_clear_error():
    with pytest.raises(ValueError, match="adamw_8bit"):
        adamw([torch.nn.Parameter(torch.randn(4))], 1e-3, 0.0, kind="sgd")


def test_8bit_adamw_chunked_cpu_step_is_bit_identical_to_bitsandbytes(monkeypatch):
    """Stepping a tensor in chunks of whole 256-value blocks (bounded fp32 temporaries) gives
    exactly bitsandbytes' own whole-tensor step, including a last chunk shorter than the others."""
    bnb = pytest.importorskip("bitsandbytes")
    import actloop.train.numerics.optim8bit as o8

    monkeypatch.setattr(o8, "CHUNK", 4096)
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(100, 123))  # 12300 values: 3 chunks of 4096 and one of 12
    b = torch.nn.Parameter(a.detach().clone())
    ours = adamw([a], 1e-2, 0.1, kind="adamw_8bit")
    ref = bnb.optim.AdamW8bit([b], lr=1e-2, weight_decay=0.1)
    assert isinstance(ours, o8.AdamW8bit)
    start = a.detach().clone()
    for _ in range(5):
        g = torch.randn(100, 123)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert not torch.equal(a.detach(), start)
    assert torch.equal(a.detach(), b.detach())
    for k in ("state1", "state2", "absmax1", "absmax2"):
        assert torch.equal(ours.state[a][k], ref.state[b][k]), k
    assert int(ours.state[a]["step"]) == int(ref.state[b]["step"]) == 5


def test_auto_takes_8bit_moments_for_plain_tensors_and_fp32_elsewhere():
    """train.optimizer=auto: bitsandbytes' 8-bit AdamW where it can step the tensors, torch's
    AdamW otherwise (here a meta tensor stands for a device bitsandbytes cannot step)."""
    pytest.importorskip("bitsandbytes")
    from actloop.train.numerics.optim8bit import AdamW8bit

    assert isinstance(adamw([torch.nn.Parameter(torch.randn(4))], 1e-3, 0.0, kind="auto"), AdamW8bit)
    other = adamw([torch.nn.Parameter(torch.randn(4, device="meta"))], 1e-3, 0.0, kind="auto")
    assert type(other) is torch.optim.AdamW
