"""What either queue says of a request: its outcome, and the 503 that refuses it.

Both queues, this process's (``fair_queue``) and every replica's
(``shared_queue``), tell each request's outcome by the same names (the
metric's label, the access event's) and refuse with the same errors, each
with a ``Retry-After`` of how long the queue takes to drain
(``drain_seconds``): one place, so the two cannot drift apart.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from enum import Enum

from nixl_twisted.admission.waiting import Claim
from nixl_twisted.config.words import counted
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.errors import ProxyError


class QueueOutcome(str, Enum):
    """What happened to a request at the queue (``nixlproxy_admissions_total{outcome}``:
    its value, as ``str()`` gives it)."""

    AT_ONCE = "at_once"
    AFTER_WAIT = "after_wait"
    QUEUE_FULL = "queue_full"
    TIMED_OUT = "timed_out"
    SHED = "shed"
    LEFT = "left"
    SHUT = "shut"
    #: ``place`` raised: no instance at all (the request's own error).
    FAILED = "failed"
    #: A prefilled request took its decode slot at once, or after it waited (ready lane).
    READY_AT_ONCE = "ready_at_once"
    READY_AFTER_WAIT = "ready_after_wait"
    #: It waited, and left the full queue for a newcomer the fair order lets go first.
    PUSHED_OUT = "pushed_out"
    #: Predicted to miss its first-token target, or still waiting at its latest start.
    TTFT_REFUSED = "ttft_refused"

    def __str__(self) -> str:
        return self.value


AT_ONCE, AFTER_WAIT, QUEUE_FULL, TIMED_OUT, SHED, LEFT, SHUT, FAILED = list(QueueOutcome)[:8]
READY_AT_ONCE, READY_AFTER_WAIT = QueueOutcome.READY_AT_ONCE, QueueOutcome.READY_AFTER_WAIT
PUSHED_OUT = QueueOutcome.PUSHED_OUT
TTFT_REFUSED = QueueOutcome.TTFT_REFUSED

#: (outcome, seconds waited, the request's ticket): told of every request's outcome.
QueueReport = Callable[[QueueOutcome, float, Claim], None]


def shed(ticket: Claim, retry_after: float) -> ProxyError:
    """A sheddable request refused while every instance is at its cap (503 ``shed``)."""
    return ProxyError(
        ErrorCode.SHED,
        "every instance is at its cap and this tenant's requests are sheddable (priority "
        f"{ticket.priority}): try again later",
        retry_after=retry_after,
    )


def full(size: int, retry_after: float) -> ProxyError:
    """A request refused by a full queue (503 ``queue_full``)."""
    return ProxyError(
        ErrorCode.QUEUE_FULL,
        f"the proxy's queue is full ({counted(size, 'request')} waiting for a slot): "
        "try again later",
        retry_after=retry_after,
    )


def pushed_out(size: int, retry_after: float) -> ProxyError:
    """A waiting request that left the full queue for one the fair order lets go first
    (503 ``queue_full``; the access event's ``ended``: ``pushed_out``)."""
    return ProxyError(
        ErrorCode.QUEUE_FULL,
        f"the proxy's queue is full ({counted(size, 'request')} waiting for a slot) and "
        "this request was the one its fair order would let go last: try again later",
        retry_after=retry_after,
        ended=str(PUSHED_OUT),
    )


def timed_out(timeout: float, retry_after: float) -> ProxyError:
    """A request that waited its whole ``--queue-timeout`` (503 ``queue_timeout``)."""
    return ProxyError(
        ErrorCode.QUEUE_TIMEOUT,
        f"no slot came free within the proxy's queue timeout ({timeout:g} s): try again later",
        retry_after=retry_after,
    )


def drain_seconds(went: int, span: float, waiting: int, timeout: float) -> float:
    """Seconds ``waiting`` requests take to go at the rate ``went`` went over ``span``
    seconds: 1 at least, ``timeout`` at most, and ``timeout`` while fewer than two went."""
    if went < 2:
        return timeout
    if span <= 0:
        return 1.0
    rate = (went - 1) / span
    return float(min(timeout, max(1, math.ceil(waiting / rate))))
