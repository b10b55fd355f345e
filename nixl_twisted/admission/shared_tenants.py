"""``SharedTenants``: a tenant's requests in flight counted over every replica.

``--tenant-max-in-flight`` (and a tenant's own ``max-in-flight``) holds for
the whole proxy while ``--replicas-redis`` answers: a request takes one of
its tenant's places in Redis (``lease_scripts.tenant_in``) as it is admitted and
gives it back when it ends; a replica that dies gives back its own with its
heartbeat, and at each heartbeat gives back each place Redis records it
holding and it does not hold (once every place it asked for is answered).
While Redis does not answer, each replica holds the tenant to its
share of the limit (the limit over the replicas last seen, one at least).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

from nixl_twisted.admission.lease_scripts import tenant_in, tenant_out
from nixl_twisted.admission.share import replica_share
from nixl_twisted.fleet.heartbeat import Own
from nixl_twisted.fleet.replicas import Replicas, Unanswered, Unshared


@dataclass(frozen=True)
class Place:
    """A request's place among its tenant's requests in flight over every replica."""

    id: str


@dataclass(frozen=True)
class PlaceRefused:
    """Past the tenant's limit over every replica."""


@dataclass(frozen=True)
class Alone:
    """Redis could not say: this replica holds the tenant to its share."""


REFUSED = PlaceRefused()
ALONE = Alone()


class SharedTenants:
    """Each tenant's requests in flight over every replica; the places this one holds."""

    def __init__(self, replicas: Replicas) -> None:
        self.replicas = replicas
        #: The places this replica holds, and whose.
        self.places: dict[Place, str] = {}
        self._ids = (f"{n:x}" for n in itertools.count(1))
        #: Places asked for and not answered yet.
        self._asking = Unanswered()
        replicas.hold(self)

    def held(self) -> tuple[list[str], list[str]]:
        return [], [f"{tenant}|{place.id}" for place, tenant in self.places.items()]

    def shared(self, view: dict[str, int], version: int) -> None:
        """(Nothing to read: a tenant's count is read when one of its requests comes.)"""

    def alone(self) -> None:
        """(Each request is held to the share while alone: nothing to do now.)"""

    def restored(self) -> None:
        """(Its places were written back as they are.)"""

    def check(self, tenant: str, limit: int) -> None:
        """(Its limit is held over every replica: asked in ``admit``.)"""

    def share(self, limit: int) -> int:
        """This replica's share of a tenant's ``limit`` while Redis does not answer."""
        return replica_share(limit, self.replicas.count)

    def admit(self, tenant: str, limit: int) -> Deferred[Place | PlaceRefused | Alone]:
        """One more request of ``tenant`` in flight: its place, refused past ``limit`` over
        every replica, or alone when Redis could not say (at once while it does not answer:
        ``Replicas.call`` fails with ``Unshared`` then)."""
        place = Place(next(self._ids))
        call = self._asking.sent()
        sent = tenant_in(self.replicas, tenant, limit, place.id)
        # Its own Deferred: a client that leaves cancels it, not Redis's answer, so that a
        # place Redis grants after it left is given back instead of held for nobody.
        answered: Deferred[Place | PlaceRefused | Alone] = Deferred()

        def said(granted: bool) -> None:
            if granted:
                self.places[place] = tenant
            if answered.called:  # (its client left while Redis was asked)
                if granted:
                    self.release(place)
                return
            answered.callback(place if granted else REFUSED)

        def failed(failure: Failure) -> None:
            if answered.called:
                return
            if failure.check(Unshared):
                answered.callback(ALONE)
            else:
                answered.errback(failure)

        sent.addCallbacks(said, failed).addBoth(lambda _: self._asking.answered(call))
        return answered

    def records(self, own: Own) -> None:
        """A heartbeat said which places Redis records this replica holding (``TENANT|ID``):
        each it does not hold goes back, once every place asked for is answered."""

        def reconciled() -> None:
            held = {f"{tenant}|{place.id}" for place, tenant in self.places.items()}
            for record in own.tenants:
                tenant, bar, place = record.rpartition("|")
                if record not in held and bar:
                    sent = tenant_out(self.replicas, tenant, place)
                    sent.addErrback(lambda failure: failure.trap(Unshared))

        self._asking.after(reconciled)

    def release(self, place: Place) -> None:
        """That request ended: its place goes back (once)."""
        tenant = self.places.pop(place, None)
        if tenant is None:
            return
        # (While Redis does not answer the call fails at once: written back without it.)
        sent = tenant_out(self.replicas, tenant, place.id)
        sent.addErrback(lambda failure: failure.trap(Unshared))
