"""A count in a sentence: one replica, two replicas; and the messages that say counts."""

from __future__ import annotations

from nixl_twisted.admission.outcomes import full
from nixl_twisted.config.words import counted


def test_a_count_of_one_takes_the_singular() -> None:
    assert [counted(n, "replica") for n in (0, 1, 2)] == ["0 replicas", "1 replica", "2 replicas"]
    assert counted(1, "client key") == "1 client key"
    assert counted(1.5, "second") == "1.5 seconds"
    assert counted(3, "entry", "entries") == "3 entries"


def test_a_queue_of_one_says_one_request() -> None:
    assert "(1 request waiting for a slot)" in full(1, 1.0).message
    assert "(4 requests waiting for a slot)" in full(4, 1.0).message
