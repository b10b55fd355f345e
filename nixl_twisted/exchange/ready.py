"""A prefilled completion's decode slot: the wait between its legs.

With caps, a two-leg completion holds its prefill slot alone while prefill
works (``placing.place_prefill``); once prefill answered (or it fell back to
decode alone) it takes its decode slot here, at once or once the fair
queue's *ready* lane lets it go (``admission``), on the instance named for
it when that one has room, and over the cap once its KV lease on prefill
nears its end (the lease guard).
"""

from __future__ import annotations

from twisted.internet.defer import CancelledError, Deferred

from nixl_twisted.admission import Claim
from nixl_twisted.backends.routing import Routing
from nixl_twisted.exchange.decide import Decision, Mode
from nixl_twisted.exchange.legs import Legs
from nixl_twisted.exchange.phased import Phases
from nixl_twisted.exchange.placing import Placed, Prefilling, place_decode
from nixl_twisted.observe.access import AccessRecord
from nixl_twisted.protocol.completion import Completion
from nixl_twisted.protocol.phases import Phase


async def ready_slot(
    legs: Legs,
    phases: Phases,
    record: AccessRecord,
    routing: Routing,
    c: Completion,
    prefilling: Prefilling,
    decision: Decision,
    handed_at: float,
) -> Placed:
    """Prefilled (or fallen back to decode alone): its decode slot, at once or once the
    fair queue's ready lane lets it go; over the cap once its KV lease nears its end."""
    slots = legs.slots
    assert slots is not None
    clock = legs.clock
    since = clock.seconds()
    named = prefilling.named

    def forced() -> Placed:
        got = place_decode(legs, routing, decision, named, force=True)
        assert isinstance(got, Placed)  # (whatever the caps: never a full pool)
        return got

    try:
        if phases.client_gone:  # (left as prefill answered: its KV is left to its lease)
            raise CancelledError()
        taken = slots.take_decode(
            Claim.of(c),
            lambda: place_decode(legs, routing, decision, named),
            handed_at if decision.mode is Mode.PD else since,
            forced,
        )
        if isinstance(taken, Deferred):
            phases.enter(Phase.QUEUED)
            try:
                taken = await phases.track(taken)
            finally:
                record.ready_wait_seconds = clock.seconds() - since
            phases.enter(Phase.HANDOFF if decision.mode is Mode.PD else Phase.DECODE)
    finally:
        prefilling.release()  # (its place ahead of decode, whatever came of it)
    if decision.mode is Mode.PD:
        record.kv_lease_left_seconds = handed_at + slots.kv_lease - clock.seconds()
    return taken
