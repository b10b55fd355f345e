"""``SharedSlots``: each instance's cap held over every replica, a slot a lease in Redis.

The scripts decide (``queue_scripts.place`` takes a placement's decode and prefill
slots, or neither); this replica keeps a view of the fleet's legs per
instance (from every answer and every message on the ``freed`` channel)
so that its policies choose among instances with room: an instance's
``slots`` here are its cap less the legs the other replicas hold on it.
Each lease is given back when its leg ends (``Lease.also``); a replica that
dies gives back its own through its heartbeat (``replicas``).

While Redis does not answer, each replica holds an instance to its static
share of the cap: the cap over the replicas last seen alive, one at least.
The cap is the fleet's (``caps``): the lowest any live replica gives the
instance, read at each heartbeat.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

from nixl_twisted.admission.lease_scripts import release
from nixl_twisted.admission.share import replica_share
from nixl_twisted.admission.waiting import READY_SUFFIX
from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.pools import BackendPool, Lease
from nixl_twisted.fleet.caps import CapCheck, FleetCap, held, share_caps
from nixl_twisted.fleet.queue_scripts import NO_SLOT, SlotAsk
from nixl_twisted.fleet.replicas import Replicas, Unshared
from nixl_twisted.observe.replica_metrics import ReplicaMetrics


def field(instance: Instance) -> str:
    """An instance's name in Redis: its pool and URL (``POOL|URL``)."""
    return f"{instance.role}|{instance.url}"


class SharedSlots:
    """The fleet's legs on each capped instance, and the slots this replica holds of them."""

    def __init__(
        self,
        replicas: Replicas,
        pools: Callable[[], Sequence[BackendPool]],
        metrics: ReplicaMetrics,
    ) -> None:
        self.replicas = replicas
        self._pools = pools
        self.metrics = metrics
        #: Each capped instance's legs over every replica, as Redis last said (``POOL|URL``).
        self.view: dict[str, int] = {}
        #: Each model's requests in the fleet's ready lane (by its key in the queue), as the
        #: last answer or message about it said.
        self.ready: dict[str, int] = {}
        #: The version of the slots ``view`` is as of (each change in Redis counts one):
        #: an answer that left Redis before a message this replica already heard is older.
        self.version = 0
        #: The leases this replica holds in Redis: lease id -> ``POOL|URL``.
        self.leases: dict[str, str] = {}
        self._ids = (f"{n:x}" for n in itertools.count(1))
        #: Each instance's caps over the live replicas, as the last heartbeat read them.
        self.fleet_caps: dict[str, FleetCap] = {}
        self._check = CapCheck(metrics)
        #: Whether the fleet's view counts (Redis answers), as this holder was last told.
        self._room: Callable[[str, int, dict[str, int]], tuple[int, int]] = self._alone_room
        replicas.hold(self)
        replicas.on_freed(self._changed)

    # -- what Redis says --------------------------------------------------------------

    def held(self) -> tuple[list[str], list[str]]:
        return [f"{where}|{lease}" for lease, where in self.leases.items()], []

    def shared(self, view: dict[str, int], version: int) -> None:
        """A heartbeat's view is taken as it is, whatever version this replica knows (a
        message on ``freed`` may have been forged by a writer to Redis, its version far
        ahead: the next heartbeat brings this replica back to Redis's own)."""
        self.view, self.version = view, version
        self._room = self._fleet_room
        self.apply()
        self.caps_read()

    def caps_read(self) -> Deferred[None]:
        """This replica's caps written, the fleet's read (``share_caps``): at each heartbeat."""
        mine = {
            field(instance): pool.caps.of(instance)
            for pool in self._pools()
            for instance in pool.instances
        }

        def read(fleet: dict[str, FleetCap]) -> None:
            self.fleet_caps = fleet
            self._check.check(mine, fleet)
            self.apply()

        return share_caps(self.replicas, mine).addCallbacks(read, _unshared)

    def cap_of(self, pool: BackendPool, instance: Instance) -> int:
        """The cap this replica holds ``instance`` to: the fleet's (0: none)."""
        return held(pool.caps.of(instance), self.fleet_caps.get(field(instance)))

    @property
    def is_shared(self) -> bool:
        """Whether the fleet's view counts (Redis answers)."""
        return self._room == self._fleet_room

    def mine(self, where: str) -> int:
        """The legs this replica holds on ``where`` (``POOL|URL``), as Redis granted them."""
        return sum(1 for held in self.leases.values() if held == where)

    def alone(self) -> None:
        self._room = self._alone_room
        self.ready.clear()
        self.apply()

    def restored(self) -> None:
        """Its leases were written back as they are, to a Redis that may have forgotten
        everything (restarted): its versions may start again from nothing; the fleet's
        view counts from now on."""
        self.version = -1
        self._room = self._fleet_room

    def seen(self, view: dict[str, int], version: int) -> None:
        """A script's answer: the fleet's view as of ``version`` (an older one is left)."""
        if version < self.version:
            return
        self.view, self.version = view, version
        self.apply()

    def _changed(self, changed: dict[str, int], version: int | None) -> None:
        slots = {}
        for where, count in changed.items():
            if where.endswith(READY_SUFFIX):
                # (a ready lane's count: not a slot, taken as heard, whatever its version)
                self.ready[where.removesuffix(READY_SUFFIX)] = count
            else:
                slots[where] = count
        if version is None or version <= self.version:
            return  # (a nudge, or older than what this replica knows)
        self.version = version
        for where, legs in slots.items():
            if legs > 0:
                self.view[where] = legs
            else:
                self.view.pop(where, None)
        if slots:
            self.apply()

    def apply(self) -> None:
        """Each capped instance's slots for this replica's policies: its cap less the others'
        legs while shared, its static share while alone; each pool told if room came."""
        mine: dict[str, int] = {}
        for where in self.leases.values():
            mine[where] = mine.get(where, 0) + 1
        fleet = {"prefill": 0, "decode": 0}
        for pool in self._pools():
            roomier = False
            for instance in pool.instances:
                cap = self.cap_of(pool, instance)
                if cap == 0:
                    continue
                where = field(instance)
                instance.fleet_cap = self.fleet_caps.get(where)
                slots, legs = self._room(where, cap, mine)
                fleet[pool.role] = fleet.get(pool.role, 0) + legs
                more = pool.hold_to(instance, slots, cap / self.replicas.count)
                roomier = roomier or more
            if roomier:
                pool.notify_freed()
        for pool_role, legs in fleet.items():
            self.metrics.fleet_slots.labels(pool=pool_role).set(legs)

    def _fleet_room(self, where: str, cap: int, mine: dict[str, int]) -> tuple[int, int]:
        """Shared: the cap less the legs the other replicas hold on it (and the fleet's)."""
        legs = self.view.get(where, 0)
        return max(0, cap - max(0, legs - mine.get(where, 0))), legs

    def _alone_room(self, where: str, cap: int, mine: dict[str, int]) -> tuple[int, int]:
        """Alone: this replica's static share of the cap (the fleet's legs unknown)."""
        return replica_share(cap, self.replicas.count), 0

    # -- a placement's leases ------------------------------------------------------

    def names(self, lease: Lease | None) -> SlotAsk:
        """What ``PLACE`` is told of a lease: its instance, cap and a new lease id (an empty
        name and cap 0 when there is none, or its instance has no cap)."""
        if lease is None:
            return NO_SLOT
        instance = lease.instance
        cap = held(lease.pool.caps.of(instance), self.fleet_caps.get(field(instance)))
        if cap == 0:
            return NO_SLOT
        return SlotAsk(field(instance), cap, next(self._ids))

    def granted(self, lease: Lease, name: SlotAsk) -> None:
        """Redis gave ``lease`` its slot: held until its leg ends."""
        where, _, lease_id = name
        if not where:
            return
        self.leases[lease_id] = where
        self.metrics.slots_held.labels(pool=lease.instance.role).inc()
        lease.also(lambda: self._release(lease_id, lease.instance.role))

    def reconcile(self, recorded: Sequence[str]) -> None:
        """Redis records these leases (``POOL|URL|LEASE``) as this replica's: each it does not
        hold goes back (the queue calls it once every placement it sent is answered)."""
        held = {f"{where}|{lease}" for lease, where in self.leases.items()}
        stray = [entry for entry in recorded if entry not in held]
        if stray:
            release(self.replicas, stray).addErrback(_unshared)

    def _release(self, lease_id: str, role: str) -> None:
        where = self.leases.pop(lease_id, None)
        if where is None:
            return
        self.metrics.slots_held.labels(pool=role).dec()
        # (While Redis does not answer the call fails at once: written back whole, without
        # it, when Redis answers again.)
        sent = release(self.replicas, [f"{where}|{lease_id}"])
        sent.addErrback(_unshared)


def _unshared(failure: Failure) -> Any:
    """Redis did not take it: ``Replicas`` went alone, and restores what is held at return."""
    failure.trap(Unshared)
    return None
