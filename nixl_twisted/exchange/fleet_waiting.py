"""One of a replica's requests in the fleet's queue (``fleet_queue``), and what the
``PLACE`` script is told of it and answers."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall

from nixl_twisted.backends.pools import Lease
from nixl_twisted.exchange.fair_queue import Ticket
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.errors import ProxyError


class Taken(Protocol):
    """What a placement holds: its decode slot, its prefill slot (None: none yet)."""

    @property
    def decode(self) -> Lease: ...

    @property
    def prefill(self) -> Lease | None: ...

    def release(self) -> None: ...


Placed = TypeVar("Placed", bound=Taken)


@dataclass(eq=False)
class FleetWaiting(Generic[Placed]):
    """One of this replica's requests, from its arrival until it has its slots."""

    ticket: Ticket
    place: Callable[[], Placed | str]
    arrived: float
    deferred: Deferred[Placed]
    order: int
    member: str = ""
    finish: float = 0.0
    timer: IDelayedCall | None = None
    #: The pool it found full last time it was tried ("decode" or "prefill").
    blocked: str = ""
    #: Its client left (while Redis was asked), or it has its slots, or it left the queue.
    gone: bool = False
    done: bool = False
    #: Where it waits while this replica is alone (``FairQueue``'s Deferred).
    inner: Deferred[Placed] | None = None


def place_args(
    size: int,
    waiting: FleetWaiting[Placed],
    member: str,
    got: Placed | str,
    decode: tuple[str, int, str],
    prefill: tuple[str, int, str],
    sheddable: bool,
) -> list[object]:
    """``PLACE``'s arguments after the prefix and the replica (``scripts.PLACE``): the
    request (``member``: its place, "" when new), ``size`` (the queue's), and its slots
    (or the pool this replica sees full, ``got``)."""
    ticket = waiting.ticket
    return [
        ticket.model or "",
        ticket.priority,
        member,
        ticket.tenant or "",
        ticket.weight,
        1 if sheddable else 0,
        size,
        waiting.order,
        got if isinstance(got, str) else "",
        *decode,
        *prefill,
    ]


def shed(ticket: Ticket, retry_after: float) -> ProxyError:
    return ProxyError(
        ErrorCode.SHED,
        "the fleet is full and this tenant's requests are sheddable (priority "
        f"{ticket.priority}): try again later",
        retry_after=retry_after,
    )


def full(size: int, retry_after: float) -> ProxyError:
    return ProxyError(
        ErrorCode.QUEUE_FULL,
        f"the proxy's queue is full ({size} requests wait for a slot): try again later",
        retry_after=retry_after,
    )


def timed_out(timeout: float, retry_after: float) -> ProxyError:
    return ProxyError(
        ErrorCode.QUEUE_TIMEOUT,
        f"no slot came free within the proxy's queue timeout ({timeout:g} s): try again later",
        retry_after=retry_after,
    )


def drain_seconds(grants: Sequence[float], waiting: int, timeout: float) -> float:
    """Seconds the fleet's queue takes to drain at the rate the fleet let requests go lately
    (``grants``: their times in ms, newest first): 1 at least, ``timeout`` at most, and
    ``timeout`` while fewer than two went."""
    if len(grants) < 2:
        return timeout
    span = (grants[0] - grants[-1]) / 1000
    if span <= 0:
        return 1.0
    rate = (len(grants) - 1) / span
    return float(min(timeout, max(1, math.ceil(waiting / rate))))
