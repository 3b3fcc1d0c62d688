"""Episodes with several segments (an agent behind the gateway that rewrote its history): every
segment is trained with its episode's advantage (sequence-level estimators)."""

import torch

from actloop.config import load_config
from actloop.models.resolve import Models
from actloop.train.numerics.optim import adamw
from actloop.train.rl.update import UpdateContext, expand_segments, rl_update
from actloop.types import Message, Scored, Trajectory, Turn


def traj(prompt, sampled, segments=()):
    turn = Turn(Message("assistant", "x"), tuple(sampled), tuple(-1.0 for _ in sampled), "stop")
    return Trajectory((Message("user", "q"),), tuple(prompt), (turn,), segments=tuple(segments))


def batch(with_segment: bool):
    earlier = traj([1, 2, 3], [7, 8, 9, 10])
    a = traj([4, 5], [11, 12], [earlier] if with_segment else [])
    b = traj([4, 5], [13, 14])
    return [Scored(a, 1.0, {}), Scored(b, 0.0, {})]


def test_expand_segments_appends_earlier_segments_owned_by_their_episode():
    items, owner = expand_segments(batch(True))
    assert len(items) == 3 and owner == {2: 0}
    assert items[2].trajectory.input_ids == [1, 2, 3, 7, 8, 9, 10] and items[2].reward == 1.0


def _update(with_segment: bool, overrides=()):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=17, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))
    cfg = load_config(None, ["train.precision=fp32", "train.lr=0.01", "train.group_size=2", *overrides])
    opt = adamw([{"params": list(model.parameters()), "lr": 0.01}], 0.01, 0.0, fused=False)
    ctx = UpdateContext(cfg, Models(model, None, None, False), opt, None, 0.0, "none")
    before = model.model.embed_tokens.weight.detach().clone()
    metrics = rl_update(ctx, batch(with_segment), 2)
    return metrics, (model.model.embed_tokens.weight.detach() - before)


def test_the_earlier_segment_is_trained_with_the_episodes_advantage():
    m, delta = _update(True)
    assert m["trained_trajectories"] == 3 and m["extra_segments"] == 1
    assert delta[[7, 8, 9]].abs().sum() > 0  # the earlier segment's inputs got a gradient
    m0, delta0 = _update(False)
    assert m0["trained_trajectories"] == 2 and delta0[[7, 8, 9]].abs().sum() == 0


def test_token_level_estimators_train_the_last_segment_and_count_the_rest():
    m, delta = _update(True, ["train.turn_credit=true"])
    assert m["segments_dropped"] == 1 and m["trained_trajectories"] == 2
    assert delta[[7, 8, 9]].abs().sum() == 0
