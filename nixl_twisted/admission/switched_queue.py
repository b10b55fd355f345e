"""``SwitchedQueue``: the fleet's queue while Redis answers, this replica's own while not.

One ``SlotQueue`` for ``Slots`` when ``--replicas-redis`` is set: it hands each
request to the queue of the moment and is the ``Replicas`` holder told when Redis
comes and goes (and when the replicas stop). Going alone, what waited in the
fleet's queue (``shared_queue``) moves to this replica's own (``fleet_alone``);
when Redis answers again, what waits here joins the fleet's (at its next pump).
Nothing else asks which queue is the current one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Protocol

from twisted.internet.defer import Deferred

from nixl_twisted.admission.fleet_alone import AloneQueue
from nixl_twisted.admission.predictor import Prediction, Rates
from nixl_twisted.admission.shared_queue import SharedQueue
from nixl_twisted.admission.waiting import Claim, H, Pool, Waiting
from nixl_twisted.fleet.replicas import Replicas
from nixl_twisted.protocol.errors import ProxyError


class Current(Protocol[H]):
    """Where a new request waits now: its slots at once, or None while it waits."""

    def arrive(self, waiting: Waiting[H]) -> H | None: ...

    def pump(self) -> None: ...


class SwitchedQueue(Generic[H]):
    """Requests waiting for slots, in the fleet's queue or this replica's own."""

    def __init__(self, fleet: SharedQueue[H], replicas: Replicas) -> None:
        self.fleet = fleet
        #: The fleet's legs on each capped instance (what the status and tests read).
        self.slots = fleet.slots
        self.alone_queue: AloneQueue[H] = fleet.alone_queue
        #: The queue new requests go to: this replica's own until Redis first answers.
        self.current: Current[H] = self.alone_queue
        replicas.hold(self)
        replicas.on_freed(self._freed)

    # -- SlotQueue --------------------------------------------------------------------

    @property
    def size(self) -> int:
        return self.fleet.size

    @size.setter
    def size(self, size: int) -> None:
        self.fleet.size = size

    @property
    def timeout(self) -> float:
        return self.fleet.timeout

    @timeout.setter
    def timeout(self, timeout: float) -> None:
        self.fleet.timeout = timeout

    def __len__(self) -> int:
        return len(self.fleet)

    def waiting(self) -> list[Any]:
        return self.fleet.waiting()

    @property
    def rates(self) -> Rates:
        """What the legs measured (the fleet's drain rate while Redis answers)."""
        return self.fleet.local.rates

    def predict(self, ticket: Claim) -> Prediction | None:
        """A new request's first token, as the queue of the moment predicts it."""
        if self.current is self.fleet:
            return self.fleet.predict(ticket)
        return self.fleet.local.predict(ticket)

    def on_entered(self, entered: Callable[[], object]) -> None:
        """``entered()`` is called each time a new request starts to wait, in either queue."""
        self.fleet.entered = entered
        self.alone_queue.entered = entered

    def enter(self, ticket: Claim, place: Callable[[], H | Pool]) -> H | Deferred[H]:
        """Slots for a new request, from the queue of the moment."""
        waiting = self.fleet.new(ticket, place)
        got = self.current.arrive(waiting)
        return waiting.deferred if got is None else got

    def pump(self) -> None:
        """Slots may have freed: the current queue lets its first requests go (not while a
        placement the fleet did not grant gives its slots back: that frees none)."""
        if self.fleet.quiet:
            return
        self.current.pump()

    @property
    def _waiting(self) -> int:
        """(What the fleet's queue said waits over every replica, last: for tests.)"""
        return self.fleet.asks.waiting

    def shut(self, error: Callable[[], ProxyError]) -> None:
        self.fleet.shut(error)

    def withdraw(self, deferred: Deferred[H]) -> bool:
        """The request waiting on ``deferred`` leaves whichever queue holds it, nothing fired."""
        return self.fleet.withdraw(deferred) or self.alone_queue.withdraw(deferred)

    # -- Replicas' holder -------------------------------------------------------------

    def held(self) -> tuple[list[str], list[str]]:
        """(Its requests' places are not written back: they wait here instead.)"""
        return [], []

    def shared(self, view: dict[str, int], version: int) -> None:
        """Redis answers: new requests ask the fleet, and its first requests are tried."""
        self.current = self.fleet
        self.pump()

    def restored(self) -> None:
        """Redis answers again and forgot this replica's places in its queue: they wait in
        this replica's own until they join the fleet's again (at the next pump), and new
        requests ask the fleet (before any part says slots freed: placed alone from then
        on, a request's slots would be counted nowhere)."""
        self.alone()
        self.current = self.fleet

    def alone(self) -> None:
        """Redis stopped answering (or the replicas stopped): what waited in the fleet's
        queue waits in this replica's own, and so do new requests."""
        self.current = self.alone_queue
        self.rates.fleet(None)  # (this replica's own releases say how fast it drains)
        for waiting in self.fleet.alone():
            self.alone_queue.take(waiting)

    def _freed(self, changed: dict[str, int], version: int | None) -> None:
        """A slot freed somewhere, or a request left or went: whoever is first may go."""
        self.fleet.freed()
        self.pump()
