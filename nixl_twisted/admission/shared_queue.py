"""``SharedQueue``: one fair queue for every replica, its order and its slots kept in Redis.

The order is ``fair_queue``'s (priority, then weighted fair queueing between
tenants by one virtual clock per model, then first come, first served), kept
in ``--replicas-redis`` for the fleet, so that the replica with a free slot
lets go the request the fleet's order puts first, whichever replica holds it:
the replica whose request is first tries it (``queue_scripts.place``) when a slot
frees anywhere (a message on the ``freed`` channel), when one of its own legs
ends, and every second. A request goes at once only when nothing of its model
waits anywhere and both its slots are free in Redis (taken by the same script,
or neither). Its instances are chosen here, by the pools' policies, among
those the fleet's view says have room (``shared_slots``). With the fleet's
queue full, its last waiting request is pushed out for a newcomer the order
lets go sooner (``queue_scripts.PLACE``): the replica that holds it answers it
503 ``queue_full``, told by a message, or, that lost, by Redis when it asks
at its next heartbeat (its place gone from Redis's records).

At each heartbeat, this replica gives back each place in the fleet's queue
and each lease that Redis records it holding and it does not hold (forged by
a writer to Redis, or left by a call it gave up on), once every placement
it has sent is answered (one just granted or queued is held here only then).

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
from twisted.logger import Logger
from twisted.python.failure import Failure

from nixl_twisted.admission.deadlines import (
    fleet_prediction,
    fleet_refusal,
    fleet_too_late,
    latest_start,
)
from nixl_twisted.admission.fair_queue import (
    AFTER_WAIT,
    AT_ONCE,
    LEFT,
    PUSHED_OUT,
    QUEUE_FULL,
    SHED,
    SHUT,
    TIMED_OUT,
    TTFT_REFUSED,
    Claim,
    FairQueue,
    Pool,
    QueueOutcome,
    QueueReport,
    drain_seconds,
    full,
    pushed_out,
    shed,
    timed_out,
)
from nixl_twisted.admission.fleet_alone import AloneQueue
from nixl_twisted.admission.predictor import Prediction
from nixl_twisted.admission.shared_slots import SharedSlots
from nixl_twisted.admission.waiting import READY_SUFFIX, H, Waiting, ready_key
from nixl_twisted.fleet.heartbeat import Own
from nixl_twisted.fleet.replicas import Replicas, Unanswered, Unshared
from nixl_twisted.fleet.queue_scripts import (
    GRANTED,
    NO_SLOT,
    NOT_FIRST,
    PUSHED,
    PlaceAsk,
    PlaceCode,
    PlaceReply,
    SlotAsk,
    leave,
    place,
)
from nixl_twisted.fleet.queue_scripts import (
    SHED as SHED_CODE,
)
from nixl_twisted.protocol.errors import ProxyError

log = Logger()

#: The queue's size a ready request is asked under: never full for it.
READY_ROOM = 2**31 - 1

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
        self._mine: dict[str, list[Waiting]] = {}
        self._order = itertools.count()
        self._trying: set[str] = set()
        self._again: set[str] = set()
        #: Models whose first request is another replica's, and since when: not tried again
        #: before a slot frees somewhere (a message) or ``BEHIND`` seconds pass.
        self._behind: dict[str, float] = {}
        #: A placement tried and not granted is giving its slots back: that frees no slot.
        self.quiet = False
        #: What the fleet's queue said last: requests waiting, and the latest grants (ms).
        self._waiting = 0
        self._grants: list[float] = []
        #: Where requests wait while Redis does not answer.
        self.alone_queue = AloneQueue(local, self._keep, lambda: replicas.first.reached)
        #: Its placements sent and not answered yet.
        self._placing = Unanswered()
        replicas.on_records(self._records)
        replicas.on_pushed(self._pushed)

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
        return len(self.local) + sum(len(w) for w in self._mine.values())

    def waiting(self) -> list[Any]:
        return [*self.local.waiting(), *(w for ws in self._mine.values() for w in ws)]

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

    def _enter(self, waiting: Waiting[H]) -> None:
        """``waiting`` asks the fleet for its slots: granted, queued in the fleet's order, or
        refused; alone when Redis does not answer."""
        ticket, answered = waiting.ticket, waiting.deferred
        refusal = fleet_refusal(self.local.rates, ticket, self._waiting)
        if refusal is not None:
            waiting.done = True
            self.told(TTFT_REFUSED, 0.0, ticket)
            answered.errback(refusal)
            return
        got = waiting.place()
        decode, prefill = self._names(got)
        ask = self._ask(waiting, "", got, decode, prefill, ticket.sheddable)

        def said(reply: PlaceReply) -> None:
            code = reply.code
            self._heard(reply, waiting.model)
            if code == GRANTED:
                assert not isinstance(got, str)
                self._granted(got, decode, prefill)
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
                self._pushed(reply.pushed)  # (one of this replica's own: no message needed)
            if waiting.gone:
                self._leave(waiting)
                return
            self._wait(waiting)

        def alone(failure: Failure) -> None:
            if not isinstance(got, str):
                self._release(got)
            if not waiting.gone:
                self.alone_queue.take(waiting)
            failure.trap(Unshared)

        self._place(ask, said, alone)

    def _place(
        self, ask: PlaceAsk, said: Callable[[PlaceReply], None], alone: Callable[[Failure], None]
    ) -> None:
        """``PLACE`` sent, its answer taken in by ``said`` (or ``alone``) before it counts as
        answered."""
        call = self._placing.sent()
        sent = place(self.replicas, ask)
        sent.addCallbacks(said, alone).addErrback(_unexpected)
        sent.addBoth(lambda _: self._placing.answered(call))

    def _records(self, own: Own) -> None:
        """A heartbeat said what Redis records this replica holds: each place in the queue
        and each lease it does not hold goes back, once every placement sent is answered."""

        def reconciled() -> None:
            mine = {
                f"{w.model}\n{w.ticket.priority}\n{w.member}": w
                for ws in self._mine.values()
                for w in ws
                if w.member
            }
            held = set(mine)
            for record in held.difference(own.waits):
                self._missing(mine[record])
            for record in own.waits:
                parts = record.split("\n", 2)
                if record in held or len(parts) != 3:
                    continue
                model, prio, member = parts
                sent = leave(self.replicas, model, prio, member)
                sent.addErrback(lambda f: f.trap(Unshared))
            self.slots.reconcile(own.leases)

        self._placing.after(reconciled)

    def pump(self) -> None:
        """Slots may have freed: this replica's first request of each model is tried (and
        what waited in this replica's own queue joins the fleet's: placed from there, its
        slots would be counted nowhere)."""
        if self.quiet:
            return
        for waiting in self.alone_queue.rejoin():
            self._enter(waiting)
        for model in sorted((m for m, ws in self._mine.items() if ws), key=_ready_first):
            self._try(model)

    def shut(self, error: Callable[[], ProxyError]) -> None:
        """Every request waiting is refused with ``error()`` (the proxy is stopping)."""
        self.local.shut(error)
        for waiting in [w for ws in self._mine.values() for w in ws]:
            self._end(waiting, SHUT)
            waiting.deferred.errback(error())

    def withdraw(self, deferred: Deferred[H]) -> bool:
        """The request waiting on ``deferred`` leaves the fleet's queue, nothing fired."""
        for waiting in [w for ws in self._mine.values() for w in ws]:
            if waiting.deferred is deferred and not waiting.done:
                self._end(waiting, None)
                return True
        return False

    def freed(self) -> None:
        """A slot freed somewhere, or a request left or went: each model may be tried now."""
        self._behind.clear()

    def _release(self, got: H) -> None:
        """A placement tried and not granted gives its slots back, quietly."""
        self.quiet = True
        try:
            got.release()
        finally:
            self.quiet = False

    def alone(self) -> list[Waiting[H]]:
        """Redis stopped answering: what waited in the fleet's queue leaves it (for this
        replica's own), nothing fired."""
        moving = [w for ws in self._mine.values() for w in ws]
        for waiting in moving:
            self._end(waiting, None, leave=False)
            waiting.done = False
        return moving

    def predict(self, ticket: Claim) -> Prediction | None:
        """A new request's first token, the fleet's requests waiting taken as ahead of it."""
        return fleet_prediction(self.local.rates, ticket, self._waiting)

    def retry_after(self) -> float:
        """Seconds the fleet's queue takes to drain at the rate the fleet let requests go
        lately (1 at least, the timeout at most, and the timeout while none went)."""
        grants = self._grants  # (ms, newest first)
        span = (grants[0] - grants[-1]) / 1000 if grants else 0.0
        return drain_seconds(len(grants), span, self._waiting, self.timeout)

    # -- inside -------------------------------------------------------------------------

    def _names(self, got: H | Pool) -> tuple[SlotAsk, SlotAsk]:
        if isinstance(got, str):
            return SlotAsk("", 0, ""), SlotAsk("", 0, "")
        return self.slots.names(got.decode), self.slots.names(got.prefill)

    def _ask(
        self,
        waiting: Waiting[H],
        member: str,
        got: H | Pool,
        decode: SlotAsk,
        prefill: SlotAsk,
        sheddable: bool,
    ) -> PlaceAsk:
        """What ``PLACE`` is told of ``waiting``: the request (``member``: its place, "" when
        new), the queue's size and its slots (or the pool this replica sees full, ``got``)."""
        ticket = waiting.ticket
        return PlaceAsk(
            model=waiting.model,
            priority=ticket.priority,
            member=member,
            tenant=ticket.tenant or "",
            weight=ticket.weight,
            sheddable=sheddable,
            queue_size=READY_ROOM if ticket.is_ready else self.local.size,
            order=waiting.order,
            blocked=str(got) if isinstance(got, str) else "",
            decode=decode,
            prefill=prefill,
        )

    def _granted(self, got: H, decode: SlotAsk, prefill: SlotAsk) -> None:
        if got.decode is not None:
            self.slots.granted(got.decode, decode)
        if got.prefill is not None:
            self.slots.granted(got.prefill, prefill)

    def ready_held(self, model: str) -> int:
        """This replica's requests in the fleet's ready lane of ``model`` (its key)."""
        return sum(1 for w in self._mine.get(ready_key(model), ()) if w.member and not w.done)

    def _heard(self, reply: PlaceReply, model: str) -> None:
        self.slots.seen(reply.view, reply.version)
        self.slots.ready[model.removesuffix(READY_SUFFIX)] = reply.ready
        self._waiting = reply.waiting
        self._grants = reply.grants
        self.local.rates.fleet(reply.grants)
        self.slots.metrics.fleet_waiting.set(self._waiting)

    def _wait(self, waiting: Waiting[H]) -> None:
        """It waits in the fleet's queue, until its turn, its timeout or its client leaves."""
        if not waiting.ticket.is_ready:  # (a ready request is never timed out)
            left = self.timeout - (self.clock.seconds() - waiting.arrived)
            waiting.timer = self.clock.callLater(max(0.0, left), self._expire, waiting)
        self._latest(waiting)
        model = waiting.model
        mine = self._mine.setdefault(model, [])
        mine.append(waiting)
        mine.sort(key=lambda w: (w.ticket.priority, w.finish, w.order))
        self.entered()
        self._try(model)  # (a slot may have freed meanwhile)

    def _keep(self, got: H) -> None:
        """A placement made alone, kept as leases (written back when Redis answers)."""
        decode, prefill = self._names(got)
        self._granted(got, decode, prefill)

    def _try(self, model: str) -> None:
        if model in self._trying:
            self._again.add(model)
            return
        mine = [w for w in self._mine.get(model, []) if not w.done]
        behind = self._behind.get(model)
        if not mine or (behind is not None and self.clock.seconds() - behind < BEHIND):
            return
        waiting = mine[0]
        got = waiting.place()
        if isinstance(got, str):
            waiting.blocked = got
            return  # (full as this replica sees the fleet: a message will say when not)
        decode, prefill = self._names(got)
        ask = self._ask(waiting, waiting.member, got, decode, prefill, False)
        self._trying.add(model)

        def said(reply: PlaceReply) -> None:
            self._trying.discard(model)
            self._heard(reply, model)
            code = reply.code
            if code == GRANTED:
                self._granted(got, decode, prefill)
                if waiting.done:
                    got.release()  # (it left meanwhile: its slots go back)
                else:
                    self._end(waiting, AFTER_WAIT, leave=False)
                    waiting.deferred.callback(got)
                self._again.add(model)
            elif code == PUSHED:  # (the message that said so was lost)
                self._release(got)
                self._refuse_pushed(waiting, leave=False)
            else:
                self._release(got)
                waiting.blocked = reply.blocked
                if code == NOT_FIRST:
                    self._behind[model] = self.clock.seconds()
            if model in self._again:
                self._again.discard(model)
                self._try(model)

        def alone(failure: Failure) -> None:
            self._trying.discard(model)
            self._release(got)
            failure.trap(Unshared)

        self._place(ask, said, alone)

    def _end(self, waiting: Waiting[H], outcome: QueueOutcome | None, leave: bool = True) -> None:
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
            self._leave(waiting)

    def _leave(self, waiting: Waiting[H]) -> None:
        if not waiting.member:
            return
        # (While Redis does not answer the call fails at once: written back without it.)
        sent = leave(self.replicas, waiting.model, waiting.ticket.priority, waiting.member)
        sent.addErrback(lambda f: f.trap(Unshared))

    def _missing(self, waiting: Waiting[H]) -> None:
        """Its place is gone from Redis's records: asked whether it was pushed out (the
        message that said so lost), so that its client is answered now."""
        if waiting.done:
            return
        ask = self._ask(waiting, waiting.member, Pool.DECODE, NO_SLOT, NO_SLOT, False)

        def said(reply: PlaceReply) -> None:
            self._heard(reply, waiting.model)
            if reply.code == PUSHED:
                self._refuse_pushed(waiting, leave=False)

        self._place(ask, said, lambda failure: failure.trap(Unshared))

    def _pushed(self, member: str) -> None:
        """A request waiting in the fleet's queue was pushed out of it for a newcomer: when
        it is this replica's, it is refused (``LEAVE`` clears Redis's record of it)."""
        found = [w for ws in self._mine.values() for w in ws if w.member == member]
        for waiting in found:
            self._refuse_pushed(waiting)

    def _refuse_pushed(self, waiting: Waiting[H], leave: bool = True) -> None:
        """503 ``queue_full``: it was pushed out (``leave``: ``LEAVE`` clears Redis's record
        that it was, which it keeps until the replica says it heard)."""
        if not waiting.done:
            self._end(waiting, PUSHED_OUT, leave=leave)
            waiting.deferred.errback(pushed_out(self.size, self.retry_after()))

    def _expire(self, waiting: Waiting[H]) -> None:
        if waiting.done:
            return
        self._end(waiting, TIMED_OUT)
        waiting.deferred.errback(timed_out(self.timeout, self.retry_after()))

    def _latest(self, waiting: Waiting[H]) -> None:
        """Still waiting at its latest start, it is refused (``deadlines``)."""
        prediction = fleet_prediction(self.local.rates, waiting.ticket, self._waiting, True)
        if prediction is not None:
            at = latest_start(waiting.ticket, waiting.arrived, prediction) - self.clock.seconds()
            waiting.latest = self.clock.callLater(max(0.0, at), self._too_late, waiting)

    def _too_late(self, waiting: Waiting[H]) -> None:
        if waiting.done:
            return
        self._end(waiting, TTFT_REFUSED)
        waiting.deferred.errback(fleet_too_late(self.local.rates, waiting.ticket, self._waiting))

    def _left(self, waiting: Waiting[H]) -> None:
        """Its client left: out of the queue, nothing sent for it (slots Redis gives it
        meanwhile go back)."""
        waiting.gone = True
        if waiting.inner is not None and not waiting.inner.called:
            waiting.inner.cancel()
        elif waiting.member and not waiting.done:
            self._end(waiting, LEFT)
        elif not waiting.done:
            self.told(LEFT, self.clock.seconds() - waiting.arrived, waiting.ticket)


def _ready_first(model: str) -> bool:
    """Ready lanes' keys sort first (``False``)."""
    return not model.endswith(READY_SUFFIX)


def _unexpected(failure: Failure) -> None:
    """(Redis's answers are read before these run: what fails here is the proxy's own.)"""
    log.failure("fleet queue: a placement's answer could not be handled", failure)
