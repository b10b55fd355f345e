"""``TenantPlaces``: where a tenant's requests in flight are held to their limit.

Two stores, one interface: this process's (``LocalTenants``: ``TenantLimits``
counts them, a 429 at once past the limit) or every replica's through
``--replicas-redis`` (``shared_tenants``), chosen once at the composition
root. ``Tenancy`` never asks which it holds: the local one answers at once
(never a Deferred), so that its refusal is a 429 in the same turn.
"""

from __future__ import annotations

from typing import Protocol

from twisted.internet.defer import Deferred

from nixl_twisted.admission.limits import TenantLimits
from nixl_twisted.admission.shared_tenants import Alone, Place, PlaceRefused
from nixl_twisted.config.words import counted

#: A request's place held here: nothing to give back besides its ``TenantHold``.
HERE = Place("")


class TenantPlaces(Protocol):
    """Each tenant's requests in flight, held to its limit."""

    def check(self, tenant: str, limit: int) -> None:
        """Raises the 429 of ``tenant`` at once when the limit is held here and reached."""

    def admit(
        self, tenant: str, limit: int
    ) -> Place | PlaceRefused | Alone | Deferred[Place | PlaceRefused | Alone]:
        """One more request of ``tenant`` in flight: its place, refused, or alone (Redis
        could not say: the replica's share holds)."""

    def share(self, limit: int) -> int:
        """The part of ``limit`` held here when alone."""

    def release(self, place: Place) -> None:
        """That request ended: its place goes back."""


class LocalTenants:
    """A tenant's requests in flight in this process, counted by ``TenantLimits``."""

    def __init__(self, limits: TenantLimits) -> None:
        self.limits = limits

    def check(self, tenant: str, limit: int) -> None:
        if limit and self.limits.in_flight(tenant) >= limit:
            raise self.limits.refused(tenant, f"{counted(limit, 'request')} in flight", 1.0)

    def admit(self, tenant: str, limit: int) -> Place:
        """(Held to its limit by ``check``, counted by its ``TenantHold``.)"""
        return HERE

    def share(self, limit: int) -> int:
        return limit

    def release(self, place: Place) -> None:
        """(Its ``TenantHold`` gives it back.)"""
