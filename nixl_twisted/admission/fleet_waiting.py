"""One of a replica's requests in the fleet's queue (``shared_queue``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall

from nixl_twisted.admission.fair_queue import Claim, Pool
from nixl_twisted.backends.pools import Lease


class Held(Protocol):
    """What a placement holds: its decode slot, its prefill slot (None: none yet)."""

    @property
    def decode(self) -> Lease: ...

    @property
    def prefill(self) -> Lease | None: ...

    def release(self) -> None: ...


H = TypeVar("H", bound=Held)


@dataclass(eq=False)
class FleetWaiting(Generic[H]):
    """One of this replica's requests, from its arrival until it has its slots."""

    ticket: Claim
    place: Callable[[], H | Pool]
    arrived: float
    deferred: Deferred[H]
    order: int
    #: The model whose queue in Redis it waits in: its own when an instance is known to
    #: serve it, else "" (with the requests that name none), so that a name a client
    #: chose never becomes a key.
    model: str = ""
    member: str = ""
    finish: float = 0.0
    timer: IDelayedCall | None = None
    #: The pool it found full last time it was tried ("": none, it waits behind another).
    blocked: Pool | str = ""
    #: Its client left (while Redis was asked), or it has its slots, or it left the queue.
    gone: bool = False
    done: bool = False
    #: Where it waits while this replica is alone (``FairQueue``'s Deferred).
    inner: Deferred[H] | None = None
