"""``--limits-redis``: each tenant's requests and tokens per minute, counted in one Redis.

Every replica and worker then holds a tenant to one limit. Each admission is
one Lua script (sent by its SHA-1 once known, txredisapi's ``eval``) that
forgets what left the 60 s window, decides and counts, atomically; the keys
are ``nixlproxy:{<tenant's digest>}:...`` (one hash slot per tenant) and
expire with the window. A request's tokens enter the window as its estimate
when it is admitted, and are replaced by what vLLM reported when it ends: a
replica that dies leaves estimates that simply leave the window.

Requests in flight are not counted here: a count in Redis would be given back
by the process that took it, and a process that dies or loses Redis mid-request
would hold it for good. ``--replicas-redis`` counts them, tied to each replica's
heartbeat (``shared_tenants``); without it each process counts its own
(``security.md``).

Redis must never fail a request: a call not answered within ``TIMEOUT`` s,
any error, or a reply of the wrong shape lets the process decide with its
own counters, said in words once per change of state (the log,
``nixlproxy_tenant_limits_fallback``) and counted for each request
(``nixlproxy_tenant_limits_decided_alone_total``). While Redis is known
unreachable no call is tried; its connection comes back on its own
(``redis_link``), refused ones included.
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass
from typing import Any

from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from nixl_twisted.admission.window_scripts import (
    WINDOW_MS,
    WindowAsk,
    WindowOutcome,
    WindowReply,
    admit_window,
    charge_window,
    window_keys,
)
from nixl_twisted.config.words import counted
from nixl_twisted.fleet.link import RETRY, RedisLink
from nixl_twisted.fleet.replies import WrongReply, shown
from nixl_twisted.observe.metrics import ProxyMetrics

log = Logger()

#: Seconds a Redis call may take before the process decides alone.
TIMEOUT = 0.1


@dataclass(frozen=True)
class Verdict:
    """What Redis decided: admitted, or past which limit and for how many seconds more."""

    admitted: bool
    limit: str = ""
    wait: float = 0.0
    #: The request's name in Redis (its tokens are charged under it).
    member: str = ""


class SharedWindows(Service):
    """Requests and tokens per minute in Redis, for every process; None when Redis cannot say."""

    def __init__(
        self, url: str, clock: IReactorTime, timer: IReactorTime, metrics: ProxyMetrics
    ) -> None:
        """``clock``: the proxy's time (the windows', and the wait before a refused
        connection is made again); ``timer``: the reactor, for the timeout of each
        call (network time, not the proxy's)."""
        self.url = url
        self.clock = clock
        self.timer = timer
        self.metrics = metrics
        #: Each process's requests have names of their own.
        self._names = (f"{uuid.uuid4().hex[:12]}:{n}" for n in itertools.count())
        self.fallback = False
        #: The connection, opened at the start of the service (before the listeners').
        self.link = RedisLink(url, clock, self._refused)

    def startService(self) -> None:
        super().startService()
        self.link.start()

    def stopService(self) -> Deferred[None]:
        super().stopService()
        return self.link.stop()

    def ask(
        self, tenant: str, rpm: int, tpm: int, estimate: int | None
    ) -> Deferred[Verdict | None]:
        """Count a request for ``tenant`` in Redis; None: Redis could not say in time."""
        if self.fallback and not self.link.open:
            self._decided_alone("not_connected")
            return succeed(None)  # (known unreachable: no call, no wait)
        now = self._now_ms()
        member = next(self._names)
        ask = WindowAsk(now, rpm, tpm, estimate, member)
        sent = admit_window(self.link, window_keys(tenant), ask)

        def decided(answer: WindowReply) -> Verdict:
            self._shared()
            if answer.outcome is WindowOutcome.ADMITTED:
                return Verdict(True, member=member)
            # (clocks may differ; no entry stays past two windows: ``window_scripts``)
            wait = min(2 * WINDOW_MS / 1000, max(1.0, (answer.oldest + WINDOW_MS - now) / 1000))
            limit = (
                f"{counted(rpm, 'request')} per minute"
                if answer.outcome is WindowOutcome.PAST_REQUESTS
                else f"{counted(tpm, 'token')} per minute"
            )
            return Verdict(False, limit, wait)

        def alone(failure: Failure) -> None:
            if failure.check(CancelledError):
                failure.raiseException()  # (its client left: nothing said of Redis)
            reason, what = _why(failure, self.link.open)
            self._decided_alone(reason)
            self._away(what)

        return self._bounded(sent).addCallback(decided).addErrback(alone)

    def charge(self, tenant: str, member: str, tokens: int) -> None:
        """What an admitted request used, in place of its estimate (best effort)."""
        if self.fallback and not self.link.open:
            return  # (its estimate leaves the window on its own)
        sent = charge_window(self.link, window_keys(tenant), member, tokens, self._now_ms())

        def charged(answer: None) -> None:
            self._shared()

        def failed(failure: Failure) -> None:
            if not failure.check(CancelledError):
                self._away(_why(failure, self.link.open)[1])

        self._bounded(sent).addCallback(charged).addErrback(failed)

    def connected(self) -> Deferred[None]:
        """Fires when a connection to Redis is next made (for tests and operators)."""
        return self.link.connected()

    def _now_ms(self) -> int:
        return int(self.clock.seconds() * 1000)

    def _bounded(self, sent: Deferred[Any]) -> Deferred[Any]:
        return sent.addTimeout(TIMEOUT, self.timer)

    def _decided_alone(self, reason: str) -> None:
        self.metrics.tenant_limits_decided_alone.labels(reason=reason).inc()

    def _refused(self, why: str) -> None:
        self._away(f"refused the connection ({why}; tried again every {RETRY:g} s)")

    def _shared(self) -> None:
        if self.fallback:
            self.fallback = False
            self.metrics.tenant_limits_fallback.set(0)
            log.info(
                "tenant limits: Redis {url} answers again; limits are shared", url=shown(self.url)
            )

    def _away(self, what: str) -> None:
        if not self.fallback:
            self.fallback = True
            self.metrics.tenant_limits_fallback.set(1)
            log.warn(
                "tenant limits: Redis {url} {what}; each process counts its own requests and "
                "tokens per minute until it answers again",
                url=shown(self.url),
                what=what,
            )


def _why(failure: Failure, connected: bool) -> tuple[str, str]:
    """Why Redis could not say: the reason counted, and what the log says, in words."""
    message = failure.getErrorMessage()
    if failure.check(defer.TimeoutError):
        if connected:
            return "timeout", f"did not answer within {TIMEOUT * 1000:g} ms"
        return "not_connected", f"could not be reached (no connection within {TIMEOUT * 1000:g} ms)"
    if failure.check(WrongReply, "txredisapi.InvalidResponse"):
        return "wrong_reply", f"answered with a reply of the wrong shape ({message})"
    if failure.check("txredisapi.ConnectionError"):
        return "not_connected", f"could not be reached ({message})"
    if failure.check("txredisapi.ResponseError"):
        return "error", f"answered with an error ({message})"
    return "error", f"failed ({type(failure.value).__name__}: {message})"
