"""The backend pools: which prefill and decode instance serves the next leg.

Each pool hands out its instances round-robin (as the seed does), skipping
instances marked down. An instance is marked down by a failed leg (passive)
or a failed ``GET /health`` (active), stays out of rotation for a backoff
that doubles with each consecutive failure, and is back as soon as a health
check or a leg succeeds. ``BackendService`` is the service object the twistd
tree owns: both pools, the health checks, and the one HTTP client.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import urlsplit

from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredList, ensureDeferred
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers

from nixl_twisted.upstream import Upstream, read_body

log = Logger()

DEFAULT_HEALTH_INTERVAL = 5.0
DEFAULT_HEALTH_TIMEOUT = 2.0
BACKOFF_BASE = 1.0
BACKOFF_MAX = 30.0


def _reactor() -> IReactorTime:
    from twisted.internet import reactor

    return cast(IReactorTime, reactor)


class InvalidBackendURL(ValueError):
    """A backend URL that cannot name a vLLM instance."""


class NoHealthyInstance(Exception):
    """Every instance of a pool is marked down (or already tried)."""

    def __init__(self, role: str, retry_after: float) -> None:
        super().__init__(f"no healthy {role} instance")
        self.role = role
        self.retry_after = retry_after


def normalize_backend_url(url: str) -> str:
    """Check a backend base URL and return it without a trailing slash.

    A path prefix is allowed (an instance behind a path-routing ingress);
    query strings, fragments and credentials are not, since every leg
    appends its own path.
    """
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError for a port that is not a number
    except ValueError as error:
        raise InvalidBackendURL(f"{url!r} is not a valid URL: {error}") from None
    if parts.scheme not in ("http", "https"):
        raise InvalidBackendURL(f"{url!r} must start with http:// or https://")
    if not parts.hostname:
        raise InvalidBackendURL(f"{url!r} has no host")
    if parts.query or parts.fragment:
        raise InvalidBackendURL(f"{url!r} must not have a query or a fragment")
    if parts.username is not None or parts.password is not None:
        raise InvalidBackendURL(f"{url!r} must not carry credentials; use --backend-api-key")
    return url.rstrip("/")


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

    def __init__(self, role: str, urls: Sequence[str], clock: IReactorTime | None = None) -> None:
        if not urls:
            raise ValueError(f"the {role} pool needs at least one instance")
        self.role = role
        self.instances = [Instance(normalize_backend_url(u), role) for u in urls]
        self._cursor = 0
        self.clock = clock or _reactor()

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

    def acquire(self, instance: Instance) -> None:
        instance.in_flight += 1

    def release(self, instance: Instance) -> None:
        """A leg ended; a draining instance with none left leaves the pool."""
        instance.in_flight -= 1
        if instance.draining and instance.in_flight == 0 and instance in self.instances:
            self.instances.remove(instance)
            log.info("{role} instance {url} drained and removed", role=self.role, url=instance.url)

    def find(self, url: str) -> Instance | None:
        url = normalize_backend_url(url)
        return next((i for i in self.instances if i.url == url), None)

    def add(self, url: str) -> Instance:
        """Put an instance in rotation (a draining one is taken back)."""
        instance = self.find(url)
        if instance is None:
            instance = Instance(normalize_backend_url(url), self.role)
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
        wanted = [normalize_backend_url(u) for u in urls]
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


class BackendService(Service):
    """The prefill and decode pools, their health checks, and the HTTP client."""

    name = "backends"

    def __init__(
        self,
        prefill: BackendPool,
        decode: BackendPool,
        upstream: Upstream,
        clock: IReactorTime | None = None,
        health_interval: float = DEFAULT_HEALTH_INTERVAL,
        health_timeout: float = DEFAULT_HEALTH_TIMEOUT,
    ) -> None:
        self.prefill = prefill
        self.decode = decode
        self.upstream = upstream
        self.clock = clock or _reactor()
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self._checks: LoopingCall | None = None
        self._probes: set[Deferred[None]] = set()

    def pools(self) -> tuple[BackendPool, BackendPool]:
        return (self.prefill, self.decode)

    def ready(self) -> bool:
        """Both pools have an instance to send a leg to."""
        return all(pool.has_available() for pool in self.pools())

    def startService(self) -> None:
        super().startService()
        if self.health_interval > 0:
            self._checks = LoopingCall(self.check_health)
            self._checks.clock = self.clock
            self._checks.start(self.health_interval, now=False).addErrback(
                lambda failure: log.failure("health checks stopped", failure)
            )

    def check_health(self) -> Deferred[Any]:
        """``GET /health`` on every instance; never fails (the loop must not die)."""
        checks = [
            self._check(pool, instance)
            for pool in self.pools()
            for instance in list(pool.instances)
        ]
        return DeferredList(checks, consumeErrors=True)

    def _check(self, pool: BackendPool, instance: Instance) -> Deferred[None]:
        async def probe() -> None:
            response = await self.upstream.get(instance.url + "/health", Headers())
            await read_body(response)
            if response.code != 200:
                raise RuntimeError(f"GET /health answered HTTP {response.code}")

        checking = ensureDeferred(probe()).addTimeout(self.health_timeout, self.clock)
        self._probes.add(checking)

        def done(result: object) -> object:
            self._probes.discard(checking)
            return result

        def failed(failure: Failure) -> None:
            if not self.running:
                return  # cancelled by stopService
            pool.mark_failed(instance, f"health check failed: {failure.getErrorMessage()}")

        checking.addBoth(done)
        checking.addCallbacks(lambda _: pool.mark_ok(instance), failed)
        checking.addErrback(lambda failure: log.failure("health check error", failure))
        return checking

    def stopService(self) -> Deferred[None]:
        """Stop the health checks and close every pooled backend connection."""
        super().stopService()
        if self._checks is not None and self._checks.running:
            self._checks.stop()
        for probe in list(self._probes):
            probe.cancel()
        return self.upstream.close()
