"""Admission, one step for every route: the tenant held to its limits, a slot of the proxy's
``--max-in-flight`` taken, the request served with its tenant's rule, the slot given back;
and the drain on shutdown.

The steps, in order: ``Tenancy.admit`` (whose it is, 429 past its tenant's limits: in
flight, counted over every replica with ``--replicas-redis``, requests and tokens per
minute, in Redis with ``--limits-redis``), ``admit`` (503 past ``--max-in-flight``, or while
draining), the work (a two-leg completion then waits in the fair queue for its slots:
``slots``), ``release``.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import TypeVar

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.web.server import Request

from nixl_twisted.admission.tenancy import Tenancy
from nixl_twisted.config import NO_RULE, ProxyConfig, TenantRule
from nixl_twisted.config.words import counted
from nixl_twisted.happened import Happened
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.completion import Completion
from nixl_twisted.protocol.errors import ProxyError

T = TypeVar("T")


class Counted(Enum):
    """What a request is counted in: its tenant's limits and ``--max-in-flight`` (``ALL``),
    or its tenant's only (``TENANT``: the proxy's own listing of the instances' models is
    no instance's work, so it is served past ``--max-in-flight`` and while draining)."""

    ALL = "all"
    TENANT = "tenant"


class Admission:
    """Counts requests in flight; refuses past the limit, and all while draining."""

    def __init__(
        self,
        max_in_flight: int,
        on_change: Callable[[int], object] = lambda count: None,
        tenancy: Tenancy | None = None,
    ) -> None:
        """``on_change`` is told the new count on every change (the in-flight gauge);
        ``tenancy``: whose each request is, and its tenant's limits (None: no tenants)."""
        self.tenancy = tenancy
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self.draining = False
        #: Stopping soon (``--shutdown-delay``): still admitting, no longer ready.
        self.leaving = False
        self._idle = Happened()
        self.on_change = on_change

    def configure(self, config: ProxyConfig) -> None:
        """``--max-in-flight`` from now on (a reload)."""
        self.max_in_flight = config.limits.max_in_flight

    def request(
        self,
        request: Request,
        path: str,
        completion: Completion | None,
        work: Callable[[TenantRule], Deferred[T]],
        counted: Counted = Counted.ALL,
    ) -> Deferred[T]:
        """A route's one step of admission: its tenant admitted (at once, or once Redis has
        said), then a slot taken, ``work`` run with the tenant's rule, the slot given back
        (``counted``: ``TENANT``, no slot).

        ``completion`` None: a request that generates no tokens (models, tokenize, a stored
        response), held to its tenant's in flight and requests per minute only.
        """
        tenancy = self.tenancy
        admitted = tenancy.admit(request, path, completion) if tenancy is not None else NO_RULE
        if counted is Counted.TENANT:
            if isinstance(admitted, Deferred):
                return admitted.addCallback(work)
            return maybeDeferred(work, admitted)
        if isinstance(admitted, Deferred):
            return admitted.addCallback(lambda rule: self.serve(lambda: work(rule)))
        return self.serve(lambda: work(admitted))

    def serve(self, work: Callable[[], Deferred[T]]) -> Deferred[T]:
        """Take one request in, run ``work``, and give its slot back however it ends.

        The one place a slot is taken and given back: whatever ``work`` raises
        (at once or later) or returns, the slot is released exactly once, so
        a request that fails in an unforeseen way cannot leak one.
        """
        self.admit()
        return maybeDeferred(work).addBoth(self.release)

    def admit(self) -> None:
        """Take one request in, or raise the 503 that says why not."""
        if self.draining:
            raise ProxyError(ErrorCode.DRAINING, "the proxy is shutting down", retry_after=1.0)
        if self.in_flight >= self.max_in_flight:
            raise ProxyError(
                ErrorCode.TOO_MANY_REQUESTS_IN_FLIGHT,
                f"the proxy is serving its limit of {counted(self.max_in_flight, 'request')}",
                retry_after=1.0,
            )
        self.in_flight += 1
        self.on_change(self.in_flight)

    def release(self, result: object = None) -> object:
        """One request ended (usable as a callback: passes ``result`` on)."""
        self.in_flight -= 1
        self.on_change(self.in_flight)
        if self.draining and self.in_flight == 0:
            self._idle.fire()
        return result

    def start_draining(self) -> None:
        """Refuse new requests from now on; /healthcheck says not ready."""
        self.leaving = True
        self.draining = True
        if self.in_flight == 0:
            self._idle.fire()

    def drained(self) -> Deferred[None]:
        """Fires once draining and nothing is in flight."""
        return self._idle.wait()
