"""The started proxy's heap is frozen, and startup's garbage is collected, not frozen."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from nixl_twisted.run import heap


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


class _Node:
    def __init__(self) -> None:
        self.me = self


def test_settle_freezes_what_lives(unfrozen: None) -> None:
    kept = [_Node() for _ in range(100)]
    frozen = heap.settle()
    assert frozen >= len(kept)
    assert gc.get_freeze_count() == frozen
    # What is frozen is never walked again: a collection leaves it alone.
    assert all(gc.is_tracked(node) for node in kept)
    assert not any(any(node is o for o in gc.get_objects()) for node in kept[:3])


def test_settle_collects_garbage_before_freezing(unfrozen: None) -> None:
    garbage = _Node()
    gone = weakref.ref(garbage)
    del garbage
    heap.settle()
    assert gone() is None
