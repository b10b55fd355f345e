"""``FleetAsks``: what the fleet's queue asks Redis, and what it takes from the answers.

A request is put to ``PLACE`` as a ``PlaceAsk``: its place, the queue's
size (one that never refuses a prefilled request, ``READY_ROOM``) and its
slots by name (``shared_slots``). Each answer tells this replica the
fleet's slots and ready lanes, for its policies, and the requests waiting
over every replica and the latest grants, from which the first-token
predictions and ``Retry-After`` are worked out (``heard``). A placement
counts as answered only once its answer is taken in (``after``): until
then Redis may record for this replica what it does not hold yet. A place
given up is ``LEAVE``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic

from twisted.logger import Logger
from twisted.python.failure import Failure

from nixl_twisted.admission.fair_queue import FairQueue
from nixl_twisted.admission.model_lanes import READY_DUE
from nixl_twisted.admission.outcomes import drain_seconds
from nixl_twisted.admission.shared_slots import SharedSlots
from nixl_twisted.admission.waiting import READY_SUFFIX, H, Pool, Waiting
from nixl_twisted.fleet.queue_scripts import PlaceAsk, PlaceReply, SlotAsk, leave, place
from nixl_twisted.fleet.replicas import Replicas, Unanswered, Unshared

log = Logger()

#: The queue's size a ready request is asked under: never full for it.
READY_ROOM = 2**31 - 1


class FleetAsks(Generic[H]):
    """The fleet's queue's calls to Redis, and what the fleet's queue said last."""

    def __init__(self, local: FairQueue[H], replicas: Replicas, slots: SharedSlots) -> None:
        """``local``: this replica's own queue, whose size, timeout and rates are the fleet's
        queue's too."""
        self.local = local
        self.replicas = replicas
        self.slots = slots
        #: What the fleet's queue said last: requests waiting, and the latest grants (ms).
        self.waiting = 0
        self.grants: list[float] = []
        #: Its placements sent and not answered yet.
        self._placing = Unanswered()

    def slots_of(self, got: H | Pool) -> tuple[SlotAsk, SlotAsk]:
        """A placement's decode and prefill slots as ``PLACE`` names them (none: a pool
        this replica sees full)."""
        if isinstance(got, str):
            return SlotAsk("", 0, ""), SlotAsk("", 0, "")
        return self.slots.names(got.decode), self.slots.names(got.prefill)

    def ask(
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
            due=READY_DUE if ticket.target is None else ticket.target.ms / 1000,
        )

    def place(
        self, ask: PlaceAsk, said: Callable[[PlaceReply], None], alone: Callable[[Failure], None]
    ) -> None:
        """``PLACE`` sent, its answer taken in by ``said`` (or ``alone``) before it counts as
        answered."""
        call = self._placing.sent()
        sent = place(self.replicas, ask)
        sent.addCallbacks(said, alone).addErrback(_unexpected)
        sent.addBoth(lambda _: self._placing.answered(call))

    def after(self, then: Callable[[], object]) -> None:
        """``then()`` once every placement sent now is answered."""
        self._placing.after(then)

    def heard(self, reply: PlaceReply, model: str) -> None:
        """What a ``PLACE`` answer says of the fleet, taken in (``model``: the key asked)."""
        self.slots.seen(reply.view, reply.version)
        self.slots.ready[model.removesuffix(READY_SUFFIX)] = reply.ready
        self.waiting = reply.waiting
        self.grants = reply.grants
        self.local.rates.fleet(reply.grants)
        self.slots.metrics.fleet_waiting.set(self.waiting)

    def granted(self, got: H, decode: SlotAsk, prefill: SlotAsk) -> None:
        """The slots Redis granted, held here as leases."""
        if got.decode is not None:
            self.slots.granted(got.decode, decode)
        if got.prefill is not None:
            self.slots.granted(got.prefill, prefill)

    def keep(self, got: H) -> None:
        """A placement made alone, kept as leases (written back when Redis answers)."""
        decode, prefill = self.slots_of(got)
        self.granted(got, decode, prefill)

    def leave(self, waiting: Waiting[H]) -> None:
        """``waiting`` gives up its place in the fleet's queue (none yet: nothing to say)."""
        if waiting.member:
            self.leave_place(waiting.model, waiting.ticket.priority, waiting.member)

    def leave_place(self, model: str, priority: int | str, member: str) -> None:
        """``LEAVE`` sent (while Redis does not answer the call fails at once: written back
        without it)."""
        sent = leave(self.replicas, model, priority, member)
        sent.addErrback(lambda f: f.trap(Unshared))

    def retry_after(self) -> float:
        """Seconds the fleet's queue takes to drain at the rate the fleet let requests go
        lately (1 at least, the timeout at most, and the timeout while none went)."""
        grants = self.grants  # (ms, newest first)
        span = (grants[0] - grants[-1]) / 1000 if grants else 0.0
        return drain_seconds(len(grants), span, self.waiting, self.local.timeout)


def _unexpected(failure: Failure) -> None:
    """(Redis's answers are read before these run: what fails here is the proxy's own.)"""
    log.failure("fleet queue: a placement's answer could not be handled", failure)
