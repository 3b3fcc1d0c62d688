"""One update on a fixed batch learns: for each online algorithm (and online DPO), the
log-probability of the high-reward completion rises relative to the low-reward one.

Tiny random Qwen3 (tests/fixtures/tiny_models.py), fp32, one prompt with two completions of
rewards 1 and 0: every estimator gives the first a positive advantage and the second a negative
one, so one step of the policy gradient must widen logp(high) - logp(low)."""

import time

import pytest
import torch

from actloop.algos import ALGORITHMS
from actloop.config import load_config
from actloop.models import load_models
from actloop.train.rl.critic import Critic
from actloop.train.numerics.logprobs import backbone_and_head, token_logprobs
from actloop.train.rl.update import UpdateContext, rl_update
from actloop.types import Message, Scored, Trajectory, Turn

HIGH, LOW = "The answer is 391.", "Let me compute that with the calculator tool."


def fixed_batch(tokenizer) -> list[Scored]:
    prompt = tuple(tokenizer("What is 23 * 17?", add_special_tokens=False)["input_ids"])
    out = []
    for text, reward in ((HIGH, 1.0), (LOW, 0.0)):
        ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
        turn = Turn(Message("assistant", text), ids, (0.0,) * len(ids), "stop")
        out.append(Scored(Trajectory((Message("user", "What is 23 * 17?"),), prompt, (turn,)), reward=reward,
                          components={}))
    return out


def margin(model, scored: list[Scored], temperature: float) -> float:
    """sum logp(high completion) - sum logp(low completion) under `model`."""
    with torch.no_grad():
        out = token_logprobs(model, [s.trajectory.input_ids for s in scored],
                             [s.trajectory.loss_mask for s in scored], temperature, "fp32")
    sums = (out.logp * out.mask).sum(-1)
    return float(sums[0] - sums[1])


def setup(model_dir: str, algo: str, *extra: str, need_reference: bool = False):
    cfg = load_config(None, [f"model={model_dir}", f"algo={algo}", "train.precision=fp32", "train.lr=1e-3",
                             "train.prompts_per_step=1", "train.group_size=2", "train.beta=0", *extra])
    torch.manual_seed(0)
    models = load_models(cfg.model, need_reference=need_reference)
    return cfg, models, fixed_batch(models.tokenizer)


ONLINE = [name for name, a in ALGORITHMS.items() if a.online]


def test_the_learning_test_covers_every_online_algorithm():
    assert {"grpo", "rloo", "reinforce_pp", "ppo"} <= set(ONLINE)


@pytest.mark.parametrize("algo", ONLINE)
def test_one_update_raises_the_high_reward_sample(tiny_qwen3_dir, algo):
    extra = ("ppo.gamma=1.0", "ppo.lam=1.0") if ALGORITHMS[algo].needs_critic else ()
    cfg, models, scored = setup(tiny_qwen3_dir, algo, *extra)
    critic = Critic(models.policy, cfg.ppo.critic) if ALGORITHMS[algo].needs_critic else None
    params = [{"params": [p for p in models.policy.parameters() if p.requires_grad]}]
    if critic is not None:
        params.append({"params": list(critic.parameters())})
    opt = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=0.0)
    ctx = UpdateContext(cfg, models, opt, critic, 0.0, "none")
    before = margin(models.policy, scored, cfg.rollout.temperature)
    m = rl_update(ctx, scored, 2)
    after = margin(models.policy, scored, cfg.rollout.temperature)
    assert m["trained_trajectories"] == 2 and m["grad_norm"] > 0
    assert after > before + 0.05, (algo, before, after)


def test_online_dpo_update_raises_the_chosen_sample(tiny_qwen3_dir):
    """The update the rollout loop calls for algo=dpo dpo.online=true (its row's loss)."""
    from actloop.train.offline.preference import preference_update

    cfg, models, scored = setup(tiny_qwen3_dir, "dpo", "dpo.online=true", need_reference=True)
    assert ALGORITHMS["dpo"].in_loop(cfg) and ALGORITHMS["dpo"].loss == "preference"
    opt = torch.optim.AdamW([p for p in models.policy.parameters() if p.requires_grad], lr=cfg.train.lr,
                            weight_decay=0.0)
    ctx = UpdateContext(cfg, models, opt, None, 0.0, "none")
    before = margin(models.policy, scored, 1.0)
    m = preference_update(ctx, scored, 2)
    after = margin(models.policy, scored, 1.0)
    assert m["pairs"] == 1 and m["trained_trajectories"] == 2 and m["grad_norm"] > 0
    assert m["loss"] == pytest.approx(0.6931, abs=1e-3)  # log 2: policy == reference before the step
    assert after > before + 0.05, (before, after)


@pytest.mark.parametrize("extra", [
    ("train.epochs=2", "train.minibatch_size=1", "train.micro_batch_size=1"),  # old log-probs fixed before step 1
    ("train.beta=0.05", "kl.mode=loss", "train.entropy_coef=0.01", "correction.mode=tis_token"),
    ("algo=reinforce_pp_token", "train.beta=0.05", "kl.mode=reward", "train.policy_loss=gspo"),
    ("algo=ppo", "ppo.critic=separate", "train.epochs=2", "train.loss_agg=token_mean"),
])
def test_update_options_on_the_padded_batch(tiny_qwen3_dir, extra):
    """Every branch of the batch-based update (old / reference log-probs, entropy bonus with
    gradient, IS correction, KL in the reward, separate critic) runs and still learns."""
    algo = next((e.split("=")[1] for e in extra if e.startswith("algo=")), "grpo")
    beta = next((float(e.split("=")[1]) for e in extra if e.startswith("train.beta=")), 0.0)
    cfg, models, scored = setup(tiny_qwen3_dir, algo, *extra, need_reference=beta > 0)
    critic = Critic(models.policy, cfg.ppo.critic) if ALGORITHMS[algo].needs_critic else None
    params = [{"params": [p for p in models.policy.parameters() if p.requires_grad]}]
    if critic is not None:
        params.append({"params": list(critic.parameters())})
    opt = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=0.0)
    ctx = UpdateContext(cfg, models, opt, critic, beta, cfg.correction.mode if cfg.correction.mode != "auto" else "none")
    before = margin(models.policy, scored, cfg.rollout.temperature)
    m = rl_update(ctx, scored, 2)
    after = margin(models.policy, scored, cfg.rollout.temperature)
    assert m["optimizer_steps"] == cfg.train.epochs * (2 // (cfg.train.minibatch_size or 2))
    assert all(v == v for v in m.values() if isinstance(v, float))  # no NaN
    if beta:  # the reference is the initial policy: KL 0 before this step's change, but measured
        assert m["kl"] >= 0 and ("kl_penalty" in m) == ("kl.mode=reward" in extra)
    if "correction.mode=tis_token" in extra:
        assert "is_ratio_mean" in m
    assert after > before + 0.05, (extra, before, after)


def test_token_budget_splits_micro_batches_without_changing_the_step(tiny_qwen3_dir):
    """train.max_tokens_per_microbatch: more, smaller forwards; the same accumulated gradient."""
    changes = []
    for budget in (0, 1):  # 1: every trajectory alone
        cfg, models, scored = setup(tiny_qwen3_dir, "grpo", f"train.max_tokens_per_microbatch={budget}")
        start = {k: v.clone() for k, v in models.policy.state_dict().items()}
        opt = torch.optim.SGD([p for p in models.policy.parameters() if p.requires_grad], lr=1e-2)
        calls = []
        backbone_and_head(models.policy)[0].register_forward_hook(lambda *_: calls.append(1))
        rl_update(UpdateContext(cfg, models, opt, None, 0.0, "none"), scored, 2)
        changes.append(({k: v - start[k] for k, v in models.policy.state_dict().items()}, len(calls)))
    (a, n_a), (b, n_b) = changes
    assert n_b > n_a
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    assert max(float(v.abs().max()) for v in a.values()) > 1e-4  # the step changed the weights


def test_a_bf16_update_runs_on_bf16_weights_and_learns(tiny_qwen3_dir, monkeypatch):
    """train.precision=bf16 with the default train.bf16_mode=weights: the fixed pass and the optimizer
    step's passes see bf16 parameters (every trainable one, the lent tensors used where given), the
    optimizer steps fp32 masters, and the step still widens the margin."""
    import actloop.train.numerics.mixed_precision as mp

    cfg, models, scored = setup(tiny_qwen3_dir, "grpo", "train.precision=bf16", "train.epochs=2")
    assert cfg.train.bf16_mode == "weights"
    policy = models.policy
    lent_param = next(p for n, p in policy.named_parameters() if n.endswith("layers.0.mlp.up_proj.weight"))
    lent = {id(lent_param): torch.empty(lent_param.shape, dtype=torch.bfloat16)}  # as an engine's copy would lend
    seen = []
    real = mp.bf16_weights

    def spy(*models_, buffers=None):
        seen.append(buffers)
        return real(*models_, buffers=buffers)

    monkeypatch.setattr(mp, "bf16_weights", spy)
    real_tl = token_logprobs

    def check(model, *a, **k):  # every pass of the update computes on bf16 weights
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert lent_param.data_ptr() == lent[id(lent_param)].data_ptr()
        return real_tl(model, *a, **k)

    import actloop.train.rl.update as upd

    monkeypatch.setattr(upd, "token_logprobs", check)
    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=cfg.train.lr, weight_decay=0.0)
    ctx = UpdateContext(cfg, models, opt, None, 0.0, "none", lent_weights=lent)
    before = margin(policy, scored, cfg.rollout.temperature)
    m = rl_update(ctx, scored, 2)
    after = margin(policy, scored, cfg.rollout.temperature)
    assert len(seen) == 1 + 2 and all(b is lent for b in seen)  # the fixed pass (epochs=2: old log-probs), 2 steps
    assert {p.dtype for p in policy.parameters()} == {torch.float32} and m["optimizer_steps"] == 2
    assert m["trained_trajectories"] == 2 and after > before + 0.05, (before, after)


@pytest.mark.parametrize("algo", ONLINE)
def test_the_update_reads_the_algorithms_row_not_its_name(tiny_qwen3_dir, algo, monkeypatch):
    """The same row of ALGORITHMS under another name makes exactly the same step: nothing in the
    update branches on an algorithm's name (a new algorithm is a new row, not a new `if`)."""
    extra = ("ppo.gamma=1.0", "ppo.lam=1.0") if ALGORITHMS[algo].needs_critic else ()
    monkeypatch.setitem(ALGORITHMS, f"renamed_{algo}", ALGORITHMS[algo])
    steps = []
    for name in (algo, f"renamed_{algo}"):
        cfg, models, scored = setup(tiny_qwen3_dir, algo, *extra)
        cfg.algo = name  # the row is the same; only the name differs
        critic = Critic(models.policy, cfg.ppo.critic) if ALGORITHMS[algo].needs_critic else None
        params = [p for p in models.policy.parameters() if p.requires_grad]
        start = [p.detach().clone() for p in params]
        opt = torch.optim.SGD(params + (list(critic.parameters()) if critic else []), lr=1e-2)
        m = rl_update(UpdateContext(cfg, models, opt, critic, 0.0, "none"), scored, 2)
        steps.append(([p.detach() - s for p, s in zip(params, start)], m["grad_norm"]))
    (delta_a, norm_a), (delta_b, norm_b) = steps
    assert max(float(d.abs().max()) for d in delta_a) > 1e-6  # the step changed the weights
    assert norm_a == norm_b and all(torch.equal(a, b) for a, b in zip(delta_a, delta_b)), algo


def test_the_engine_gets_a_turn_after_every_micro_batch(tiny_qwen3_dir):
    """Running ahead on vLLM (ctx.between_passes = engine.decode_for): the update runs in micro-batches
    of at most rollout.decode_during_update trajectories, hands the engine the seconds each took, and
    still learns; `decode_in_update_s` is the engine's time."""
    cfg, models, scored = setup(tiny_qwen3_dir, "grpo", "rollout.decode_during_update=1")
    opt = torch.optim.AdamW([p for p in models.policy.parameters() if p.requires_grad], lr=cfg.train.lr,
                            weight_decay=0.0)
    turns = []

    def decode_for(seconds):
        turns.append(seconds)
        time.sleep(0.05)

    ctx = UpdateContext(cfg, models, opt, None, 0.0, "none", between_passes=decode_for)
    before = margin(models.policy, scored, cfg.rollout.temperature)
    m = rl_update(ctx, scored, 2)
    assert len(turns) == 2 and all(s > 0 for s in turns)  # one micro-batch per trajectory, a turn after each
    assert m["decode_in_update_s"] >= 0.1
    assert margin(models.policy, scored, cfg.rollout.temperature) > before + 0.05
