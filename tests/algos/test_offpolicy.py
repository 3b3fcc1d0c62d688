"""The decoupled PPO loss and the proximal approximation (actloop.algos.offpolicy), against numbers
computed by hand; and the algorithm table's answer to rollout.max_staleness > 0."""

import math

import pytest
import torch

from actloop.algos import ALGORITHMS
from actloop.algos.losses import clipped_pg_loss
from actloop.algos.offpolicy import approx_proximal_logp, decoupled_pg_loss
from actloop.config import ConfigError, load_config

# one sequence of 3 tokens, advantage 1, token_mean weights 1/3
PROX = torch.tensor([[0.0, 0.0, 0.0]])
BEHAV = torch.tensor([[math.log(0.25), 0.0, math.log(2.0)]])  # behaviour weights pi_prox / mu = 4, 1, 0.5
CURRENT = torch.tensor([[math.log(1.5), math.log(0.5), 0.0]])  # ratios to the proximal policy 1.5, 0.5, 1
W = torch.full((1, 3), 1 / 3)
ADV = torch.ones(1)


def test_clipped_around_the_proximal_policy_weighted_by_the_capped_behaviour_ratio():
    logp = CURRENT.clone().requires_grad_(True)
    loss, m = decoupled_pg_loss(logp, PROX, BEHAV, ADV, W, correction="tis_token", cap=2.0, clip_eps=0.2)
    # behaviour weights capped at 2: (2, 1, 0.5); surrogate min(r A, clip(r, 0.8, 1.2) A) = (1.2, 0.5, 1.0)
    # loss = -(2 * 1.2 + 1 * 0.5 + 0.5 * 1.0) / 3 = -3.4 / 3
    assert float(loss.detach()) == pytest.approx(-3.4 / 3, abs=1e-6)
    loss.backward()
    # token 1 is clipped (r = 1.5 > 1.2: no gradient); d/dlogp_t = -w_t r_t A / 3 elsewhere
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -0.5 / 3, -0.5 / 3]]), atol=1e-6)
    # against the behaviour policy token 1's ratio would be 6; against the proximal one it is 1.5
    assert m["ratio_max"] == pytest.approx(1.5) and m["clip_frac"] == pytest.approx(1 / 3)
    assert m["is_ratio_max"] == pytest.approx(4.0) and m["is_capped_frac"] == pytest.approx(1 / 3)


def test_mis_masks_tokens_whose_behaviour_ratio_is_out_of_bounds():
    loss, m = decoupled_pg_loss(CURRENT, PROX, BEHAV, ADV, W, correction="mis_token", upper=2.0, clip_eps=0.2)
    # weights (0, 1, 0.5): -(0 + 0.5 + 0.5) / 3
    assert float(loss) == pytest.approx(-1.0 / 3, abs=1e-6)
    assert m["is_masked_frac"] == pytest.approx(1 / 3)


def test_fresh_data_is_the_synchronous_loss():
    """Behaviour = proximal (sampled by the weights being updated, no engine mismatch): weight 1,
    the plain clipped loss."""
    a, _ = decoupled_pg_loss(CURRENT, PROX, PROX, ADV, W, correction="tis_token", clip_eps=0.2)
    b, _ = clipped_pg_loss(CURRENT, PROX, ADV, W, 0.2)
    assert float(a) == pytest.approx(float(b)) == pytest.approx(-(1.2 + 0.5 + 1.0) / 3)
    c, m = decoupled_pg_loss(CURRENT, PROX, BEHAV, ADV, W, correction="none", clip_eps=0.2)
    assert float(c) == pytest.approx(float(b)) and "is_ratio_max" not in m


def test_loglinear_proximal_interpolates_by_version():
    behav = torch.full((1, 4), -1.0)
    cur = torch.full((1, 4), -0.2)
    versions = torch.tensor([[3, 2, 0, 0]])
    mask = torch.tensor([[True, True, True, False]])
    # proximal version 3, theta 4: alpha = (3 - v) / (4 - v) = 0, 1/2, 3/4; off the mask the behaviour's
    prox = approx_proximal_logp(behav, cur, versions, 3, mask)
    assert torch.allclose(prox, torch.tensor([[-1.0, -0.6, -0.4, -1.0]]))


def test_loglinear_proximal_carries_no_gradient():
    cur = torch.full((1, 2), -0.2, requires_grad=True)
    prox = approx_proximal_logp(torch.full((1, 2), -1.0), cur, torch.tensor([[0, 1]]), 2, torch.ones(1, 2))
    assert not prox.requires_grad


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithm_supports_stale_data_or_refuses_it_with_the_reason(name):
    extra = ["dpo.online=true"] if name == "dpo" else []
    overrides = [f"algo={name}", "rollout.max_staleness=2", "train.group_size=4", *extra]
    alg = ALGORITHMS[name]
    if alg.stale_refusal:
        with pytest.raises(ConfigError, match="max_staleness > 0 is refused") as e:
            load_config(None, overrides)
        assert alg.stale_refusal in str(e.value)
    else:
        assert load_config(None, overrides).rollout.max_staleness == 2


@pytest.mark.parametrize("override, msg", [
    ("correction.mode=none", "behaviour weight"),
    ("rollout.engine=ray", "tags each token with its policy version"),
    ("rollout.engine=vllm-server rollout.vllm_server_sync=none", "needs a weight sync"),
])
def test_stale_data_needs_the_behaviour_weight_and_a_versioned_engine(override, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(None, ["rollout.max_staleness=1", *override.split()])
    load_config(None, ["rollout.max_staleness=0", *override.split()])  # the synchronous loop takes them


def test_a_vllm_server_with_a_weight_sync_samples_ahead():
    assert load_config(None, ["rollout.max_staleness=1", "rollout.engine=vllm-server"]).rollout.max_staleness == 1
