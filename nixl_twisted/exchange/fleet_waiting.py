"""One of a replica's requests in the fleet's queue (``fleet_queue``), and what the
``PLACE`` script is told of it and answers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Generic, Protocol, TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall

from nixl_twisted.backends.pools import Lease
from nixl_twisted.exchange.fair_queue import Ticket
from nixl_twisted.fleet import scripts
from nixl_twisted.fleet.replies import WrongReply, count_of, number_of, text, view_of


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
    #: The model whose queue in Redis it waits in: its own when an instance is known to
    #: serve it, else "" (with the requests that name none), so that a name a client
    #: chose never becomes a key.
    model: str = ""
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
        waiting.model,
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


@dataclass(frozen=True)
class Placement:
    """What ``PLACE`` answered, each part checked (``read_placement``)."""

    #: ``scripts.GRANTED``, ``QUEUED``, ``BLOCKED``, ``NOT_FIRST``, ``SHED`` or ``FULL``.
    code: int
    #: The fleet's slots (``POOL|URL`` -> legs) as of ``version``.
    view: dict[str, int]
    version: int
    #: Requests waiting in the fleet's queue, and when the latest were let go (ms, newest
    #: first).
    waiting: int
    grants: list[float]
    #: Queued: its place in the fleet's queue and its finish tag; queued or blocked: the
    #: pool it found full ("" when none).
    member: str = ""
    finish: float = 0.0
    blocked: str = ""


def read_placement(reply: Any) -> Placement:
    """``PLACE``'s reply (``WrongReply`` when any part is not as the script writes it)."""
    if not isinstance(reply, (list, tuple)) or len(reply) != 6:
        raise WrongReply(reply)
    code, said, view, waiting, grants, version = reply
    if type(code) is not int or not scripts.GRANTED <= code <= scripts.FULL:
        raise WrongReply(reply)
    if not isinstance(grants, (list, tuple)):
        raise WrongReply(reply)
    read = Placement(
        code, view_of(view), count_of(version), count_of(waiting), [number_of(g) for g in grants]
    )
    if code == scripts.BLOCKED:
        return replace(read, blocked=text(said))
    if code != scripts.QUEUED:
        return read
    parts = text(said).split("\n")
    if len(parts) != 3 or not parts[0]:
        raise WrongReply(reply)
    member, pool, finish = parts
    return replace(
        read, member=member, finish=number_of(finish), blocked="" if pool == "queued" else pool
    )
