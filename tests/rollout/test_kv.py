"""SlackLayer: the continuous decode's KV layer writes decode steps in place and otherwise reads
and behaves as transformers' DynamicLayer (what the engine's join / leave / select rely on)."""

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from actloop.rollout.kv import SlackLayer, with_slack


def _kv(b=2, h=3, s=5, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, s, d, generator=g), torch.randn(b, h, s, d, generator=g)


def test_updates_match_dynamic_layer_and_reuse_the_buffer_within_the_slack():
    k0, v0 = _kv()
    slack, plain = SlackLayer(k0.clone(), v0.clone(), slack=3), DynamicLayer()
    plain.update(k0, v0)
    ptrs = set()
    for t in range(7):
        k, v = _kv(s=1, seed=t + 1)
        ks, vs = slack.update(k, v)
        kp, vp = plain.update(k, v)
        assert torch.equal(ks, kp) and torch.equal(vs, vp)
        assert slack.get_seq_length() == plain.get_seq_length() == 6 + t
        ptrs.add(slack._k.data_ptr())
    # 7 single-column steps with 3 spare columns: the first step re-allocates (the initial tensor has
    # none), then one more every 4 steps -- 2 buffers, not 7
    assert len(ptrs) == 2


def test_assigning_and_selecting_rows_install_the_new_tensor():
    k0, v0 = _kv(b=3)
    layer = SlackLayer(k0, v0, slack=4)
    layer.update(*_kv(b=3, s=1, seed=9))
    full_k = layer.keys.clone()
    layer.batch_select_indices(torch.tensor([0, 2]))
    assert torch.equal(layer.keys, full_k[[0, 2]]) and layer.get_seq_length() == 6
    layer.keys, layer.values = layer.keys[:, :, 2:], layer.values[:, :, 2:]  # the engine's leave() drops columns
    assert layer.get_seq_length() == 4 and layer.keys.shape == (2, 3, 4, 4)
    ks, _ = layer.update(*_kv(b=2, s=2, seed=3))
    assert ks.shape == (2, 3, 6, 4) and torch.equal(ks[:, :, :4], full_k[[0, 2]][:, :, 2:])


def test_with_slack_swaps_a_dynamic_caches_layers():
    k, v = _kv()
    cache = with_slack(DynamicCache([(k, v), (k + 1, v + 1)]))
    assert all(isinstance(layer, SlackLayer) for layer in cache.layers)
    assert cache.get_seq_length() == 5 and torch.equal(cache.layers[1].keys, k + 1)
    keys, _ = cache.update(*_kv(s=1, seed=5), layer_idx=0)
    assert keys.shape[-2] == 6 and cache.get_seq_length() == 6


def test_keep_moves_the_kept_rows_in_place():
    k0, v0 = _kv(b=5, s=6)
    layer = SlackLayer(k0.clone(), v0.clone(), slack=4)
    layer.update(*_kv(b=5, s=1, seed=7))
    before_k, before_v, ptr = layer.keys.clone(), layer.values.clone(), layer._k.data_ptr()
    layer.keep([1, 3, 4], first=2)
    assert torch.equal(layer.keys, before_k[[1, 3, 4]][:, :, 2:]) and torch.equal(layer.values, before_v[[1, 3, 4]][:, :, 2:])
    assert layer._k.data_ptr() == ptr + 2 * layer._k.stride(2) * layer._k.element_size()  # the same storage
    storage = layer._k.untyped_storage().data_ptr()
    ks, _ = layer.update(*_kv(b=3, s=1, seed=8))  # decode goes on in the same buffer's spare columns
    assert ks.shape == (3, 3, 6, 4) and layer._k.untyped_storage().data_ptr() == storage
