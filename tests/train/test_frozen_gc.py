"""`memory.frozen_gc`: the objects alive when the training loop starts are left out of the cyclic
collector's walks for the loop (each full collection walked ~370k of them), and nothing else changes."""

import gc
import weakref

from actloop.train.runtime.memory import frozen_gc


class _Node:
    pass


def _cycle():
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_setup_objects_are_frozen_for_the_block_and_new_cycles_still_collected():
    gc.collect()
    assert gc.get_freeze_count() == 0
    before = _Node()
    with frozen_gc():
        assert gc.get_freeze_count() > 0
        assert not any(o is before for o in gc.get_objects())  # out of the collector's walks
        made_inside = _cycle()
        gc.collect()
        assert made_inside() is None  # a cycle made in the loop is collected as before
    assert gc.get_freeze_count() == 0
    assert any(o is before for o in gc.get_objects())  # back under the collector


def test_a_callers_own_freeze_is_left_as_it_was():
    gc.freeze()
    try:
        with frozen_gc():
            pass
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
