"""``FleetAhead``: the other replicas' requests of a model ahead of decode, as last heard.

Under ``--replicas-redis`` the run-ahead limit is the fleet's (``run_ahead``):
a replica counts its own requests ahead exactly, and the others' from what
Redis told it last. Those holding a prefill slot are the legs the slots'
view (``shared_slots``: every answer and every ``freed`` message) counts on
the prefill instances that serve the model, less this replica's own; those
prefilled are the requests in the model's ready lane (``PlaceReply.ready``,
and the ``freed`` line each change of the lane publishes), less this
replica's own there. Between two answers the count may be stale: a few
requests past the limit at most, or a prefill held back until the next
message. A prefill leg held with its decode slot (a batch's part, a moved
answer's continuation) is not ahead, but Redis does not tell them apart: it
counts as one (the fleet runs less far ahead, never further); so does a
prefill instance's leg of another model.
"""

from __future__ import annotations

from collections.abc import Callable

from nixl_twisted.admission.shared_slots import SharedSlots, field
from nixl_twisted.backends.pools import BackendPool


class FleetAhead:
    """The other replicas' requests of a model ahead (``run_ahead.Others``)."""

    def __init__(
        self, slots: SharedSlots, prefill: BackendPool, ready_held: Callable[[str], int]
    ) -> None:
        """``ready_held(key)``: this replica's requests in the fleet's ready lane of the model
        whose key in the queue is ``key``."""
        self.slots = slots
        self.prefill = prefill
        self.ready_held = ready_held

    def __call__(self, model: str | None) -> int | None:
        """None while Redis is away, or while a prefill instance of the model has no cap
        (its legs are counted nowhere)."""
        slots = self.slots
        if not slots.is_shared:
            return None
        prefilling = 0
        for instance in self.prefill.instances:
            if model is not None and not instance.serves(model):
                continue
            if slots.cap_of(self.prefill, instance) == 0:
                return None
            where = field(instance)
            prefilling += max(0, slots.view.get(where, 0) - slots.mine(where))
        key = model or ""
        ready = max(0, slots.ready.get(key, 0) - self.ready_held(key))
        return prefilling + ready
