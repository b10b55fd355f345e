"""Refusals are counted each, and logged at most once a second per reason."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter
from twisted.internet.task import Clock
from twisted.logger import ILogObserver, LogLevel, formatEvent, globalLogPublisher
from zope.interface import provider

from nixl_twisted.observe.refusals import LogThrottle, Refusals
from nixl_twisted.protocol.codes import ErrorCode


@pytest.fixture
def lines() -> Iterator[list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []

    @provider(ILogObserver)
    def observe(event: dict[str, Any]) -> None:
        if event.get("log_namespace") == "nixlproxy.refused":
            seen.append(event)

    globalLogPublisher.addObserver(observe)
    yield seen
    globalLogPublisher.removeObserver(observe)


def test_a_burst_is_one_line_then_one_line_with_its_count(lines: list[dict[str, Any]]) -> None:
    clock = Clock()
    counter = Counter("refused", "", ["reason"], registry=CollectorRegistry())
    refusals = Refusals(counter, LogThrottle(clock))
    for _ in range(1000):
        refusals.refused(ErrorCode.TOO_MANY_REQUESTS_IN_FLIGHT, "at the limit")
    refusals.refused(ErrorCode.DRAINING, "stopping")
    assert [formatEvent(e) for e in lines] == [
        "refused (too_many_requests_in_flight): at the limit",
        "refused (draining): stopping",
    ]
    assert {e["log_level"] for e in lines} == {LogLevel.warn}
    clock.advance(1)
    assert formatEvent(lines[-1]) == (
        "refused (too_many_requests_in_flight): at the limit (999 more like it in the last 1 s)"
    )
    assert len(lines) == 3  # nothing more came for "draining": nothing more said
    assert counter.labels("too_many_requests_in_flight")._value.get() == 1000
    clock.advance(1)
    assert len(lines) == 3
    refusals.refused(ErrorCode.TOO_MANY_REQUESTS_IN_FLIGHT, "again")  # a new burst: said at once
    assert formatEvent(lines[-1]) == "refused (too_many_requests_in_flight): again"


def test_a_steady_stream_is_one_line_a_second(lines: list[dict[str, Any]]) -> None:
    clock = Clock()
    throttle = LogThrottle(clock)
    for _ in range(50):
        for _ in range(10):
            throttle.emit("k", LogLevel.error, "down")
        clock.advance(0.1)
    assert 5 <= len(lines) <= 6  # 5 s of it
    throttle.emit("mixed", LogLevel.warn, "first")
    throttle.emit("mixed", LogLevel.error, "worse")
    throttle.emit("mixed", LogLevel.warn, "last")
    clock.advance(1)
    assert (lines[-1]["log_level"], lines[-1]["count"]) == (LogLevel.error, 2)  # the worst held
    throttle.stop()
    assert not clock.getDelayedCalls()
