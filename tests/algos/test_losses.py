import math

import torch

from actloop.algos.kl import kl_k1, kl_k2, kl_k3
from actloop.algos.losses import clipped_pg_loss, token_weights


def test_ratio_e_is_clipped_to_1_2_for_positive_advantage():
    logp, old = torch.tensor([[1.0]]), torch.tensor([[0.0]])  # ratio = e
    w = torch.tensor([[1.0]])
    loss, m = clipped_pg_loss(logp, old, torch.tensor([2.0]), w, clip_eps=0.2)
    assert math.isclose(loss.item(), -1.2 * 2.0, rel_tol=1e-6)  # min(e*2, 1.2*2) = 2.4
    assert m["clip_frac"] == 1.0


def test_ratio_e_is_not_clipped_for_negative_advantage():
    # negative advantage: min(e * -1, 1.2 * -1) = -e, so the loss is +e (pessimistic bound)
    loss, m = clipped_pg_loss(torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([-1.0]), torch.tensor([[1.0]]))
    assert math.isclose(loss.item(), math.e, rel_tol=1e-6)
    assert m["clip_frac"] == 0.0


def test_on_policy_gradient_is_minus_advantage():
    logp = torch.tensor([[-0.5, -1.0]], requires_grad=True)
    w = token_weights(torch.tensor([[1, 1]]), "seq_mean", num_seqs=1, num_tokens=2)
    loss, _ = clipped_pg_loss(logp, logp.detach(), torch.tensor([3.0]), w)
    loss.backward()
    assert math.isclose(loss.item(), -3.0, rel_tol=1e-6)  # ratio 1: -A, averaged over 2 tokens
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
    assert loss.item() == 0.0 and m["clip_frac"] == 0.0


def test_extreme_ratio_stays_finite():
    loss, _ = clipped_pg_loss(torch.tensor([[80.0]]), torch.tensor([[-80.0]]), torch.tensor([-1.0]), torch.tensor([[1.0]]))
    assert math.isfinite(loss.item())


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
    assert math.isclose(loss.item(), 0.1 * (0.5 - 1 + math.log(2)), rel_tol=1e-5)
    assert math.isclose(m["kl"], 0.5 - 1 + math.log(2), rel_tol=1e-5)


# --- aggregation, clip-higher, dual clip, GSPO, entropy, IS weights, value loss ----------------

import pytest  # noqa: E402

from actloop.algos.losses import (  # noqa: E402
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    entropy_bonus,
    sequence_ratio,
    value_loss,
)


def test_constant_aggregation_is_dr_grpo():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    w = token_weights(mask, "constant", num_seqs=2, num_tokens=4, max_tokens=4)
    assert torch.allclose(w, mask / 8.0)  # 1 / (max_tokens * num_seqs) on every sampled token
    with pytest.raises(ValueError, match="max_tokens"):
        token_weights(mask, "constant", num_seqs=2, num_tokens=4)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        token_weights(mask, "nope", 2, 4)


@pytest.mark.parametrize("agg", sorted(LOSS_AGGREGATIONS))
def test_every_aggregation_survives_an_empty_mask(agg):
    w = token_weights(torch.zeros(2, 3), agg, num_seqs=0, num_tokens=0, max_tokens=3)
    assert torch.equal(w, torch.zeros(2, 3))


def test_clip_higher_is_asymmetric():
    one = torch.tensor([[1.0]])
    # ratio e, A = +1, clip_high 0.28: min(e, 1.28) = 1.28
    loss, m = clipped_pg_loss(one, torch.tensor([[0.0]]), torch.tensor([1.0]), one, clip_low=0.2, clip_high=0.28)
    assert math.isclose(loss.item(), -1.28, rel_tol=1e-6)
    assert m["clip_frac_high"] == 1.0 and m["clip_frac_low"] == 0.0
    # ratio 1/e, A = -1: min(-1/e, -clip(1/e, 0.8, 1.28)) = -0.8 -> loss 0.8, clipped low
    loss, m = clipped_pg_loss(torch.tensor([[-1.0]]), torch.tensor([[0.0]]), torch.tensor([-1.0]), one,
                              clip_low=0.2, clip_high=0.28)
    assert math.isclose(loss.item(), 0.8, rel_tol=1e-6)
    assert m["clip_frac_low"] == 1.0 and m["clip_frac_high"] == 0.0


def test_clip_eps_still_sets_both_sides():
    loss, _ = clipped_pg_loss(torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([1.0]), torch.tensor([[1.0]]),
                              clip_eps=0.1)
    assert math.isclose(loss.item(), -1.1, rel_tol=1e-6)


def test_dual_clip_bounds_negative_advantage():
    # ratio e^2 = 7.389, A = -1: PPO's loss is 7.389; dual clip c = 3 caps it at 3, with no gradient
    logp = torch.tensor([[2.0]], requires_grad=True)
    old, w = torch.tensor([[0.0]]), torch.tensor([[1.0]])
    plain, _ = clipped_pg_loss(logp, old, torch.tensor([-1.0]), w)
    assert math.isclose(plain.item(), math.exp(2), rel_tol=1e-6)
    loss, m = clipped_pg_loss(logp, old, torch.tensor([-1.0]), w, dual_clip=3.0)
    loss.backward()
    assert math.isclose(loss.item(), 3.0, rel_tol=1e-6) and m["dual_clip_frac"] == 1.0
    assert float(logp.grad) == 0.0
    # positive advantages are untouched by the dual clip
    pos, _ = clipped_pg_loss(torch.tensor([[2.0]]), old, torch.tensor([1.0]), w, dual_clip=3.0)
    assert math.isclose(pos.item(), -1.2, rel_tol=1e-6)


def test_gspo_sequence_ratio_is_the_geometric_mean():
    # log ratios (0.3, -0.3) and a masked garbage position: token ratios e^.3, e^-.3, geometric mean 1
    logp = torch.tensor([[0.3, -0.3, 50.0]])
    old = torch.zeros(1, 3)
    mask = torch.tensor([[1, 1, 0]])
    assert torch.allclose(sequence_ratio(logp, old, mask), torch.ones(1, 3))
    w = token_weights(mask, "seq_mean", 1, 2)
    A = torch.tensor([1.0])
    gspo, _ = clipped_pg_loss(logp, old, A, w, policy_loss="gspo", clip_low=0.2, clip_high=0.2)
    ppo, _ = clipped_pg_loss(logp, old, A, w, policy_loss="ppo_clip", clip_low=0.2, clip_high=0.2)
    assert math.isclose(gspo.item(), -1.0, rel_tol=1e-6)  # sequence ratio 1, inside the clip range
    assert math.isclose(ppo.item(), -(1.2 + math.exp(-0.3)) / 2, rel_tol=1e-6)  # e^.3 = 1.35 clipped per token


def test_gspo_clips_the_whole_sequence():
    # mean log ratio 0.3 -> s = e^.3 = 1.35 > 1.2: every token carries the clipped 1.2, no gradient
    logp = torch.tensor([[0.2, 0.4]], requires_grad=True)
    w = token_weights(torch.ones(1, 2), "seq_mean", 1, 2)
    loss, m = clipped_pg_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), w, policy_loss="gspo",
                              clip_low=0.2, clip_high=0.2)
    loss.backward()
    assert math.isclose(loss.item(), -1.2, rel_tol=1e-6) and m["clip_frac"] == 1.0
    assert torch.equal(logp.grad, torch.zeros(1, 2))


def test_gspo_token_form_has_gspo_gradient():
    # GSPO: L = -s * A with s = exp(mean_t(logp - old)); dL/dlogp_t = -A * s / |y|
    logp = torch.tensor([[-0.2, -0.1, -0.4]], requires_grad=True)
    old = torch.tensor([[-0.25, -0.1, -0.3]])
    A = torch.tensor([0.7])
    w = token_weights(torch.ones(1, 3), "seq_mean", 1, 3)
    loss, _ = clipped_pg_loss(logp, old, A, w, policy_loss="gspo", clip_low=0.2, clip_high=0.2)
    loss.backward()
    s = math.exp(float((logp.detach() - old).mean()))
    assert math.isclose(loss.item(), -0.7 * s, rel_tol=1e-6)
    assert torch.allclose(logp.grad, torch.full((1, 3), -0.7 * s / 3), atol=1e-7)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_on_policy_fast_path_ratio_is_one(name):
    logp = torch.tensor([[-0.5, -1.0, -2.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    w = token_weights(mask, "seq_mean", num_seqs=1, num_tokens=2)
    loss, m = clipped_pg_loss(logp, logp.detach(), torch.tensor([3.0]), w, policy_loss=name)
    loss.backward()
    assert m["ratio_mean"] == 1.0 and m["clip_frac"] == 0.0
    assert math.isclose(loss.item(), -3.0, rel_tol=1e-6)
    assert torch.allclose(logp.grad, torch.tensor([[-1.5, -1.5, 0.0]]))  # -A * w_t


def test_per_token_advantages_and_is_weights():
    logp = torch.zeros(1, 2, requires_grad=True)
    w = torch.tensor([[0.5, 0.5]])
    loss, m = clipped_pg_loss(logp, logp.detach(), torch.tensor([[2.0, -1.0]]), w, is_weights=torch.tensor([[0.5, 2.0]]))
    loss.backward()
    # -(2 * 0.5) * 0.5 - (-1 * 2) * 0.5 = -0.5 + 1 = 0.5
    assert math.isclose(loss.item(), 0.5, rel_tol=1e-6)
    assert torch.allclose(logp.grad, torch.tensor([[-0.5, 1.0]]))


def test_entropy_bonus_and_metric():
    ent = torch.tensor([[1.0, 3.0]], requires_grad=True)
    w = torch.tensor([[0.5, 0.5]])
    assert math.isclose(entropy_bonus(ent, w, 0.01).item(), -0.02, rel_tol=1e-6)
    loss, m = clipped_pg_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([0.0]), w, entropy=ent, entropy_coef=0.01)
    loss.backward()
    assert math.isclose(loss.item(), -0.02, rel_tol=1e-6) and m["entropy"] == 2.0
    assert torch.allclose(ent.grad, torch.tensor([[-0.005, -0.005]]))


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_extreme_ratios_give_finite_loss_and_gradients(name, adv):
    logp = torch.tensor([[80.0, -80.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-80.0, 80.0, float("-inf")]])  # an -inf old log-prob on a masked position
    mask = torch.tensor([[1, 1, 0]])
    w = token_weights(mask, "token_mean", 1, 2)
    ref = torch.tensor([[-80.0, 80.0, 0.0]])
    loss, m = clipped_pg_loss(logp, old, torch.tensor([adv]), w, policy_loss=name, mask=mask, dual_clip=3.0,
                              ref_logp=ref, beta=0.1)
    loss.backward()
    assert math.isfinite(loss.item()) and all(math.isfinite(v) for v in m.values())
    assert torch.isfinite(logp.grad).all()


def test_value_loss_clipping_hand_computed():
    w = torch.tensor([[1.0]])
    # V = 1, V_old = 0, R = 0.5, clip 0.2: max((1-.5)^2, (.2-.5)^2) = 0.25 -> 0.125
    loss, m = value_loss(torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[0.5]]), w, value_clip=0.2)
    assert math.isclose(loss.item(), 0.125, rel_tol=1e-6) and m["value_clip_frac"] == 0.0
    # R = 2: the clipped branch (0.2 - 2)^2 = 3.24 is larger -> 1.62, and it has no gradient
    V = torch.tensor([[1.0]], requires_grad=True)
    loss, m = value_loss(V, torch.tensor([[0.0]]), torch.tensor([[2.0]]), w, value_clip=0.2)
    loss.backward()
    assert math.isclose(loss.item(), 1.62, rel_tol=1e-6) and m["value_clip_frac"] == 1.0
    assert float(V.grad) == 0.0
    plain, _ = value_loss(torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[2.0]]), w)
    assert math.isclose(plain.item(), 0.5, rel_tol=1e-6)


def test_value_loss_empty_mask():
    loss, m = value_loss(torch.ones(2, 2), torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2), value_clip=0.2)
    assert loss.item() == 0.0 and m["value_mean"] == 0.0


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_minus_inf_on_padding_does_not_poison_loss_or_gradient(name):
    logp = torch.tensor([[-0.5, float("-inf")]], requires_grad=True)
    old = torch.tensor([[-0.7, float("-inf")]])
    mask = torch.tensor([[1, 0]])
    w = token_weights(mask, "seq_mean", 1, 1)
    loss, m = clipped_pg_loss(logp, old, torch.tensor([1.0]), w, policy_loss=name, mask=mask,
                              ref_logp=torch.tensor([[-0.6, 0.0]]), beta=0.1, kl_estimator="k1")
    loss.backward()
    assert math.isfinite(loss.item()) and all(math.isfinite(v) for v in m.values())
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 1] == 0.0
