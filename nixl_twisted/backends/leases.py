"""What a leg gets from its pool: a ``Lease`` on an instance, or why there is none.

A leg holds its instance through a ``Lease``, the one way legs take and
give back an instance (``BackendPool.lease``): however the leg ends, the
instance is given back exactly once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from nixl_twisted.backends.capacity import Caps
from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.policies import Chosen


class Leasing(Protocol):
    """The pool a lease is of (``BackendPool``)."""

    role: str
    policies: Chosen
    #: Its instances' caps (``--replicas-redis`` leases a capped instance's slot).
    caps: Caps

    def released(self, instance: Instance) -> None:
        """A leg on ``instance`` ended."""


class NoHealthyInstance(Exception):
    """Every instance of a pool is draining or was already tried for this leg."""

    def __init__(self, role: str, retry_after: float, model: str | None = None) -> None:
        #: What the client is told: the pool, and the model when the request named one.
        self.what = f"{role} instance" + (f" serving {model!r}" if model is not None else "")
        super().__init__(f"no healthy {self.what}")
        self.role = role
        self.retry_after = retry_after


class NoRoom(NoHealthyInstance):
    """Every instance that could take the leg is at its cap (or cooling after a 503)."""


class Lease:
    """One leg's hold on an instance; released exactly once, however the leg ends."""

    def __init__(self, pool: Leasing, instance: Instance, decision: str = "next") -> None:
        self.pool = pool
        self.instance = instance
        #: Why the pool's policy chose this instance.
        self.decision = decision
        self.held = True
        #: What else ends with the leg (its trace span).
        self.on_release: Callable[[], object] | None = None
        #: Ends with the leg too: its slot in ``--replicas-redis`` given back.
        self._also: list[Callable[[], object]] = []

    def also(self, then: Callable[[], object]) -> None:
        """``then()`` when the lease is released, before its pool is told room came."""
        self._also.append(then)

    def release(self, result: object = None) -> object:
        """Give the instance back (usable as a callback: passes ``result`` on)."""
        if self.held:
            self.held = False
            # (Its slot in Redis goes back before the pool says room came: a request that
            # then tries to take it is sent after, on the same connection.)
            for then in self._also:
                then()
            self.pool.released(self.instance)
            if self.on_release is not None:
                self.on_release()
        return result
