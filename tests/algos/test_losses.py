import math

import torch

from actloop.algos.kl import kl_k1, kl_k2, kl_k3
from actloop.algos.losses import clipped_pg_loss, token_weights


def test_ratio_e_is_clipped_to_1_2_for_positive_advantage():
    logp, old = torch.tensor([[1.0]]), torch.tensor([[0.0]])  # ratio = e
    w = torch.tensor([[1.0]])
    loss, m = clipped_pg_loss(logp, old, torch.tensor([2.0]), w, clip_eps=0.2)
    assert math.isclose(float(loss), -1.2 * 2.0, rel_tol=1e-6)  # min(e*2, 1.2*2) = 2.4
    assert m["clip_frac"] == 1.0


def test_ratio_e_is_not_clipped_for_negative_advantage():
    # negative advantage: min(e * -1, 1.2 * -1) = -e, so the loss is +e (pessimistic bound)
    loss, m = clipped_pg_loss(torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([-1.0]), torch.tensor([[1.0]]))
    assert math.isclose(float(loss), math.e, rel_tol=1e-6)
    assert m["clip_frac"] == 0.0


def test_on_policy_gradient_is_minus_advantage():
    logp = torch.tensor([[-0.5, -1.0]], requires_grad=True)
    w = token_weights(torch.tensor([[1, 1]]), "seq_mean", num_seqs=1, num_tokens=2)
    loss, _ = clipped_pg_loss(logp, logp.detach(), torch.tensor([3.0]), w)
    loss.backward()
    assert math.isclose(float(loss), -3.0, rel_tol=1e-6)  # ratio 1: -A, averaged over 2 tokens
    assert torch.allclose(logp.grad, torch.tensor([[-1.5, -1.5]]))


def test_seq_mean_vs_token_mean_weights():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    seq = token_weights(mask, "seq_mean", num_seqs=2, num_tokens=4)
    tok = token_weights(mask, "token_mean", num_seqs=2, num_tokens=4)
    assert torch.allclose(seq, torch.tensor([[1 / 6, 1 / 6, 1 / 6, 0], [0.5, 0, 0, 0]]))
    assert torch.allclose(tok, torch.tensor([[0.25, 0.25, 0.25, 0], [0.25, 0, 0, 0]]))


def test_empty_mask_gives_zero_loss_not_nan():
    w = token_weights(torch.zeros(2, 3), "seq_mean", num_seqs=2, num_tokens=0)
    loss, m = clipped_pg_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([1.0, -1.0]), w)
    assert float(loss) == 0.0 and m["clip_frac"] == 0.0


def test_extreme_ratio_stays_finite():
    loss, _ = clipped_pg_loss(torch.tensor([[80.0]]), torch.tensor([[-80.0]]), torch.tensor([-1.0]), torch.tensor([[1.0]]))
    assert math.isfinite(float(loss))


def test_kl_estimators_hand_computed():
    logp, ref = torch.tensor([0.0]), torch.tensor([math.log(0.5)])  # x = log(ref/p) = -log 2
    x = -math.log(2)
    assert math.isclose(float(kl_k1(logp, ref)), -x, rel_tol=1e-6)
    assert math.isclose(float(kl_k2(logp, ref)), x * x / 2, rel_tol=1e-6)
    assert math.isclose(float(kl_k3(logp, ref)), 0.5 - 1 - x, rel_tol=1e-6)  # e^x - 1 - x
    assert float(kl_k3(ref, ref)) == 0.0


def test_kl_term_adds_beta_times_k3():
    logp, ref = torch.tensor([[0.0]]), torch.tensor([[math.log(0.5)]])
    loss, m = clipped_pg_loss(logp, logp, torch.tensor([0.0]), torch.tensor([[1.0]]), ref_logp=ref, beta=0.1)
    assert math.isclose(float(loss), 0.1 * (0.5 - 1 + math.log(2)), rel_tol=1e-5)
    assert math.isclose(m["kl"], 0.5 - 1 + math.log(2), rel_tol=1e-5)
