"""Advantages as the update computes them from scored trajectories (no model needed)."""

import torch

from actloop.config import load_config
from actloop.train.rl.update import RolloutBatch, UpdateContext, compute_advantages
from actloop.types import Message, Scored, Trajectory, Turn


def episode(turn_rewards, outcome, lengths):
    turns = tuple(Turn(Message("assistant", f"t{k}"), tuple(range(n)), (0.0,) * n, "stop", reward=r)
                  for k, (r, n) in enumerate(zip(turn_rewards, lengths)))
    return Scored(Trajectory((Message("user", "q"),), (1,), turns), reward=outcome, components={})


def advantages(overrides, scored, group_size):
    cfg = load_config(None, overrides)
    ctx = UpdateContext(cfg, models=None, optimizer=None, critic=None, beta=0.0, correction="none")
    adv, _, _ = compute_advantages(ctx, scored, RolloutBatch.from_scored(scored), list(range(len(scored))), group_size)
    return rows(adv, scored)


def rows(x, scored):
    """[B, T] -> each trajectory's sampled tokens."""
    return [x[i, : sum(s.trajectory.loss_mask)] for i, s in enumerate(scored)]


def test_turn_credit_hand_worked_two_turn_example():
    # A: turn rewards [0.5, 0] + outcome 1 -> returns G1 = 1.5, G2 = 1.0; B: all 0 -> G1 = G2 = 0.
    # Group baselines: turn 1 0.75, turn 2 0.5 -> A gets +0.75 on turn 1's tokens, +0.5 on turn 2's.
    scored = [episode([0.5, 0.0], 1.0, [2, 1]), episode([0.0, 0.0], 0.0, [1, 3])]
    adv = advantages(["train.turn_credit=true", "train.adv_scale=none"], scored, 2)
    assert torch.allclose(adv[0], torch.tensor([0.75, 0.75, 0.5]))
    assert torch.allclose(adv[1], torch.tensor([-0.75, -0.5, -0.5, -0.5]))


def test_turn_credit_discounts_later_turns():
    scored = [episode([0.0, 0.0], 1.0, [1, 1]), episode([0.0, 0.0], 0.0, [1, 1])]
    adv = advantages(["train.turn_credit=true", "train.adv_scale=none", "train.turn_gamma=0.5"], scored, 2)
    # A: G1 = 0.5 * 1, G2 = 1 -> baselines 0.25, 0.5 -> A: [0.25, 0.5]
    assert torch.allclose(adv[0], torch.tensor([0.25, 0.5]))


def test_sequence_level_grpo_gives_every_token_the_same_advantage():
    scored = [episode([None], 1.0, [2]), episode([None], 0.0, [3])]
    adv = advantages(["train.adv_scale=none"], scored, 2)
    assert torch.allclose(adv[0], torch.tensor([0.5, 0.5])) and torch.allclose(adv[1], torch.full((3,), -0.5))


def test_grpo_scales_by_group_std_by_default():
    scored = [episode([None], 1.0, [1]), episode([None], 0.0, [1])]
    adv = advantages([], scored, 2)  # mean 0.5, unbiased std 0.7071 -> +-0.7071
    assert torch.allclose(adv[0], torch.tensor([0.7070])), adv[0]


def test_reinforce_pp_token_is_reachable_and_whitens_token_returns():
    # one turn each, outcome on the last token: returns (gamma 1) are 1 on A's 2 tokens, 0 on B's 2
    scored = [episode([None], 1.0, [2]), episode([None], 0.0, [2])]
    adv = advantages(["algo=reinforce_pp_token"], scored, 2)
    flat = torch.cat([adv[0], adv[1]])
    assert torch.allclose(flat.mean(), torch.tensor(0.0), atol=1e-6)  # whitened over the batch's tokens
    assert (adv[0] > 0).all() and (adv[1] < 0).all()


def test_ppo_feeds_critic_values_and_whitens():
    cfg = load_config(None, ["algo=ppo", "ppo.gamma=1.0", "ppo.lam=1.0"])
    ctx = UpdateContext(cfg, models=None, optimizer=None, critic=None, beta=0.0, correction="none")
    scored = [episode([None], 1.0, [2]), episode([None], 0.0, [2])]
    batch = RolloutBatch.from_scored(scored)
    batch.values = torch.full((2, 2), 0.5)
    adv, ret, _ = compute_advantages(ctx, scored, batch, [0, 1], 2)
    adv, ret = rows(adv, scored), rows(ret, scored)
    # returns are the critic targets: the outcome on every token (gamma = lam = 1)
    assert torch.allclose(ret[0], torch.tensor([1.0, 1.0])) and torch.allclose(ret[1], torch.zeros(2))
    flat = torch.cat([adv[0], adv[1]])
    assert torch.allclose(flat.mean(), torch.tensor(0.0), atol=1e-6) and (adv[0] > 0).all() and (adv[1] < 0).all()


def test_masked_trajectory_gets_no_advantage():
    scored = [episode([None], 1.0, [1]), episode([None], 0.0, [1]), episode([None], 0.5, [1])]
    cfg = load_config(None, ["train.adv_scale=none"])
    ctx = UpdateContext(cfg, models=None, optimizer=None, critic=None, beta=0.0, correction="none")
    adv, _, _ = compute_advantages(ctx, scored, RolloutBatch.from_scored(scored), [0, 1], 3)
    adv = rows(adv, scored)
    assert float(adv[2]) == 0.0 and torch.allclose(adv[0], torch.tensor([0.5]))


def test_run_batched_runs_every_row_once_in_order_within_the_cap():
    from actloop.train.runtime.evaluate import run_batched

    calls = []

    class Task:
        make_env = None

        @staticmethod
        def rollout(engine, renderer, make_env, rows, params, max_turns, max_context):
            calls.append(list(rows))
            return [r["i"] for r in rows]

    rows = [{"i": i} for i in range(7)]
    assert run_batched(Task, None, None, rows, None, 1, 10, max_batch=3) == list(range(7))
    assert [len(c) for c in calls] == [3, 3, 1]
    calls.clear()
    assert run_batched(Task, None, None, rows, None, 1, 10) == list(range(7)) and len(calls) == 1


def test_every_trajectory_failed_before_its_first_turn():
    """A step whose episodes all failed at reset (no turns, masked) gives zero advantages, no crash."""
    empty = [Scored(Trajectory((Message("user", "q"),), (1,), ()), reward=0.0, components={}, masked=True)
             for _ in range(2)]
    for algo in ("grpo", "ppo", "reinforce_pp_token"):
        cfg = load_config(None, [f"algo={algo}"])
        ctx = UpdateContext(cfg, models=None, optimizer=None, critic=None, beta=0.0, correction="none")
        adv, _, _ = compute_advantages(ctx, empty, RolloutBatch.from_scored(empty), [], 2)
        assert adv.numel() == 0
