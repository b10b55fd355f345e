"""Each garbage collection's pause reaches the histogram, by generation, once a second."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry, Histogram
from twisted.internet.task import Clock

from nixl_twisted.observe.gc_pauses import GC_BUCKETS, GcPauses


def _made() -> tuple[GcPauses, Histogram, CollectorRegistry, Clock]:
    registry = CollectorRegistry()
    histogram = Histogram("pauses", "", ["generation"], registry=registry, buckets=GC_BUCKETS)
    clock = Clock()
    return GcPauses(histogram, clock), histogram, registry, clock


def _count(registry: CollectorRegistry, generation: str) -> float:
    found = registry.get_sample_value("pauses_count", {"generation": generation})
    return found or 0.0


def test_a_full_collection_is_observed_at_the_next_fold() -> None:
    pauses, _, registry, clock = _made()
    pauses.startService()
    try:
        gc.collect()
        assert _count(registry, "2") == 0  # (noted, not observed inside the collection)
        clock.advance(1.0)
        assert _count(registry, "2") >= 1
        seconds = registry.get_sample_value("pauses_sum", {"generation": "2"})
        assert seconds is not None and seconds > 0
    finally:
        pauses.stopService()


def test_once_stopped_collections_are_not_timed_and_what_was_noted_is_kept() -> None:
    pauses, _, registry, clock = _made()
    callbacks = len(gc.callbacks)
    pauses.startService()
    gc.collect(0)
    pauses.stopService()
    kept = _count(registry, "0")
    assert kept >= 1  # (folded as it stopped)
    gc.collect(0)
    clock.advance(5.0)
    assert _count(registry, "0") == kept
    assert len(gc.callbacks) == callbacks
