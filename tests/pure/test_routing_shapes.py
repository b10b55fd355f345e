"""The routing guard: every workload shape a user runs, replayed through the proxy's own pool
and policies before the fakes' prefix caches (``bench.replay``), at or above its measured hit
rate.

A hit rate is a count: the replay is seeded and its time simulated, so each
figure is the same on every machine. The floors are what was measured when
routing stopped giving up hits for a balance no load asked for (issue 45,
``docs/performance.md``); a change that lowers any shape's rate fails here,
whichever shape it helped.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.replay import replay
from bench.workloads import SHAPES, at, shape

#: (shape, instances, in flight): the lowest share of the ideal's hit rate measured over
#: seeds 1, 2 and 3, for cache-aware and kv-aware.
FLOORS = {
    ("documents", 2, 1): (1.0, 1.0),
    ("documents", 8, 4): (0.987, 0.987),
    ("chat", 4, 4): (0.987, 0.987),
    ("chat", 4, 1): (1.0, 1.0),
    ("chat", 8, 4): (0.987, 0.987),
    ("prefix_repetition", 2, 4): (1.0, 1.0),
    ("prefix_repetition", 2, 1): (1.0, 1.0),
    ("prefix_repetition", 8, 4): (1.0, 1.0),
    ("mixed", 4, 4): (0.99, 0.99),
    ("mixed", 4, 1): (1.0, 1.0),
    ("mixed", 8, 4): (0.99, 0.99),
}


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("where", list(FLOORS), ids=lambda where: "-".join(map(str, where)))
def test_each_policy_keeps_each_shapes_hit_rate(where: tuple[str, int, int], seed: int) -> None:
    name, instances, in_flight = where
    known = at(shape(name), instances, in_flight)
    ideal = replay(known, "ideal", seed).hit_rate
    round_robin = replay(known, "round-robin", seed).hit_rate
    for policy, floor in zip(("cache-aware", "kv-aware"), FLOORS[where], strict=True):
        rate = replay(known, policy, seed).hit_rate
        assert rate / ideal >= floor, f"{policy}: {rate / ideal:.4f} of the ideal"
        assert rate >= round_robin


def test_every_shape_of_the_issue_is_guarded_as_measured() -> None:
    assert {(s.name, s.instances, s.concurrency) for s in SHAPES} <= set(FLOORS)


def test_one_request_at_a_time_never_moves_a_prompt_from_its_prefix() -> None:
    """Nothing is busy: every question over a known document goes where the document is."""
    known = at(shape("documents"), 4, 1)
    for policy, followed in (("cache-aware", "prefix"), ("kv-aware", "kv_match")):
        said = replay(known, policy, 1)
        assert "balanced" not in said.decisions
        assert said.decisions[followed] >= 20  # 24 questions, the first of each of 4 documents


def test_the_guard_copies_a_hot_prefix_only_when_its_instance_is_measurably_busier() -> None:
    """One prefix every prompt shares: at 4 in flight its instance takes them all (nothing
    is measurably busier); at 16 the load asks for a copy, and the two instances share."""
    hot = replace(shape("prefix_repetition"), documents=1)
    for policy in ("cache-aware", "kv-aware"):
        calm = replay(at(hot, 2, 4), policy, 1)
        assert ("balanced" in calm.decisions, sorted(calm.legs)) == (False, [0, 64])
        loaded = replay(at(hot, 2, 16), policy, 1)
        assert (loaded.decisions["balanced"], loaded.legs) == (1, [32, 32])
