"""bf16 weights for the update's passes (actloop.train.numerics.mixed_precision)."""

import contextlib
import copy

import pytest
import torch
from torch import nn

from actloop.train.numerics.mixed_precision import bf16_weights, update_precision


class Tied(nn.Module):
    """An embedding tied to the output head (as SmolLM2's), a hidden layer and a frozen one."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 8)
        self.mid = nn.Linear(8, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.frozen(self.mid(self.emb(ids)))))


def loss_of(model, ids):
    return torch.log_softmax(model(ids).float(), -1)[..., 3].sum()


def test_inside_the_block_the_weights_are_bf16_copies_and_the_masters_come_back():
    m = Tied()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    objects = [id(p) for p in m.parameters()]
    with bf16_weights(m):
        assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
        assert m.head.weight is m.emb.weight  # still one Parameter
        assert torch.equal(m.mid.weight, before["mid.weight"].bfloat16())
    assert [id(p) for p in m.parameters()] == objects
    for n, p in m.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, before[n])  # fp32 masters, bit for bit
        assert p.grad is None


def test_gradients_are_the_bf16_passes_gradients_summed_in_fp32():
    m = Tied()
    ids1, ids2 = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[5, 6, 7]])
    with bf16_weights(m):
        loss_of(m, ids1).backward()
        loss_of(m, ids2).backward()
    # the same two backwards on an explicit bf16 copy, each gradient summed in fp32 by hand
    ref = copy.deepcopy(m).to(torch.bfloat16)
    expected = {}
    for ids in (ids1, ids2):
        ref.zero_grad(set_to_none=True)
        loss_of(ref, ids).backward()
        for n, p in ref.named_parameters():
            if p.grad is not None:
                expected[n] = expected.get(n, 0) + p.grad.float()
    for n, p in m.named_parameters():
        if n.startswith("frozen"):
            assert p.grad is None
            continue
        assert p.grad.dtype == torch.float32
        assert torch.equal(p.grad, expected[n]), n
    assert m.emb.weight.grad.abs().sum() > 0  # the tied weight got both uses' gradient


def test_a_gradient_from_before_the_block_is_added_to_and_an_error_restores_the_masters():
    m = Tied()
    m.mid.weight.grad = torch.ones_like(m.mid.weight)
    with bf16_weights(m):
        loss_of(m, torch.tensor([[1, 2]])).backward()
    g = m.mid.weight.grad.clone()
    assert not torch.equal(g, torch.ones_like(g))
    m.zero_grad(set_to_none=True)
    with bf16_weights(m):
        loss_of(m, torch.tensor([[1, 2]])).backward()
    assert torch.equal(g, m.mid.weight.grad + 1)  # the same pass's gradient, plus the ones it started from

    w = m.mid.weight.detach().clone()
    with pytest.raises(RuntimeError, match="boom"), bf16_weights(m):
        raise RuntimeError("boom")
    assert m.mid.weight.dtype == torch.float32 and torch.equal(m.mid.weight, w)


def test_keep_in_fp32_modules_stay_fp32():
    m = Tied()
    m._keep_in_fp32_modules = ["mid"]
    with bf16_weights(m):
        assert m.mid.weight.dtype == torch.float32 and m.frozen.weight.dtype == torch.bfloat16


def test_update_precision_uses_bf16_weights_only_where_asked():
    m = Tied()
    for precision, mode, sharded in (("fp32", "weights", False), ("bf16", "autocast", False), ("bf16", "weights", True)):
        ctx = update_precision(precision, mode, m, sharded=sharded)
        assert isinstance(ctx, contextlib.nullcontext), (precision, mode, sharded)
    with update_precision("bf16", "weights", m, None):
        assert m.mid.weight.dtype == torch.bfloat16
    assert m.mid.weight.dtype == torch.float32
