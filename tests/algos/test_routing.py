"""Routing replay maths, hand-computed."""

import math

import torch

from actloop.algos.routing import replay_topk, routing_disagreement, topk_differs


def test_replay_keeps_own_choice_without_a_record():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0]])
    own = logits.topk(2).indices  # experts 0 and 2
    w, idx = replay_topk(logits, own, None)
    assert idx.tolist() == [[0, 2]]
    e = math.exp(1.0)  # softmax over (2, 1): e / (e + 1), 1 / (e + 1)
    assert torch.allclose(w, torch.tensor([[e / (e + 1), 1 / (e + 1)]]))


def test_replay_forces_the_engine_choice_with_the_trainers_logits():
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.0, 3.0, 0.0, 1.0]], requires_grad=True)
    own = logits.topk(2).indices
    forced = torch.tensor([[1, 3], [-1, -1]])  # token 0 replayed, token 1 not recorded
    w, idx = replay_topk(logits, own, forced)
    assert idx.tolist() == [[1, 3], [1, 3]]
    # token 0: softmax over logits (0, -1) of experts 1 and 3
    assert torch.allclose(w[0], torch.softmax(torch.tensor([0.0, -1.0]), -1))
    w[0, 0].backward()  # the gate weight keeps its gradient to the router logits
    assert logits.grad[0, 1] != 0 and logits.grad[0, 0] == 0


def test_disagreement_counts_tokens_not_layers_and_ignores_order():
    eng = torch.tensor([[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[0, 1], [2, 3]], [[-1, -1], [-1, -1]]])
    trn = torch.tensor([[[1, 0], [3, 2]], [[0, 2], [2, 3]], [[0, 2], [1, 3]], [[0, 1], [2, 3]]])
    assert topk_differs(eng[:3], trn[:3]).tolist() == [False, True, True]
    mask = torch.tensor([True, True, True, True])
    assert routing_disagreement(eng, trn, mask) == 2 / 3  # the unrecorded token is not compared
    assert routing_disagreement(eng, trn, torch.tensor([True, False, False, False])) == 0.0
    assert routing_disagreement(eng, trn, torch.zeros(4, dtype=torch.bool)) == 0.0
