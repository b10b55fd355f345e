"""``ModelLane``: one model's requests of one lane, in their fair order, and its clock.

Each model waits apart (its instances are not another's, so its backlog
must not hold another's), and in two lanes (``Lane``): requests waiting for
their first slot, and prefilled ones waiting for their decode slot. A lane
keeps self-clocked fair queueing (SCFQ): a request is tagged ``max(V, its
tenant's last tag) + 1 / weight``, ``V`` being the tag of the request let go
last, and goes in the order (priority, tag, arrival); a ready lane, earliest
deadline first within a priority.

Tags of different models are on different clocks, so across models (which
request a full queue pushes out, ``last_to_go``) a request stands by how
far its tag is past its own model's clock.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from nixl_twisted.admission.waiting import Claim, Lane, Waiting

#: Seconds a prefilled request with no first-token target is due in, in the ready lane: the
#: KV lease's (``--kv-lease-duration``'s default), so that it is never passed for ever.
READY_DUE = 30.0

#: Tags kept per model while nothing of it waits, before those behind its clock go.
KEPT_TAGS = 64

#: (priority, finish tag, arrival): a request's place in its lane, smallest first.
Key = tuple[int, float, int]
#: Which lane: the model's name and the lane.
LaneName = tuple[str | None, Lane]


@dataclass
class ModelLane:
    """One model's waiting requests of one lane, in order, and its fair-queueing clock."""

    heap: list[tuple[int, float, int, Waiting[Any]]] = field(default_factory=list)
    #: The tag of the request let go last (SCFQ's virtual time).
    now: float = 0.0
    #: Each tenant's last tag, while it is ahead of ``now``.
    last: dict[str | None, float] = field(default_factory=dict)
    #: A request was let go before its tenant's earlier ones (those keep first come, first
    #: served among themselves until the queue is empty).
    reordered: bool = False

    def key(self, ticket: Claim, order: int, at: float = 0.0) -> Key:
        """The place of a request of ``ticket`` arriving ``order``-th: its tag starts where
        its tenant's last ended, or at the clock if that is later. In a ready lane the tag
        is the request's deadline (``at``, the time, plus its first-token target, or plus
        ``READY_DUE`` without one): prefilled requests go earliest deadline first within a
        priority, first come, first served among equals (fairness chose them when they
        took their prefill slot; weighed again here, a lighter tenant's request would wait
        twice for the same share)."""
        if ticket.is_ready:
            due = READY_DUE if ticket.target is None else ticket.target.ms / 1000
            return (ticket.priority, at + due, order)
        start = max(self.now, self.last.get(ticket.tenant, 0.0))
        return (ticket.priority, start + 1.0 / ticket.weight, order)

    def ahead(self, key: Key) -> bool:
        """Whether a request waits ahead of ``key`` (those already gone are dropped)."""
        while self.heap and self.heap[0][-1].done:
            heapq.heappop(self.heap)
        return bool(self.heap) and self.heap[0][:3] < key

    def went_at_once(self, tenant: str | None, finish: float) -> None:
        """A request of ``tenant`` tagged ``finish`` went without waiting: the clock is its
        tag (and, with many tenants seen and none waiting, tags behind the clock go)."""
        self.now = finish
        self.last[tenant] = finish
        if len(self.last) > KEPT_TAGS and not self.heap:
            self.last = {t: f for t, f in self.last.items() if f > self.now}

    def add(self, key: Key, waiting: Waiting[Any]) -> None:
        """``waiting`` waits at ``key``: its tenant's next request is tagged after it."""
        self.last[waiting.ticket.tenant] = key[1]
        heapq.heappush(self.heap, (*key, waiting))

    def went(self, waiting: Waiting[Any]) -> None:
        """``waiting``, just taken off the heap, went: the clock reaches its tag."""
        self.now = max(self.now, waiting.finish)

    def give_back(self, waiting: Waiting[Any]) -> None:
        """``waiting`` leaves unserved (timed out, its client gone, pushed out, refused): its
        tenant is charged nothing for it. The tenant's requests tagged after it move back
        one tag (``1 / weight``), and so does its last tag: else a tenant whose requests
        keep timing out falls ever further behind the clock, and is served less than its
        weight says while the others are served more."""
        if waiting.ticket.is_ready:
            return  # (a ready lane charges no tags: its order is by deadline)
        tenant, finish = waiting.ticket.tenant, waiting.finish
        step = 1.0 / waiting.ticket.weight
        moved = False
        for at, (priority, tag, order, other) in enumerate(self.heap):
            if other.done or other.ticket.tenant != tenant or tag <= finish:
                continue
            self.heap[at] = (priority, tag - step, order, other)
            other.finish = tag - step
            moved = True
        if moved:
            heapq.heapify(self.heap)
        last = self.last.get(tenant)
        if last is not None and last >= finish:
            self.last[tenant] = last - step

    def emptied(self) -> bool:
        """Nothing waits any more: the order within tenants starts afresh and tags behind
        the clock go (as good as none); whether nothing is left to keep."""
        self.reordered = False
        self.last = {t: f for t, f in self.last.items() if f > self.now}
        return not self.last

    def standing(self, key: Key) -> Key:
        """``key`` as it compares with other models' requests: its tag past this clock."""
        return (key[0], key[1] - self.now, key[2])

    def live(self) -> Iterator[Waiting[Any]]:
        """Its requests still waiting, in no order."""
        return (w for *_, w in self.heap if not w.done)


def last_to_go(
    lanes: Mapping[LaneName, ModelLane], newcomer: ModelLane, key: Key
) -> tuple[ModelLane, Waiting[Any]] | None:
    """The waiting request the fair order lets go last, and its lane, when it goes after a
    newcomer at ``key`` of ``newcomer`` (None: the newcomer would go last). Ready lanes are
    left out: a prefilled request never leaves for room (its prefill would be wasted)."""
    last = max(
        (
            (lane.standing((p, f, n)), lane, w)
            for (_, kind), lane in lanes.items()
            if kind is not Lane.READY
            for p, f, n, w in lane.heap
            if not w.done
        ),
        key=lambda item: item[0],
        default=None,
    )
    if last is None or last[0] <= newcomer.standing(key):
        return None
    return last[1], last[2]


def ready_first(name: LaneName) -> bool:
    """Ready lanes sort first (``False``), each model's in the order it came: a decode slot
    that frees goes to a prefilled request before a new one starts."""
    return name[1] is not Lane.READY
