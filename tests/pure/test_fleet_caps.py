"""One cap per instance for the fleet, read and said: the rule alone."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from twisted.logger import ILogObserver, formatEvent, globalLogPublisher
from zope.interface import provider

from nixl_twisted.fleet.caps import CapCheck, FleetCap, held, read_caps
from nixl_twisted.fleet.replies import WrongReply
from nixl_twisted.observe.replica_metrics import ReplicaMetrics


def test_the_fleet_holds_the_lowest_and_none_counts_as_the_highest() -> None:
    assert held(6, FleetCap(4, 6)) == 4
    assert held(4, FleetCap(4, 6)) == 4
    assert held(0, FleetCap(4, 0)) == 4  # (uncapped here, capped by another)
    assert held(3, None) == 3  # (before the fleet's is read: its own)
    assert held(0, FleetCap(0, 0)) == 0


def test_a_reply_not_as_the_script_writes_it_is_refused() -> None:
    assert read_caps([b"decode|http://d:1", 4, 6]) == {"decode|http://d:1": FleetCap(4, 6)}
    for wrong in ([b"decode|http://d:1", 4], [b"f", -1, 2], b"x", [b"f", b"abc", 1]):
        with pytest.raises(WrongReply):
            read_caps(wrong)


def test_a_difference_is_said_once_per_change() -> None:
    metrics = ReplicaMetrics(CollectorRegistry())
    check = CapCheck(metrics)
    said: list[str] = []
    observer = provider(ILogObserver)(
        lambda e: said.append(f"{e['log_level'].name} {formatEvent(e)}")
    )
    where = "decode|http://d:1"
    globalLogPublisher.addObserver(observer)
    try:
        for fleet in (FleetCap(4, 6), FleetCap(4, 6), FleetCap(6, 6), FleetCap(4, 6)):
            check.check({where: 6}, {where: fleet})
    finally:
        globalLogPublisher.removeObserver(observer)
    assert [line.split(" ")[0] for line in said] == ["warn", "info", "warn"]
    assert "http://d:1: this replica's cap is 6, another replica's is 4" in said[0]
    assert "holds it to 4" in said[0]
    gauge = metrics.cap_mismatch.labels(pool="decode", instance="http://d:1")
    assert gauge._value.get() == 1
    check.check({}, {})  # (the instance is gone: its gauges too)
    assert [m.samples for m in metrics.cap_mismatch.collect()] == [[]]
