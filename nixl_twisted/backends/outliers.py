"""Outlier ejection, as Envoy's: an instance whose legs fail in a row leaves rotation a while.

Health (``health``) takes an instance out when it cannot be reached; an
instance that answers, but answers every leg with an error (a decode whose
KV loads all fail answers 500), stays up. Here each leg's outcome counts:
``failures`` failed legs in a row (a 5xx other than 503, a refused
connection, a timeout, a broken stream) eject it for ``seconds`` times the
ejections it had lately (``seconds``, then twice, three times...,
``MAX_SECONDS`` at most); a success starts the count again. An ejection
ends by itself; the count of ejections starts again once an instance has
served ``MAX_SECONDS`` since its last one ended.

No pool is emptied by it: at most half its instances (one of two) are out
at once, and a pool of one instance never ejects it (a failing instance is
then left to health and the panic rule). The rule is pure
(``failed``); ``leg_failed`` is the pool's, and says each ejection once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from twisted.logger import Logger

log = Logger()

#: The longest an ejection lasts, and how long an instance serves before its next
#: ejection is counted from the first again.
MAX_SECONDS = 300.0
#: The share of a pool's instances ejected at once, at most (one at least, in a pool
#: of two or more).
MAX_EJECTED_SHARE = 0.5


@dataclass(frozen=True)
class OutlierRule:
    """``--outlier-consecutive-failures`` (0: off) and ``--outlier-ejection-seconds``."""

    failures: int = 5
    seconds: float = 30.0


class Ejectable(Protocol):
    #: Legs failed in a row, ejections counted lately, and until when it is out.
    leg_failures: int
    ejections: int
    ejected_until: float
    #: Every ejection so far (``nixlproxy_outlier_ejections_total``).
    ejected_total: int


def most_ejected(size: int) -> int:
    """How many of a pool of ``size`` instances may be ejected at once."""
    if size < 2:
        return 0
    return max(1, int(size * MAX_EJECTED_SHARE))


def ejected(instance: Ejectable, now: float) -> bool:
    return now < instance.ejected_until


def succeeded(instance: Ejectable) -> None:
    """A leg that worked: its count of failures in a row starts again."""
    instance.leg_failures = 0


def failed(
    instance: Ejectable, rule: OutlierRule, now: float, out_now: int, size: int
) -> float | None:
    """Count a failed leg of ``instance``, one of ``size`` in its pool with ``out_now``
    ejected now; the seconds it is ejected for when this ejects it, else None."""
    instance.leg_failures += 1
    if rule.failures == 0 or instance.leg_failures < rule.failures or ejected(instance, now):
        return None
    if out_now >= most_ejected(size):
        return None  # (counted on: ejected as soon as another comes back)
    if instance.ejections and now - instance.ejected_until >= MAX_SECONDS:
        instance.ejections = 0  # (it served long enough: this one counts as a first)
    instance.ejections += 1
    instance.ejected_total += 1
    instance.leg_failures = 0
    seconds = min(MAX_SECONDS, rule.seconds * instance.ejections)
    instance.ejected_until = now + seconds
    return seconds


def leg_failed(
    role: str,
    instances: Sequence[Ejectable],
    instance: Ejectable,
    rule: OutlierRule,
    now: float,
    url: str,
    reason: str,
) -> None:
    """A leg of ``instance`` (of the pool ``role`` of ``instances``) failed: counted, and
    the instance ejected when it is due, said at warn level once per ejection."""
    out_now = sum(1 for other in instances if ejected(other, now))
    seconds = failed(instance, rule, now, out_now, len(instances))
    if seconds is not None:
        log.warn(
            "{role} instance {url} ejected for {seconds:g} s after {failures} failed legs in a "
            "row (ejection {n} lately): {reason}",
            role=role,
            url=url,
            seconds=seconds,
            failures=rule.failures,
            n=instance.ejections,
            reason=reason,
        )
