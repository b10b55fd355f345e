"""``SharedQueue``: one fair queue for every replica, its order and its slots kept in Redis.

The order is ``fair_queue``'s (priority, then weighted fair queueing between
tenants by one virtual clock per model, then first come, first served), kept
in ``--replicas-redis`` for the fleet, so that the replica with a free slot
lets go the request the fleet's order puts first, whichever replica holds it:
the replica whose request is first tries it when a slot frees anywhere (a
message on the ``freed`` channel), when one of its own legs ends, and every
second. A request goes at once only when nothing of its model waits anywhere
and both its slots are free in Redis (taken by the same script, or neither).
Its instances are chosen here, by the pools' policies, among those the
fleet's view says have room (``shared_slots``). With the fleet's queue full,
its last waiting request is pushed out for a newcomer the order lets go
sooner (``queue_scripts.PLACE``): the replica that holds it answers it 503
``queue_full``, told by a message, or, that lost, by Redis when it asks at
its next heartbeat (its place gone from Redis's records).

What is asked of Redis and read from its answers is ``fleet_asks``'s; this
replica's own requests waiting in the fleet's queue, their timers and their
places reconciled with Redis's records, ``fleet_places``'s. At each
heartbeat, this replica gives back each place in the fleet's queue and each
lease that Redis records it holding and it does not hold, once every
placement it has sent is answered (one just granted or queued is held here
only then).

A prefilled request waits for its decode slot in its model's ready lane, a
queue of its own in Redis (``waiting.ready_key``: the model's key and a
tab, which no model's key holds), tried first, under a size that never
refuses it and with no timeout.

While Redis does not answer, requests wait in this replica's own queue
(``fleet_alone``), the caps held to their static share; those that waited in
the fleet's move there (``switched_queue`` decides when), and are let go by it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, Generic

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime
from twisted.python.failure import Failure

from nixl_twisted.admission.deadlines import fleet_prediction, fleet_refusal
from nixl_twisted.admission.fair_queue import FairQueue
from nixl_twisted.admission.fleet_alone import AloneQueue
from nixl_twisted.admission.fleet_asks import FleetAsks
from nixl_twisted.admission.fleet_places import FleetPlaces
from nixl_twisted.admission.outcomes import (
    AFTER_WAIT,
    AT_ONCE,
    LEFT,
    QUEUE_FULL,
    SHED,
    TTFT_REFUSED,
    QueueReport,
    full,
    shed,
)
from nixl_twisted.admission.predictor import Prediction
from nixl_twisted.admission.shared_slots import SharedSlots
from nixl_twisted.admission.waiting import Claim, H, Pool, Waiting, ready_key
from nixl_twisted.fleet.heartbeat import Own
from nixl_twisted.fleet.queue_scripts import GRANTED, NOT_FIRST, PUSHED, PlaceCode, PlaceReply
from nixl_twisted.fleet.queue_scripts import (
    SHED as SHED_CODE,
)
from nixl_twisted.fleet.replicas import Replicas, Unshared
from nixl_twisted.protocol.errors import ProxyError

#: Seconds a model whose first request is another replica's waits before trying again,
#: when no message said a slot freed (one may have been lost).
BEHIND = 1.0


class SharedQueue(Generic[H]):
    """Requests waiting for slots in the fleet's order (a placement Redis does not answer
    waits in this replica's own queue instead)."""

    def __init__(
        self,
        clock: IReactorTime,
        local: FairQueue[H],
        replicas: Replicas,
        slots: SharedSlots,
        told: QueueReport,
        named: Callable[[str], bool] = lambda model: True,
    ) -> None:
        """``named(model)``: whether an instance is known to serve ``model`` (else its
        requests wait in the queue of those that name none: ``Waiting.model``)."""
        self.clock = clock
        self.local = local
        self.replicas = replicas
        self.slots = slots
        self.told = told
        self.entered: Callable[[], object] = lambda: None
        self.named = named
        #: Its calls to Redis, and what the fleet's queue said last.
        self.asks: FleetAsks[H] = FleetAsks(local, replicas, slots)
        #: Its own requests waiting in the fleet's queue.
        self.places: FleetPlaces[H] = FleetPlaces(clock, local, told, self.asks)
        self._order = itertools.count()
        self._trying: set[str] = set()
        self._again: set[str] = set()
        #: Models whose first request is another replica's, and since when: not tried again
        #: before a slot frees somewhere (a message) or ``BEHIND`` seconds pass.
        self._behind: dict[str, float] = {}
        #: A placement tried and not granted is giving its slots back: that frees no slot.
        self.quiet = False
        #: Where requests wait while Redis does not answer.
        self.alone_queue = AloneQueue(local, self.asks.keep, lambda: replicas.first.reached)
        replicas.on_records(self._records)
        replicas.on_pushed(self.places.pushed)

    # -- FairQueue's face ---------------------------------------------------------------

    @property
    def size(self) -> int:
        return self.local.size

    @size.setter
    def size(self, size: int) -> None:
        self.local.size = size

    @property
    def timeout(self) -> float:
        return self.local.timeout

    @timeout.setter
    def timeout(self, timeout: float) -> None:
        self.local.timeout = timeout

    def __len__(self) -> int:
        return len(self.local) + len(self.places)

    def waiting(self) -> list[Any]:
        return [*self.local.waiting(), *self.places.all()]

    def new(self, ticket: Claim, place: Callable[[], H | Pool]) -> Waiting[H]:
        """A new request's record, in the order requests came (its model "" when no instance
        is known to serve it); its Deferred, cancelled, takes it out of either queue."""
        answered: Deferred[H] = Deferred(lambda _: self._left(waiting))
        served = ticket.model if ticket.model and "\t" not in ticket.model else ""
        model = served if served and self.named(served) else ""
        model = ready_key(model) if ticket.is_ready else model
        waiting = Waiting(
            ticket, place, self.clock.seconds(), answered, order=next(self._order), model=model
        )
        return waiting

    def arrive(self, waiting: Waiting[H]) -> None:
        """A new request asks the fleet for its slots (``waiting.deferred`` fires)."""
        self._enter(waiting)

    def pump(self) -> None:
        """Slots may have freed: this replica's first request of each model is tried (and
        what waited in this replica's own queue joins the fleet's: placed from there, its
        slots would be counted nowhere)."""
        if self.quiet:
            return
        for waiting in self.alone_queue.rejoin():
            self._enter(waiting)
        for model in self.places.models():
            self._try(model)

    def shut(self, error: Callable[[], ProxyError]) -> None:
        """Every request waiting is refused with ``error()`` (the proxy is stopping)."""
        self.local.shut(error)
        self.places.shut(error)

    def withdraw(self, deferred: Deferred[H]) -> bool:
        """The request waiting on ``deferred`` leaves the fleet's queue, nothing fired."""
        return self.places.withdraw(deferred)

    def freed(self) -> None:
        """A slot freed somewhere, or a request left or went: each model may be tried now."""
        self._behind.clear()

    def alone(self) -> list[Waiting[H]]:
        """Redis stopped answering: what waited in the fleet's queue leaves it (for this
        replica's own), nothing fired."""
        return self.places.alone()

    def predict(self, ticket: Claim) -> Prediction | None:
        """A new request's first token, the fleet's requests waiting taken as ahead of it."""
        return fleet_prediction(self.local.rates, ticket, self.asks.waiting)

    def retry_after(self) -> float:
        """Seconds the fleet's queue takes to drain at the rate the fleet let requests go
        lately (1 at least, the timeout at most, and the timeout while none went)."""
        return self.asks.retry_after()

    def ready_held(self, model: str) -> int:
        """This replica's requests in the fleet's ready lane of ``model`` (its key)."""
        return self.places.ready_held(model)

    # -- inside -------------------------------------------------------------------------

    def _enter(self, waiting: Waiting[H]) -> None:
        """``waiting`` asks the fleet for its slots: granted, queued in the fleet's order, or
        refused; alone when Redis does not answer."""
        ticket, answered = waiting.ticket, waiting.deferred
        refusal = fleet_refusal(self.local.rates, ticket, self.asks.waiting)
        if refusal is not None:
            waiting.done = True
            self.told(TTFT_REFUSED, 0.0, ticket)
            answered.errback(refusal)
            return
        got = waiting.place()
        decode, prefill = self.asks.slots_of(got)
        ask = self.asks.ask(waiting, "", got, decode, prefill, ticket.sheddable)

        def said(reply: PlaceReply) -> None:
            code = reply.code
            self.asks.heard(reply, waiting.model)
            if code == GRANTED:
                assert not isinstance(got, str)
                self.asks.granted(got, decode, prefill)
                if waiting.gone:
                    got.release()  # (its client left meanwhile: the slots go back)
                    return
                waiting.done = True
                self.told(AT_ONCE, 0.0, ticket)
                answered.callback(got)
                return
            if not isinstance(got, str):
                self._release(got)
            if code in (SHED_CODE, PlaceCode.FULL):
                waiting.done = True
                if code == SHED_CODE:
                    outcome, refusal = SHED, shed(ticket, self.retry_after())
                else:
                    outcome, refusal = QUEUE_FULL, full(self.local.size, self.retry_after())
                if not waiting.gone:  # (else counted as left already)
                    self.told(outcome, 0.0, ticket)
                    answered.errback(refusal)
                return
            waiting.member, waiting.finish = reply.member, reply.finish
            waiting.blocked = reply.blocked
            if reply.pushed:
                self.places.pushed(reply.pushed)  # (one of this replica's own: no message)
            if waiting.gone:
                self.asks.leave(waiting)
                return
            self._wait(waiting)

        def alone(failure: Failure) -> None:
            if not isinstance(got, str):
                self._release(got)
            if not waiting.gone:
                self.alone_queue.take(waiting)
            failure.trap(Unshared)

        self.asks.place(ask, said, alone)

    def _wait(self, waiting: Waiting[H]) -> None:
        """It waits in the fleet's queue, until its turn, its timeout or its client leaves."""
        self.places.add(waiting)
        self.entered()
        self._try(waiting.model)  # (a slot may have freed meanwhile)

    def _try(self, model: str) -> None:
        """This replica's first request of ``model`` asks for its slots, when it may be the
        fleet's first (one at a time per model: asked again once answered)."""
        if model in self._trying:
            self._again.add(model)
            return
        waiting = self.places.first(model)
        behind = self._behind.get(model)
        if waiting is None or (behind is not None and self.clock.seconds() - behind < BEHIND):
            return
        got = waiting.place()
        if isinstance(got, str):
            waiting.blocked = got
            return  # (full as this replica sees the fleet: a message will say when not)
        decode, prefill = self.asks.slots_of(got)
        ask = self.asks.ask(waiting, waiting.member, got, decode, prefill, False)
        self._trying.add(model)

        def said(reply: PlaceReply) -> None:
            self._trying.discard(model)
            self.asks.heard(reply, model)
            code = reply.code
            if code == GRANTED:
                self.asks.granted(got, decode, prefill)
                if waiting.done:
                    got.release()  # (it left meanwhile: its slots go back)
                else:
                    self.places.end(waiting, AFTER_WAIT, leave=False)
                    waiting.deferred.callback(got)
                self._again.add(model)
            elif code == PUSHED:  # (the message that said so was lost)
                self._release(got)
                self.places.refuse_pushed(waiting, leave=False)
            else:
                self._release(got)
                waiting.blocked = reply.blocked
                if code == NOT_FIRST and self.places.put_first(model, reply.member):
                    self._again.add(model)  # (Redis named one of its own first: tried at once)
                elif code == NOT_FIRST:
                    self._behind[model] = self.clock.seconds()
            if model in self._again:
                self._again.discard(model)
                self._try(model)

        def alone(failure: Failure) -> None:
            self._trying.discard(model)
            self._release(got)
            failure.trap(Unshared)

        self.asks.place(ask, said, alone)

    def _release(self, got: H) -> None:
        """A placement tried and not granted gives its slots back, quietly."""
        self.quiet = True
        try:
            got.release()
        finally:
            self.quiet = False

    def _records(self, own: Own) -> None:
        """A heartbeat said what Redis records this replica holds: each place in the queue
        and each lease it does not hold goes back, once every placement sent is answered."""

        def reconciled() -> None:
            self.places.reconcile(own.waits)
            self.slots.reconcile(own.leases)

        self.asks.after(reconciled)

    def _left(self, waiting: Waiting[H]) -> None:
        """Its client left: out of the queue, nothing sent for it (slots Redis gives it
        meanwhile go back)."""
        waiting.gone = True
        if waiting.inner is not None and not waiting.inner.called:
            waiting.inner.cancel()
        elif waiting.member and not waiting.done:
            self.places.end(waiting, LEFT)
        elif not waiting.done:
            self.told(LEFT, self.clock.seconds() - waiting.arrived, waiting.ticket)
