"""``FleetPlaces``: this replica's requests waiting in the fleet's queue, each at its place.

Kept per model in the fleet's order (priority, finish tag, arrival), so
that the first of each is the one to try. A request waits until its turn,
its timeout (a ready one has none), its latest start (``deadlines``), its
client leaving, or until it is pushed out of the full queue for a newcomer
the order lets go sooner: told by a message, or, that lost, by Redis when
asked after its place, gone from Redis's records at a heartbeat
(``reconcile``). Each ends once: its timers stopped, and its place given
up (``LEAVE``) unless Redis took it out already (granted, or pushed out as
``PLACE`` said) or it moves to this replica's own queue while Redis does
not answer (``alone``). A place Redis records for this replica and it does
not hold (forged by a writer to Redis, or left by a call it gave up on) is
given up too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Generic

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IReactorTime

from nixl_twisted.admission.deadlines import fleet_prediction, fleet_too_late, latest_start
from nixl_twisted.admission.fair_queue import FairQueue
from nixl_twisted.admission.fleet_asks import FleetAsks
from nixl_twisted.admission.outcomes import (
    PUSHED_OUT,
    SHUT,
    TIMED_OUT,
    TTFT_REFUSED,
    QueueOutcome,
    QueueReport,
    pushed_out,
    timed_out,
)
from nixl_twisted.admission.waiting import READY_SUFFIX, H, Pool, Waiting, ready_key
from nixl_twisted.fleet.queue_scripts import NO_SLOT, PUSHED, PlaceReply
from nixl_twisted.fleet.replicas import Unshared
from nixl_twisted.protocol.errors import ProxyError


class FleetPlaces(Generic[H]):
    """This replica's requests in the fleet's queue, by model, in the fleet's order."""

    def __init__(
        self, clock: IReactorTime, local: FairQueue[H], told: QueueReport, asks: FleetAsks[H]
    ) -> None:
        """``local``: this replica's own queue, whose size, timeout and rates are the fleet's
        queue's too."""
        self.clock = clock
        self.local = local
        self.told = told
        self.asks = asks
        self._mine: dict[str, list[Waiting[H]]] = {}

    def __len__(self) -> int:
        return sum(len(w) for w in self._mine.values())

    def all(self) -> list[Waiting[H]]:
        return [w for ws in self._mine.values() for w in ws]

    def models(self) -> list[str]:
        """The keys with requests waiting, ready lanes first (their requests are started)."""
        return sorted((m for m, ws in self._mine.items() if ws), key=_ready_first)

    def first(self, model: str) -> Waiting[H] | None:
        """The request of ``model`` (its key) the fleet's order lets go first, of those here."""
        mine = [w for w in self._mine.get(model, []) if not w.done]
        return mine[0] if mine else None

    def put_first(self, model: str, member: str) -> bool:
        """Redis says ``member`` is first: when it is one of this replica's, it goes to the
        front of its own (its tag moved in Redis, given back by a request that left unserved:
        this replica's order had it behind); whether it is."""
        mine = self._mine.get(model, [])
        first = next((w for w in mine if member and w.member == member and not w.done), None)
        if first is None:
            return False
        mine.remove(first)
        if mine and first.finish >= mine[0].finish:  # (so that it sorts first from now on)
            first.finish = math.nextafter(mine[0].finish, -math.inf)
        mine.insert(0, first)
        return True

    def ready_held(self, model: str) -> int:
        """This replica's requests in the fleet's ready lane of ``model`` (its key)."""
        return sum(1 for w in self._mine.get(ready_key(model), ()) if w.member and not w.done)

    def add(self, waiting: Waiting[H]) -> None:
        """It waits in the fleet's queue, until its turn, its timeout or its client leaves."""
        if not waiting.ticket.is_ready:  # (a ready request is never timed out)
            left = self.local.timeout - (self.clock.seconds() - waiting.arrived)
            waiting.timer = self.clock.callLater(max(0.0, left), self._expire, waiting)
        self._latest(waiting)
        mine = self._mine.setdefault(waiting.model, [])
        mine.append(waiting)
        mine.sort(key=lambda w: (w.ticket.priority, w.finish, w.order))

    def end(self, waiting: Waiting[H], outcome: QueueOutcome | None, leave: bool = True) -> None:
        """It leaves the fleet's queue, ``outcome`` said of it (None: moved to this
        replica's)."""
        if waiting.done:
            return
        waiting.done = True
        mine = self._mine.get(waiting.model, [])
        if waiting in mine:
            mine.remove(waiting)
        for timer in (waiting.timer, waiting.latest):
            if timer is not None and timer.active():
                timer.cancel()
        if outcome is not None:
            self.told(outcome, self.clock.seconds() - waiting.arrived, waiting.ticket)
        if leave:
            self.asks.leave(waiting)

    def shut(self, error: Callable[[], ProxyError]) -> None:
        """Every request waiting here is refused with ``error()`` (the proxy is stopping)."""
        for waiting in self.all():
            self.end(waiting, SHUT)
            waiting.deferred.errback(error())

    def withdraw(self, deferred: Deferred[H]) -> bool:
        """The request waiting on ``deferred`` leaves the fleet's queue, nothing fired."""
        for waiting in self.all():
            if waiting.deferred is deferred and not waiting.done:
                self.end(waiting, None)
                return True
        return False

    def alone(self) -> list[Waiting[H]]:
        """Redis stopped answering: every request here leaves the fleet's queue (for this
        replica's own), nothing fired and nothing sent."""
        moving = self.all()
        for waiting in moving:
            self.end(waiting, None, leave=False)
            waiting.done = False
        return moving

    def pushed(self, member: str) -> None:
        """A request waiting in the fleet's queue was pushed out of it for a newcomer: when
        it is this replica's, it is refused (``LEAVE`` clears Redis's record of it)."""
        found = [w for w in self.all() if w.member == member]
        for waiting in found:
            self.refuse_pushed(waiting)

    def refuse_pushed(self, waiting: Waiting[H], leave: bool = True) -> None:
        """503 ``queue_full``: it was pushed out (``leave``: ``LEAVE`` clears Redis's record
        that it was, which it keeps until the replica says it heard)."""
        if not waiting.done:
            self.end(waiting, PUSHED_OUT, leave=leave)
            waiting.deferred.errback(pushed_out(self.local.size, self.asks.retry_after()))

    def reconcile(self, waits: list[str]) -> None:
        """What Redis records of this replica's places (``MODEL\\nPRIORITY\\nMEMBER``): each
        held here and gone there is asked after, each there and not held here given up."""
        mine = {
            f"{w.model}\n{w.ticket.priority}\n{w.member}": w
            for ws in self._mine.values()
            for w in ws
            if w.member
        }
        held = set(mine)
        for record in held.difference(waits):
            self._missing(mine[record])
        for record in waits:
            parts = record.split("\n", 2)
            if record in held or len(parts) != 3:
                continue
            model, prio, member = parts
            self.asks.leave_place(model, prio, member)

    def _missing(self, waiting: Waiting[H]) -> None:
        """Its place is gone from Redis's records: asked whether it was pushed out (the
        message that said so lost), so that its client is answered now."""
        if waiting.done:
            return
        ask = self.asks.ask(waiting, waiting.member, Pool.DECODE, NO_SLOT, NO_SLOT, False)

        def said(reply: PlaceReply) -> None:
            self.asks.heard(reply, waiting.model)
            if reply.code == PUSHED:
                self.refuse_pushed(waiting, leave=False)

        self.asks.place(ask, said, lambda failure: failure.trap(Unshared))

    def _expire(self, waiting: Waiting[H]) -> None:
        if waiting.done:
            return
        self.end(waiting, TIMED_OUT)
        waiting.deferred.errback(timed_out(self.local.timeout, self.asks.retry_after()))

    def _latest(self, waiting: Waiting[H]) -> None:
        """Still waiting at its latest start, it is refused (``deadlines``)."""
        prediction = fleet_prediction(self.local.rates, waiting.ticket, self.asks.waiting, True)
        if prediction is not None:
            at = latest_start(waiting.ticket, waiting.arrived, prediction) - self.clock.seconds()
            waiting.latest = self.clock.callLater(max(0.0, at), self._too_late, waiting)

    def _too_late(self, waiting: Waiting[H]) -> None:
        if waiting.done:
            return
        self.end(waiting, TTFT_REFUSED)
        rates, waited = self.local.rates, self.asks.waiting
        waiting.deferred.errback(fleet_too_late(rates, waiting.ticket, waited))


def _ready_first(model: str) -> bool:
    """Ready lanes' keys sort first (``False``)."""
    return not model.endswith(READY_SUFFIX)
