"""The composition root: ``build(config, reactor)`` makes one proxy's service tree.

Everything that touches the world (the reactor, the clock, the HTTP agent)
is resolved here, once, and every collaborator is made here and handed what
it works with. The tree::

    ProxyService              stops in one order: accept, drain, close, backends
    ├── BackendService        the pools and their legs' pooled HTTP client
    ├── HealthChecks          the health loop, what each instance serves, its load
    ├── Discovery             DNS names and Kubernetes selectors (not in a worker)
    ├── SharedWindows         --limits-redis: tenants' windows in Redis
    ├── KvEvents              vLLM's KV events, when an instance publishes them
    ├── listener x N          strports services, bound in privilegedStartService
    ├── metrics listener      when --metrics-listen is set
    ├── Tracing               when tracing is on: flushes queued spans at stop
    ├── History               the status page's charts, sampled while it is looked at
    ├── RecentWarnings        the status page's warning lines, from the log
    ├── GcPauses              times each garbage collection (nixlproxy_gc_pause_seconds)
    ├── SignalService         SIGTERM and SIGHUP (under twistd)
    └── SupervisorLink        in a --workers worker: pools and health from the supervisor
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

from twisted.application.internet import StreamServerEndpointService
from twisted.application.service import Service
from twisted.internet.defer import Deferred, DeferredList, TimeoutError, maybeDeferred
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import (
    IListeningPort,
    IReactorTime,
)
from twisted.internet.task import deferLater
from twisted.logger import Logger
from twisted.web.iweb import IAgent

from nixl_twisted.backends.checks import HealthChecks
from nixl_twisted.backends.health import Thresholds
from nixl_twisted.backends.holdings import NO_HOLDINGS, Holdings
from nixl_twisted.backends.models import context_length
from nixl_twisted.backends.pools import BackendPool
from nixl_twisted.backends.service import BackendService
from nixl_twisted.backends.upstream import Upstream, pooled_upstream
from nixl_twisted.config import ProxyConfig
from nixl_twisted.discovery.report import Reported
from nixl_twisted.discovery.service import Discovery
from nixl_twisted.exchange.fair_queue import AT_ONCE, Ticket
from nixl_twisted.exchange.legs import Legs
from nixl_twisted.exchange.responses import ResponseDirectory
from nixl_twisted.exchange.serving import Serving
from nixl_twisted.exchange.slots import Slots
from nixl_twisted.happened import Happened
from nixl_twisted.kv.events import KvEvents
from nixl_twisted.logs import lifecycle
from nixl_twisted.observe import tracing
from nixl_twisted.observe.access import AccessLog
from nixl_twisted.observe.gc_pauses import GcPauses
from nixl_twisted.observe.history import History
from nixl_twisted.observe.metrics import METRICS_DIR_ENV, MetricsResource, ProxyMetrics
from nixl_twisted.observe.observed import Observed
from nixl_twisted.observe.recent_warnings import RecentWarnings
from nixl_twisted.observe.refusals import LogThrottle, Refusals
from nixl_twisted.run import heap, startup
from nixl_twisted.run.coordination import SupervisorLink
from nixl_twisted.run.ports import Announced, address, bind_error, listener
from nixl_twisted.run.signals import SignalService
from nixl_twisted.run.tree import Logging, ProcessTree
from nixl_twisted.web.admin import AdminAPI
from nixl_twisted.web.admission import Admission
from nixl_twisted.web.app import ProxyApp
from nixl_twisted.web.deadlines import ClientLimits
from nixl_twisted.web.fleet import Fleet
from nixl_twisted.web.intake import BodyBudget
from nixl_twisted.web.keys import ClientKeys
from nixl_twisted.web.shared_limits import SharedWindows
from nixl_twisted.web.site import TrackingSite
from nixl_twisted.web.status import StatusPage
from nixl_twisted.web.tenancy import Tenancy
from nixl_twisted.web.tenants import TenantLimits

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

log = Logger()

#: Seconds drained connections get to send what they have buffered.
CLOSE_GRACE = 5.0


class Configured(Protocol):
    """A part of the proxy that takes its settings from the configuration, at start and reload."""

    def configure(self, config: ProxyConfig) -> None: ...


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
        discovery: Discovery | None = None,
        configured: Sequence[Configured] = (),
        logging: Logging | None = None,
    ) -> None:
        """``checks``: the health checks, whose first round the proxy waits for before it
        says it listens; ``discovery``: finds the instances of DNS names and selectors (not
        in a worker: its supervisor does); ``configured``: the other parts a reload
        configures again; ``logging``: what it logs through (``ProcessTree``)."""
        super().__init__(config, logging)
        self._reactor = reactor
        self.app = app
        self.site = site
        self.backends = app.fleet.backends
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
        each part takes it through its own ``configure``, as it did when it was made."""
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
        """Say not ready (and wait), stop accepting, drain, close connections, stop the backends."""
        delay = self.config.timeouts.shutdown_delay
        if delay > 0:
            self.app.admission.leaving = True
            lifecycle.info(
                "not ready now; still serving for {seconds} s before draining", seconds=delay
            )
            await deferLater(self.clock, delay)
        self.app.admission.start_draining()
        self.app.serving.stop_queueing()  # (each waiting request answered 503 at once)
        listeners = self.listeners()
        await DeferredList([maybeDeferred(s.stopService) for s in listeners])
        draining = Deferred.fromCoroutine(self._drain())  # its timer runs from now,
        self._ports_closed.fire()  # before whoever waits on this goes on
        if not await draining:
            self.app.shut_down()  # each told in band, before its connection closes
        await self._close_connections()
        rest = [s for s in self if s not in listeners and s.running]
        await DeferredList([maybeDeferred(s.stopService) for s in reversed(rest)])
        self.app.refusals.throttle.stop()
        self.app.tenancy.keys.stop()

    def when_ports_closed(self) -> Deferred[None]:
        """Fires once a stopping proxy accepts no more connections."""
        return self._ports_closed.wait()

    async def _drain(self) -> bool:
        admission = self.app.admission
        if admission.in_flight:
            lifecycle.info("draining {in_flight} requests in flight", in_flight=admission.in_flight)
        try:
            await admission.drained().addTimeout(self.config.timeouts.drain, self.clock)
        except TimeoutError:
            log.warn(
                "drain timeout of {seconds} s: closing {in_flight} requests still in flight",
                seconds=self.config.timeouts.drain,
                in_flight=admission.in_flight,
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


def _worker_hangup() -> None:
    log.warn(
        "SIGHUP to a worker changes nothing: send it to the supervisor, pid {pid}", pid=os.getppid()
    )


def _queue_said(metrics: ProxyMetrics, outcome: str, waited: float, ticket: Ticket) -> None:
    """A request's outcome at the fair queue: counted, and how long it waited if it did."""
    metrics.admissions.labels(outcome).inc()
    if outcome != AT_ONCE:
        metrics.queue_seconds.observe(waited)


def backend_service(
    config: ProxyConfig,
    reactor: Any,
    clock: IReactorTime,
    agent: IAgent | None = None,
    run_checks: bool = True,
    holdings: Holdings = NO_HOLDINGS,
) -> tuple[BackendService, HealthChecks]:
    """Both pools and their clients, and the health checks over them, from the configuration.

    ``run_checks=False``: no health checks here, though the pools still expect
    them (new instances pending): a ``--workers`` worker, whose supervisor
    checks and tells it. ``holdings``: what the KV events say (``kv-aware``).
    """
    health = config.health
    connect = config.timeouts.connect
    if agent is None:
        idle = config.timeouts.backend_idle
        legs = pooled_upstream(reactor, connect, config.limits.max_idle_per_backend, idle)
        # One connection per instance, kept longer than the interval between checks.
        probes = pooled_upstream(reactor, connect, 1, health.interval + health.timeout + 1)
    else:
        legs, probes = Upstream(agent), Upstream(agent)
    thresholds = Thresholds.of(health)
    checked = health.interval > 0
    prefill = BackendPool("prefill", config.pools.static("prefill"), clock, thresholds, checked)
    decode = BackendPool("decode", config.pools.static("decode"), clock, thresholds, checked)
    checks = HealthChecks((prefill, decode), probes, clock, config, runs=run_checks)
    return BackendService(prefill, decode, legs, config, checks, holdings), checks


def build(
    config: ProxyConfig,
    reactor: Any,
    *,
    clock: IReactorTime | None = None,
    agent: IAgent | None = None,
    take_signals: bool = True,
    tracer_provider: TracerProvider | None = None,
    logging: Logging | None = None,
) -> ProxyService:
    """Make one proxy's whole service tree from its configuration: the one place it is made.

    Every collaborator is made here, once, and handed what it works with
    through its constructor; each takes its part of the configuration
    through its own ``configure``, called as it is made and again by each
    reload (``ProxyService.reconfigure``). ``clock`` (default: the reactor)
    drives every timeout, backoff and health check; ``agent`` (default: a
    pooled ``Agent`` on the reactor) makes every backend call. Tests pass a
    ``Clock`` and an in-memory agent. ``tracer_provider`` traces with that
    provider (a test's in-memory exporter) whatever the configuration says.
    """
    clock = clock if clock is not None else cast(IReactorTime, reactor)
    shared = config.worker is not None
    # Where each instance publishes its KV events, asked over a client of its own.
    asker = (
        Upstream(agent)
        if agent is not None
        else pooled_upstream(reactor, config.timeouts.connect, 1, 1.0)
    )
    kv = KvEvents(
        reactor,
        clock,
        lambda: backends.pools(),
        config,
        lambda role, url, kind: metrics.child(metrics.kv_events, role, url, kind).inc(),
        asker,
    )
    # A worker's pools take their health from the supervisor, which checks.
    backends, checks = backend_service(config, reactor, clock, agent, not shared, kv)
    # A worker's supervisor discovers for all, and tells it; it also carries its admin changes.
    link, found = None, None
    if shared:
        link = SupervisorLink(reactor, backends, lambda given: root.reconfigure(given))
    else:
        found = Discovery(reactor, clock, backends, config)
    report: Reported = link.told if link is not None else cast(Discovery, found)
    # Each request's outcome at the fair queue, counted once the metrics exist.
    slots = Slots(backends, clock, config, lambda *said: _queue_said(metrics, *said))
    metrics = ProxyMetrics(
        backends.pools(),
        os.environ.get(METRICS_DIR_ENV) if shared else None,
        kv,
        report.errors,
        lambda: (
            (w.blocked or "decode", w.ticket.model or "", w.ticket.tenant or "")
            for w in slots.queue.waiting()
        ),
    )
    if tracer_provider is None and tracing.enabled(config.traces, os.environ):
        tracer_provider = tracing.provider_for(config.traces, config.worker)
    traces = tracing.Tracing(tracer_provider, reactor, clock)
    observed = Observed(metrics, traces, Refusals(metrics.refused, LogThrottle(clock)))
    admission = Admission(config.limits.max_in_flight, metrics.in_flight.set)
    keys = ClientKeys(clock, config)
    limits = TenantLimits(clock, config)
    windows = None
    if config.tenants.redis is not None:
        windows = SharedWindows(config.tenants.redis, clock, reactor, metrics)
    tenancy = Tenancy(
        keys, limits, lambda model: context_length(model, backends.decode.instances), windows
    )
    fleet = Fleet(backends, kv, report)
    admin = AdminAPI(fleet, config, link.publish if link is not None else None)
    legs = Legs(backends, kv, clock, metrics, config, slots)
    serving = Serving(legs, ResponseDirectory())
    # The status page's charts and warning lines: sampled and kept only while the root runs.
    history = History(clock, metrics.sampled)
    warnings = RecentWarnings()
    status = StatusPage(fleet, serving, admission, tenancy, history, warnings, config.worker)
    app = ProxyApp(config, fleet, serving, admission, tenancy, admin, observed, status)
    site = TrackingSite(
        app.resource(),
        ClientLimits.of(config),
        clock,
        access_log=AccessLog(metrics, emit=config.access_log),
        body_budget=BodyBudget(config.limits.max_buffered_bodies),
        refusals=observed.refusals,
        client_keys=keys,
    )
    configured: list[Configured] = [admission, keys, limits, admin, legs, checks, kv, slots]
    root = ProxyService(config, app, site, checks, reactor, clock, found, configured, logging)
    history.setServiceParent(root)
    warnings.setServiceParent(root)
    GcPauses(metrics.gc_pauses, clock).setServiceParent(root)
    if windows is not None:
        windows.setServiceParent(root)
    kv.setServiceParent(root)
    if traces.enabled:
        traces.setServiceParent(root)
    for description in config.listen:
        listener(description, site, reactor, shared).setServiceParent(root)
    if config.metrics_listen is not None:
        metrics_site = TrackingSite(MetricsResource(metrics), ClientLimits.of(config), clock)
        listener(config.metrics_listen, metrics_site, reactor, shared).setServiceParent(root)
    if config.admin_listen is not None:
        admin_site = TrackingSite(app.resource(admin=True), ClientLimits.of(config), clock)
        listener(config.admin_listen, admin_site, reactor, shared).setServiceParent(root)
    if take_signals:
        # A worker's pools are the supervisor's: SIGHUP goes there.
        hangup = _worker_hangup if shared else root.reload
        SignalService(reactor, hangup).setServiceParent(root)
    if link is not None:
        link.setServiceParent(root)
    return root
