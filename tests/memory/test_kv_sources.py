"""Instances of a kv-aware pool asked where they publish, in memory: when, how often, what shows.

The fakes here publish nothing (``{}``) or fail the question; a
fake's ``kv_sources_reads`` counts the questions it was asked.
"""

from __future__ import annotations

from typing import Any

from nixl_twisted.backends.health import State
from tests.memory.support import Setup


def kv_aware(**settings: Any) -> Setup:
    """A kv-aware proxy in memory, its KV events' service started (the in-memory tree's
    is not: its fakes publish nothing)."""
    setup = Setup(prefill_policy="kv-aware", health_interval=0, **settings)
    setup.proxy.app.serving.legs.kv.startService()
    setup.proxy.advance(0)
    return setup


def events_of(setup: Setup, role: str = "prefill") -> Any:
    (instance,) = setup.get("/healthcheck").answer().json()["instances"][role]
    return instance["kv_events"]


def test_an_instance_of_a_kv_aware_pool_is_asked_as_it_joins() -> None:
    setup = kv_aware()
    assert setup.prefill.kv_sources_reads == 1
    assert setup.decode.kv_sources_reads == 0  # its pool is round-robin: not asked


def test_events_off_are_said_in_the_healthcheck_and_asked_again_later() -> None:
    setup = kv_aware()
    said = events_of(setup)
    assert said["found"] == "asked"
    assert said["state"] == "off"
    assert said["reason"] == "its KV events are off (it lists no publisher)"
    assert said["endpoint"] is None and said["blocks"] == 0
    # Asked again after 1 s, then 2 s, 4 s: a backoff, never a loop.
    asked = []
    for _ in range(8):
        setup.proxy.advance(1)
        asked.append(setup.prefill.kv_sources_reads)
    assert asked == [2, 2, 3, 3, 3, 3, 4, 4]


def test_a_failed_question_is_said_and_asked_again_with_a_backoff() -> None:
    setup = kv_aware(fake_options={"kv_sources_status": 500})
    said = events_of(setup)
    assert said["state"] == "unanswered"
    assert said["reason"] == "GET /kv_event_sources: GET /kv_event_sources answered HTTP 500"
    for fake in setup.prefills:
        fake.kv_sources_status = 200
    setup.proxy.advance(1)
    assert setup.prefill.kv_sources_reads == 2
    assert events_of(setup)["state"] == "off"  # answered now: nothing published


def test_an_instance_that_comes_back_up_is_asked_again_at_once() -> None:
    setup = kv_aware()
    setup.proxy.advance(60)  # the backoff grown long
    instance = setup.proxy.service.backends.prefill.instances[0]
    reads = setup.prefill.kv_sources_reads
    instance.state = State.DOWN
    setup.proxy.advance(1)
    instance.state = State.UP
    setup.proxy.advance(1)
    assert setup.prefill.kv_sources_reads == reads + 1


def test_a_url_that_names_its_ports_is_not_asked() -> None:
    setup = kv_aware(prefill_kv_events_port=5557)
    setup.proxy.advance(1)
    assert setup.prefill.kv_sources_reads == 0
    assert events_of(setup)["found"] == "configured"
