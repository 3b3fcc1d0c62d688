import math

import pytest
import torch

from actloop.algos.correction import IS_CORRECTIONS, rollout_correction

# trainer - engine log-ratios log 4, 0, -log 2: token ratios 4, 1, 0.5; sequence ratio 2
TRAINER = torch.tensor([[0.0, 0.0, 0.0]])
ENGINE = torch.tensor([[math.log(0.25), 0.0, math.log(2.0)]])
MASK = torch.ones(1, 3)


def test_tis_token_truncates_at_cap():
    w, m = rollout_correction(TRAINER, ENGINE, MASK, "tis_token", cap=2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 1.0, 0.5]]))
    assert m["is_ratio_min"] == pytest.approx(0.5) and m["is_ratio_max"] == pytest.approx(4.0)
    assert m["is_ratio_mean"] == pytest.approx(5.5 / 3)
    assert m["is_capped_frac"] == pytest.approx(1 / 3) and m["is_masked_frac"] == 0.0


def test_tis_seq_truncates_the_product():
    w, _ = rollout_correction(TRAINER, ENGINE, MASK, "tis_seq", cap=1.5)
    assert torch.allclose(w, torch.full((1, 3), 1.5))  # product 4 * 1 * 0.5 = 2, capped at 1.5
    w, _ = rollout_correction(TRAINER, ENGINE, MASK, "tis_seq", cap=3.0)
    assert torch.allclose(w, torch.full((1, 3), 2.0))


def test_mis_token_drops_tokens_outside_bounds():
    w, m = rollout_correction(TRAINER, ENGINE, MASK, "mis_token", upper=2.0)  # lower = 1/2, bounds inclusive
    assert torch.allclose(w, torch.tensor([[0.0, 1.0, 0.5]]))
    assert m["is_masked_frac"] == pytest.approx(1 / 3)


def test_mis_seq_drops_whole_sequences():
    trainer = torch.zeros(2, 3)
    engine = torch.cat([ENGINE, torch.tensor([[math.log(0.25), 0.0, 0.0]])])  # sequence ratios 2 and 4
    w, m = rollout_correction(trainer, engine, torch.ones(2, 3), "mis_seq", upper=2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 2.0, 2.0], [0.0, 0.0, 0.0]]))
    assert m["is_masked_frac"] == pytest.approx(0.5)


def test_none_is_the_mask_and_reports_mismatch_kl():
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w, m = rollout_correction(TRAINER, ENGINE, mask, "none")
    assert torch.equal(w, mask)
    # k3 with x = trainer - engine: (4 - 1 - log 4) and 0 over the two masked-in tokens
    assert m["mismatch_kl_k3"] == pytest.approx((3 - math.log(4)) / 2, rel=1e-6)
    assert m["mismatch_kl_k1"] == pytest.approx(-math.log(4) / 2, rel=1e-6)


def test_identical_logprobs_give_unit_weights_and_zero_kl():
    lp = torch.tensor([[-0.3, -2.0]])
    for mode in IS_CORRECTIONS:
        w, m = rollout_correction(lp, lp.clone(), torch.ones(1, 2), mode)
        assert torch.equal(w, torch.ones(1, 2)), mode
        assert m["mismatch_kl_k3"] == 0.0 and m["is_masked_frac"] == 0.0


@pytest.mark.parametrize("mode", sorted(IS_CORRECTIONS))
def test_extreme_and_empty_stay_finite(mode):
    w, m = rollout_correction(torch.tensor([[0.0, -200.0]]), torch.tensor([[-200.0, 0.0]]), torch.ones(1, 2), mode)
    assert torch.isfinite(w).all() and all(math.isfinite(v) for v in m.values())
    w, m = rollout_correction(torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2), mode)
    assert torch.equal(w, torch.zeros(2, 2)) and all(math.isfinite(v) for v in m.values())
