"""``ProxyService``: one proxy's service tree, and the one order it stops in.

``run.root.build`` makes the tree and hands it every part; this is what the
tree does with them: bind every port before twistd sheds privileges, say it
listens once the first health round answered (and freeze the startup heap
then), take a reload to each part, and stop once: say not ready, stop
accepting, drain, close the client connections, stop the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, cast

from twisted.application.internet import StreamServerEndpointService
from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredList, TimeoutError, maybeDeferred
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IListeningPort, IReactorTime
from twisted.internet.task import deferLater
from twisted.logger import Logger

from nixl_twisted.admission import Admission
from nixl_twisted.backends.checks import HealthChecks
from nixl_twisted.config import ProxyConfig
from nixl_twisted.config.words import counted
from nixl_twisted.discovery.service import Discovery
from nixl_twisted.exchange.serving import Serving
from nixl_twisted.happened import Happened
from nixl_twisted.logs import lifecycle
from nixl_twisted.observe.refusals import LogThrottle
from nixl_twisted.run import heap, startup
from nixl_twisted.run.ports import Announced, address, bind_error
from nixl_twisted.run.tree import Logging, ProcessTree
from nixl_twisted.web.app import ProxyApp
from nixl_twisted.web.keys import ClientKeys
from nixl_twisted.web.site import TrackingSite

log = Logger()

#: Seconds drained connections get to send what they have buffered.
CLOSE_GRACE = 5.0


class Configured(Protocol):
    """A part of the proxy that takes its settings from the configuration, at start and reload."""

    def configure(self, config: ProxyConfig) -> None: ...


class StopOrder(NamedTuple):
    """What the proxy stops in order besides its children: the door's admission (not
    ready, then draining), the requests being served (cut at the drain timeout), and the
    loops of the refusals' log throttle and the client keys' file."""

    admission: Admission
    serving: Serving
    throttle: LogThrottle
    keys: ClientKeys


class ProxyService(ProcessTree):
    """One proxy: its children, and the one order they stop in."""

    def __init__(
        self,
        config: ProxyConfig,
        app: ProxyApp,
        site: TrackingSite,
        checks: HealthChecks,
        reactor: Any,
        clock: IReactorTime,
        served: StopOrder,
        discovery: Discovery | None = None,
        configured: Sequence[Configured] = (),
        logging: Logging | None = None,
    ) -> None:
        """``checks``: the health checks, whose first round the proxy waits for before it
        says it listens; ``served``: what it stops in order besides its children;
        ``discovery``: finds the instances of DNS names and selectors (not in a worker: its
        supervisor does); ``configured``: the other parts a reload configures again;
        ``logging``: what it logs through (``ProcessTree``)."""
        super().__init__(config, logging)
        self._reactor = reactor
        self.app = app
        self.served = served
        self.site = site
        self.backends = app.view.backends
        self.checks = checks
        self.clock = clock
        self.discovery = discovery
        self._configured = list(configured)
        self._ports_closed = Happened()
        self._stopped: Happened | None = None
        # (the backends stop last: their connections close once nothing uses them)
        self.backends.setServiceParent(self)
        checks.setServiceParent(self)
        if discovery is not None:
            discovery.setServiceParent(self)

    def privilegedStartService(self) -> None:
        """Bind every port now (before twistd sheds privileges); one that cannot be, one line."""
        try:
            super().privilegedStartService()
        except CannotListenError as error:
            raise SystemExit(bind_error(error)) from None

    def startService(self) -> None:
        startup.check_keys_file(self.config, serving=True)  # (as the user twistd --uid gave)
        startup.check_descriptors(self.config)
        super().startService()
        # Said once the reactor runs, after the signal handlers are in (they
        # go in then too), and once the first health round has answered:
        # whoever reads it may send requests, or a SIGTERM.
        self._reactor.callWhenRunning(
            lambda: self.checks.first_round().addCallback(lambda _: self._announce())
        )

    def _announce(self) -> None:
        if not self.running:
            return  # stopped before its first health round answered
        heap.settle()
        if self.config.worker is None:  # (a worker's supervisor says it for all)
            startup.announce(self.config)
        for port in self.ports():
            lifecycle.info("nixlproxy listening on {address}", address=address(port))

    def listeners(self) -> list[StreamServerEndpointService]:
        return [s for s in self if isinstance(s, StreamServerEndpointService)]

    def ports(self) -> list[IListeningPort]:
        """The ports bound now, in the order of ``--listen`` (then metrics)."""
        endpoints = [cast(Announced, s.endpoint) for s in self.listeners()]
        return [e.port for e in endpoints if e.port is not None]

    def reconfigure(self, config: ProxyConfig) -> None:
        """Apply ``config``'s live settings to the running proxy (a reload, or the supervisor's):
        each part takes it through its own ``configure``, the path the build took too."""
        sites = {cast(TrackingSite, s.factory) for s in self.listeners()} | {self.site}
        discovery = [self.discovery] if self.discovery is not None else []
        for part in [*self._configured, self.app, *sites, self.backends, *discovery]:
            part.configure(config)
        super().reconfigure(config)

    def stopService(self) -> Deferred[None]:
        """Stop once; whoever asks again waits for the same stop."""
        if self._stopped is None:
            Service.stopService(self)
            stopped = self._stopped = Happened()
            stopping = Deferred.fromCoroutine(self._stop())
            stopping.addErrback(lambda failure: log.failure("stopping failed", failure))
            stopping.addBoth(lambda _: stopped.fire())
        return self._stopped.wait()

    async def _stop(self) -> None:
        """Hand the clients over (each answer closes its connection), say not ready (and wait),
        stop accepting, drain (what waits in the queue too), close connections, stop the rest."""
        for site in {cast(TrackingSite, s.factory) for s in self.listeners()} | {self.site}:
            site.hand_over()
        delay = self.config.timeouts.shutdown_delay
        if delay > 0:
            self.served.admission.leaving = True
            lifecycle.info(
                "not ready now; still serving for {seconds} s before draining", seconds=delay
            )
            await deferLater(self.clock, delay)
        # New requests are refused from now on (503, their connection closed); those that
        # wait in the queue are served in the drain window, as those in flight are.
        self.served.admission.start_draining()
        listeners = self.listeners()
        await DeferredList([maybeDeferred(s.stopService) for s in listeners])
        draining = Deferred.fromCoroutine(self._drain())  # its timer runs from now,
        self._ports_closed.fire()  # before whoever waits on this goes on
        if not await draining:
            self.served.serving.stop_queueing()  # (each still waiting answered 503 at once)
            self.served.serving.shut_down()  # each told in band, before its connection closes
        await self._close_connections()
        rest = [s for s in self if s not in listeners and s.running]
        await DeferredList([maybeDeferred(s.stopService) for s in reversed(rest)])
        self.served.throttle.stop()
        self.served.keys.stop()

    def when_ports_closed(self) -> Deferred[None]:
        """Fires once a stopping proxy accepts no more connections."""
        return self._ports_closed.wait()

    async def _drain(self) -> bool:
        admission = self.served.admission
        if admission.in_flight:
            lifecycle.info(
                "draining {requests} in flight",
                in_flight=admission.in_flight,
                requests=counted(admission.in_flight, "request"),
            )
        try:
            await admission.drained().addTimeout(self.config.timeouts.drain, self.clock)
        except TimeoutError:
            log.warn(
                "drain timeout of {seconds} s: closing {requests} still in flight",
                seconds=self.config.timeouts.drain,
                in_flight=admission.in_flight,
                requests=counted(admission.in_flight, "request"),
            )
            return False
        return True

    async def _close_connections(self) -> None:
        """Close client connections: gently (what is buffered is sent), then at once."""
        sites = {cast(TrackingSite, s.factory) for s in self.listeners()}
        closing = DeferredList([site.close_connections(abort=False) for site in sites])
        try:
            await closing.addTimeout(CLOSE_GRACE, self.clock)
        except TimeoutError:
            await DeferredList([site.close_connections(abort=True) for site in sites])
