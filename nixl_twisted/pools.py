"""The backend pools: which prefill and decode instance serves the next leg.

Each pool hands out its instances round-robin (as the seed does), skipping
instances marked down. An instance is marked down by a failed leg (passive)
or a failed ``GET /health`` (active, ``nixl_twisted.backends``), stays out
of rotation for a backoff that doubles with each consecutive failure, and is
back as soon as a health check or a leg succeeds. A leg holds its instance
through a ``Lease``, the one way legs take and give back an instance.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from nixl_twisted.settings import backend_url

log = Logger()

BACKOFF_BASE = 1.0
BACKOFF_MAX = 30.0


class NoHealthyInstance(Exception):
    """Every instance of a pool is marked down (or already tried)."""

    def __init__(self, role: str, retry_after: float) -> None:
        super().__init__(f"no healthy {role} instance")
        self.role = role
        self.retry_after = retry_after


@dataclass(eq=False)
class Instance:
    """One vLLM instance and what the proxy knows of its health."""

    url: str
    role: str
    healthy: bool = True
    failures: int = 0
    retry_at: float = 0.0
    last_error: str | None = None
    #: Legs being served by this instance now.
    in_flight: int = 0
    #: No new legs; the instance leaves its pool when its last leg ends.
    draining: bool = False

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "healthy": self.healthy,
            "draining": self.draining,
            "in_flight": self.in_flight,
            "last_error": self.last_error,
        }


class PoolChangeRefused(ValueError):
    """A change that would leave a pool with no instance to send legs to."""


class BackendPool:
    """Instances of one role, handed out round-robin among those not down."""

    def __init__(self, role: str, urls: Sequence[str], clock: IReactorTime) -> None:
        if not urls:
            raise ValueError(f"the {role} pool needs at least one instance")
        self.role = role
        self.instances = [Instance(backend_url(u), role) for u in urls]
        self._cursor = 0
        self.clock = clock

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(i.url for i in self.instances)

    def __len__(self) -> int:
        return len(self.instances)

    def _now(self) -> float:
        return self.clock.seconds()

    def available(self, instance: Instance) -> bool:
        """Not draining, and healthy or down but past its backoff (worth one more try)."""
        if instance.draining:
            return False
        return instance.healthy or self._now() >= instance.retry_at

    def has_available(self) -> bool:
        """Some instance could take a leg now (checked on every request)."""
        return any(self.available(instance) for instance in self.instances)

    def next(self, exclude: Collection[Instance] = ()) -> Instance:
        """The instance for the next leg of this role.

        Raises ``NoHealthyInstance`` at once when none is available, rather
        than sending a leg to a host known to be dead.
        """
        for _ in range(len(self.instances)):
            instance = self.instances[self._cursor % len(self.instances)]
            # (A pool is never empty: changes that would empty it are refused.)
            self._cursor += 1
            if instance not in exclude and self.available(instance):
                return instance
        raise NoHealthyInstance(self.role, self.retry_after())

    # -- legs in flight, and live changes ----------------------------------

    def lease(self, instance: Instance) -> Lease:
        """Hold ``instance`` for one leg, until the lease is released."""
        instance.in_flight += 1
        return Lease(self, instance)

    def _released(self, instance: Instance) -> None:
        """A leg ended; a draining instance with none left leaves the pool."""
        instance.in_flight -= 1
        if instance.draining and instance.in_flight == 0 and instance in self.instances:
            self.instances.remove(instance)
            log.info("{role} instance {url} drained and removed", role=self.role, url=instance.url)

    def find(self, url: str) -> Instance | None:
        url = backend_url(url)
        return next((i for i in self.instances if i.url == url), None)

    def add(self, url: str) -> Instance:
        """Put an instance in rotation (a draining one is taken back)."""
        instance = self.find(url)
        if instance is None:
            instance = Instance(backend_url(url), self.role)
            self.instances.append(instance)
            log.info("{role} instance {url} added", role=self.role, url=instance.url)
        instance.draining = False
        return instance

    def _refuse_emptying(self, leaving: Instance) -> None:
        if not any(i is not leaving and not i.draining for i in self.instances):
            raise PoolChangeRefused(
                f"{leaving.url} is the last {self.role} instance in rotation; "
                "add another before taking it out"
            )

    def drain(self, url: str) -> Instance | None:
        """No new legs for an instance; it leaves when its last leg ends."""
        instance = self.find(url)
        if instance is None:
            return None
        self._refuse_emptying(instance)
        instance.draining = True
        log.info("{role} instance {url} draining", role=self.role, url=instance.url)
        if instance.in_flight == 0:
            self.instances.remove(instance)
        return instance

    def remove(self, url: str) -> Instance | None:
        """Take an instance out now; legs it is serving finish undisturbed."""
        instance = self.find(url)
        if instance is None:
            return None
        self._refuse_emptying(instance)
        instance.draining = True
        self.instances.remove(instance)
        log.info("{role} instance {url} removed", role=self.role, url=instance.url)
        return instance

    def update(self, urls: Sequence[str]) -> None:
        """Make the pool these URLs: add the new, drain those no longer listed."""
        if not urls:
            raise PoolChangeRefused(f"the {self.role} pool needs at least one instance")
        wanted = [backend_url(u) for u in urls]
        for url in wanted:
            self.add(url)
        for instance in list(self.instances):
            if instance.url not in wanted:
                instance.draining = True
                if instance.in_flight == 0:
                    self.instances.remove(instance)

    def retry_after(self) -> float:
        """Seconds until the first down instance may be tried again."""
        now = self._now()
        waits = [max(0.0, i.retry_at - now) for i in self.instances if not i.healthy]
        return min(waits) if waits else BACKOFF_BASE

    def mark_failed(self, instance: Instance, reason: str) -> None:
        """Take an instance out of rotation for a backoff that doubles."""
        instance.failures += 1
        backoff = min(BACKOFF_MAX, BACKOFF_BASE * 2 ** (instance.failures - 1))
        instance.retry_at = self._now() + backoff
        instance.last_error = reason
        if instance.healthy:
            log.warn(
                "{role} instance {url} marked down: {reason}",
                role=self.role,
                url=instance.url,
                reason=reason,
            )
        instance.healthy = False

    def mark_ok(self, instance: Instance) -> None:
        """Put an instance (back) in rotation."""
        if not instance.healthy:
            log.info("{role} instance {url} is back", role=self.role, url=instance.url)
        instance.healthy = True
        instance.failures = 0
        instance.retry_at = 0.0
        instance.last_error = None


class Lease:
    """One leg's hold on an instance; released exactly once, however the leg ends."""

    def __init__(self, pool: BackendPool, instance: Instance) -> None:
        self.pool = pool
        self.instance = instance
        self.held = True

    def release(self, result: object = None) -> object:
        """Give the instance back (usable as a callback: passes ``result`` on)."""
        if self.held:
            self.held = False
            self.pool._released(self.instance)
        return result
