"""The outlier rule alone: failed legs in a row eject an instance, for longer each time."""

from __future__ import annotations

from twisted.internet.task import Clock

from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.outliers import (
    MAX_SECONDS,
    OutlierRule,
    ejected,
    failed,
    most_ejected,
    succeeded,
)

RULE = OutlierRule(failures=3, seconds=10.0)


def fail(instance: Instance, clock: Clock, times: int, out_now: int = 0, size: int = 2) -> list:
    return [failed(instance, RULE, clock.seconds(), out_now, size) for _ in range(times)]


def test_failures_in_a_row_eject_for_the_base_time_and_it_ends_by_itself() -> None:
    clock, instance = Clock(), Instance("http://d:1", "decode")
    assert fail(instance, clock, 3) == [None, None, 10.0]
    assert ejected(instance, clock.seconds())
    clock.advance(9.9)
    assert ejected(instance, clock.seconds())
    clock.advance(0.1)
    assert not ejected(instance, clock.seconds())
    assert instance.ejected_total == 1


def test_a_success_starts_the_count_again() -> None:
    clock, instance = Clock(), Instance("http://d:1", "decode")
    fail(instance, clock, 2)
    succeeded(instance)
    assert fail(instance, clock, 2) == [None, None]
    assert not ejected(instance, clock.seconds())


def test_each_ejection_lasts_longer_until_it_has_served_long_enough() -> None:
    clock, instance = Clock(), Instance("http://d:1", "decode")
    seconds = []
    for _ in range(4):
        seconds.append(fail(instance, clock, 3)[-1])
        clock.advance(instance.ejected_until - clock.seconds())
    assert seconds == [10.0, 20.0, 30.0, 40.0]
    clock.advance(MAX_SECONDS)  # (served five minutes since it came back)
    assert fail(instance, clock, 3)[-1] == 10.0


def test_an_ejection_never_lasts_past_the_most() -> None:
    instance = Instance("http://d:1", "decode")
    rule = OutlierRule(failures=1, seconds=200.0)
    assert failed(instance, rule, 0.0, 0, 2) == 200.0
    assert failed(instance, rule, 200.0, 0, 2) == MAX_SECONDS


def test_no_pool_is_emptied_by_it() -> None:
    assert [most_ejected(n) for n in (1, 2, 3, 4, 10)] == [0, 1, 1, 2, 5]
    clock, alone = Clock(), Instance("http://d:1", "decode")
    assert fail(alone, clock, 6, size=1) == [None] * 6  # (one instance: health's, never ours)
    other = Instance("http://d:2", "decode")
    assert fail(other, clock, 3, out_now=1, size=2) == [None] * 3
    assert not ejected(other, clock.seconds())
    # Once the other is back, its next failure ejects it (its count held on).
    assert fail(other, clock, 1, out_now=0, size=2) == [10.0]


def test_off_never_ejects() -> None:
    instance = Instance("http://d:1", "decode")
    assert {failed(instance, OutlierRule(failures=0), 0.0, 0, 2) for _ in range(50)} == {None}
