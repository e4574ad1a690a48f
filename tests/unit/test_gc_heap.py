"""lorarl.common.gc_heap: start-up objects leave the collector's generations; later cycles still go."""

from __future__ import annotations

import gc
import weakref

from lorarl.common.gc_heap import freeze_long_lived


class Node:
    pass


def test_what_exists_is_frozen_and_later_cycles_are_still_collected() -> None:
    model_like = {"weights": [[0.0] * 4 for _ in range(3)]}
    try:
        assert freeze_long_lived() > 0
        assert not any(o is model_like for o in gc.get_objects())  # no collection walks it any more
        node = Node()
        node.self = node
        alive = weakref.ref(node)
        del node
        gc.collect()
        assert alive() is None
    finally:
        gc.unfreeze()
    assert any(o is model_like for o in gc.get_objects())
