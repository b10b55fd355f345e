"""The composition root: ``build(config, reactor)`` makes one proxy's service tree.

Everything that touches the world (the reactor, the clock, the HTTP agent)
is resolved here, once, and every collaborator is made here and handed what
it works with. The tree::

    ProxyService              stops in one order: accept, drain, close, backends
    ├── BackendService        the pools and their legs' pooled HTTP client
    ├── HealthChecks          the health loop, what each instance serves, its load
    ├── Discovery             DNS names and Kubernetes selectors (not in a worker)
    ├── SharedWindows         --limits-redis: tenants' windows in Redis
    ├── Replicas              --replicas-redis: the heartbeat; caps and queue the fleet's
    ├── SharedRoutes          --replicas-redis: routing choices told and heard
    ├── FleetAdmin            --replicas-redis: admin changes made on every replica
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
from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING, Any, cast

from twisted.internet.interfaces import (
    IReactorTime,
)
from twisted.logger import Logger
from twisted.web.iweb import IAgent

from nixl_twisted.admission import (
    AT_ONCE,
    Admission,
    Claim,
    FairQueue,
    FleetAhead,
    QueueOutcome,
    Rates,
    RunAhead,
    SharedQueue,
    SharedSlots,
    SharedTenants,
    SharedWindows,
    SlotQueue,
    Slots,
    SwitchedQueue,
    Tenancy,
    TenantLimits,
    replica_share,
)
from nixl_twisted.backends.checks import HealthChecks
from nixl_twisted.backends.health import Thresholds
from nixl_twisted.backends.holdings import NO_HOLDINGS, Holdings
from nixl_twisted.backends.models import context_length, named
from nixl_twisted.backends.pools import BackendPool
from nixl_twisted.backends.service import BackendService
from nixl_twisted.backends.upstream import Upstream, pooled_upstream
from nixl_twisted.config import ProxyConfig
from nixl_twisted.discovery.report import Reported
from nixl_twisted.discovery.service import Discovery
from nixl_twisted.exchange.legs import Legs
from nixl_twisted.exchange.placing import Placed
from nixl_twisted.exchange.responses import ResponseDirectory
from nixl_twisted.exchange.serving import Serving
from nixl_twisted.fleet.admin_changes import FleetAdmin
from nixl_twisted.fleet.handles import FleetHandles
from nixl_twisted.fleet.outbox import Outbox
from nixl_twisted.fleet.replicas import Replicas
from nixl_twisted.fleet.responses import SharedResponses
from nixl_twisted.fleet.routes import SharedRoutes
from nixl_twisted.kv.events import KvEvents
from nixl_twisted.observe import tracing
from nixl_twisted.observe.access import AccessLog
from nixl_twisted.observe.gc_pauses import GcPauses
from nixl_twisted.observe.history import History
from nixl_twisted.observe.metrics import METRICS_DIR_ENV, MetricsResource, ProxyMetrics
from nixl_twisted.observe.observed import Observed
from nixl_twisted.observe.recent_warnings import RecentWarnings
from nixl_twisted.observe.refusals import LogThrottle, Refusals
from nixl_twisted.observe.saturation import Sampling
from nixl_twisted.observe.scrape_metrics import Queued, ScrapeMetrics
from nixl_twisted.run.coordination import SupervisorLink
from nixl_twisted.run.ports import listener
from nixl_twisted.run.proxy_service import Configured, ProxyService, StopOrder
from nixl_twisted.run.signals import SignalService
from nixl_twisted.run.tree import Logging
from nixl_twisted.web.admin import AdminAPI
from nixl_twisted.web.app import ProxyApp
from nixl_twisted.web.backends_view import BackendsView
from nixl_twisted.web.deadlines import ClientLimits
from nixl_twisted.web.intake import BodyBudget
from nixl_twisted.web.keys import ClientKeys
from nixl_twisted.web.site import TrackingSite
from nixl_twisted.web.status import StatusPage

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

log = Logger()


def _worker_hangup() -> None:
    log.warn(
        "SIGHUP to a worker changes nothing: send it to the supervisor, pid {pid}", pid=os.getppid()
    )


def _queue_said(metrics: ProxyMetrics, outcome: QueueOutcome, waited: float, ticket: Claim) -> None:
    """A request's outcome at the fair queue: counted, and how long it waited if it did."""
    metrics.admissions.labels(outcome).inc()
    metrics.saturation.told(outcome, ticket.model)
    if ticket.is_ready:
        metrics.ready_wait_seconds.observe(waited)
    elif outcome != AT_ONCE:
        metrics.queue_seconds.observe(waited)


def _replica_share(replicas: Replicas, whole: int) -> int:
    """This replica's share of a limit the replicas hold together (its static share)."""
    return replica_share(whole, replicas.count)


def _ahead_shown(metrics: ProxyMetrics, model: str | None, ahead: int, limit: int | None) -> None:
    """How far a model's prefill runs ahead of decode, against its limit (the gauges)."""
    metrics.prefill_ahead.labels(model or "").set(ahead)
    metrics.prefill_ahead_limit.labels(model or "").set(-1 if limit is None else limit)


def _rates_said(
    metrics: ProxyMetrics,
    model: str | None,
    drain: float | None,
    prefill: float | None,
    first_byte: float | None,
) -> None:
    """A model's measured rates, as the queue predicts first tokens with them (the gauges:
    set once measured)."""
    label = model or ""
    for gauge, value in (
        (metrics.decode_drain_rate, drain),
        (metrics.measured_prefill_seconds, prefill),
        (metrics.measured_first_byte_seconds, first_byte),
    ):
        if value is not None:
            metrics.child(gauge, label).set(value)


def backend_pools(config: ProxyConfig, clock: IReactorTime) -> tuple[BackendPool, BackendPool]:
    """The prefill and decode pools as the configuration gives them (the service, discovery
    and the admin API change them from then on)."""
    thresholds = Thresholds.of(config.health)
    checked = config.health.interval > 0
    prefill = BackendPool("prefill", config.pools.static("prefill"), clock, thresholds, checked)
    decode = BackendPool("decode", config.pools.static("decode"), clock, thresholds, checked)
    return prefill, decode


def _queued(slots: Slots) -> Iterator[Queued]:
    """Each request waiting in the queue: the pool it found full, its model, its tenant."""
    for waiting in slots.queue.waiting():
        ticket = waiting.ticket
        # ("": it waits behind another of its model; the saturation and the gauge say for
        # which pool.)
        yield waiting.blocked, ticket.model or "", ticket.tenant or ""


def backend_service(
    config: ProxyConfig,
    reactor: Any,
    clock: IReactorTime,
    pools: tuple[BackendPool, BackendPool],
    agent: IAgent | None = None,
    run_checks: bool = True,
    holdings: Holdings = NO_HOLDINGS,
) -> tuple[BackendService, HealthChecks]:
    """Both ``pools`` and their clients, and the health checks over them.

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
    prefill, decode = pools
    checks = HealthChecks(pools, probes, clock, config, runs=run_checks)
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
    pools = backend_pools(config, clock)
    # What the KV events, the queue and the rest count into, first; the fleet they hold is
    # read from them once they exist (``read_at_scrape``).
    metrics = ProxyMetrics(pools, os.environ.get(METRICS_DIR_ENV) if shared else None)
    kv = KvEvents(reactor, clock, pools, config, metrics.kv_event, asker)
    # A worker's pools take their health from the supervisor, which checks.
    backends, checks = backend_service(config, reactor, clock, pools, agent, not shared, kv)
    # A worker's supervisor discovers for all, and tells it; it also carries its admin changes.
    link, found = None, None
    if shared:
        link = SupervisorLink(reactor, backends)
    else:
        found = Discovery(reactor, clock, backends, config)
    report: Reported = link.told if link is not None else cast(Discovery, found)
    # --replicas-redis: this process is one replica of the proxy; caps, queue, routing view
    # and stored responses the fleet's.
    per_tenant = config.limits.responses_per_tenant
    replicas, shared_slots, routes, fleet_admin = None, None, None, None
    handles = None
    responses = ResponseDirectory(per_owner=per_tenant)
    if config.replicas.redis is not None:
        replicas = Replicas(config.replicas.redis, reactor, clock, metrics.replicas, config.worker)
        shared_slots = SharedSlots(replicas, backends.pools, metrics.replicas)
        outbox = Outbox(replicas, reactor, metrics.replicas, per_tenant)
        routes = SharedRoutes(replicas, outbox, backends.pools, kv, metrics.replicas)
        fleet_admin = FleetAdmin(replicas, backends, config, metrics.replicas)
        kept = SharedResponses(replicas, outbox)
        responses = ResponseDirectory(shared=kept, per_owner=per_tenant)
        handles = FleetHandles(replicas)
    # The queue before capped instances: this process's, or every replica's (chosen here once).
    said = partial(_queue_said, metrics)
    capacity = config.capacity
    rates = Rates(clock, partial(_rates_said, metrics))
    local: FairQueue[Placed] = FairQueue(
        clock, capacity.queue_size, capacity.queue_timeout, said, rates
    )
    queue: FairQueue[Placed] | SwitchedQueue[Placed] = local
    others = None  # (the other replicas' requests ahead of decode: none alone)
    if replicas is not None and shared_slots is not None:
        decode = backends.decode
        serves = lambda m: named(m, decode.instances)  # noqa: E731
        fleet_queue = SharedQueue(clock, local, replicas, shared_slots, said, serves)
        queue = SwitchedQueue(fleet_queue, replicas)
        others = FleetAhead(shared_slots, backends.prefill, fleet_queue.ready_held)
    _: SlotQueue[Placed] = queue  # (each is one: ``Slots`` never asks which it holds)
    share = (lambda whole: whole) if replicas is None else partial(_replica_share, replicas)
    shown = partial(_ahead_shown, metrics)
    run_ahead = RunAhead(backends.decode, share, shown, local.rates, others)
    local.committed = run_ahead.ahead  # (what a first-token prediction counts ahead too)
    slots = Slots(backends, clock, queue, run_ahead, lambda claim: metrics.lease_guard.inc())
    slots.configure(config)
    metrics.read_at_scrape(ScrapeMetrics(pools, kv, report.errors, partial(_queued, slots)))
    if tracer_provider is None and tracing.enabled(config.traces, os.environ):
        tracer_provider = tracing.provider_for(config.traces, config.worker)
    traces = tracing.Tracing(tracer_provider, reactor, clock)
    observed = Observed(metrics, traces, Refusals(metrics.refused, LogThrottle(clock)))
    keys = ClientKeys(clock, config)
    limits = TenantLimits(clock, config)
    windows = None
    if config.tenants.redis is not None:
        windows = SharedWindows(config.tenants.redis, clock, reactor, metrics)
    shared_tenants = None
    if replicas is not None:
        shared_tenants = SharedTenants(replicas)
        replicas.on_records(shared_tenants.records)  # (a place Redis records, not held here)
    tenancy = Tenancy(
        keys,
        limits,
        lambda model: context_length(model, backends.decode.instances),
        windows,
        shared_tenants,
    )
    # Admission, one step for every route: the tenant, then --max-in-flight (``admission.gate``).
    admission = Admission(config.limits.max_in_flight, metrics.in_flight.set, tenancy)
    view = BackendsView(backends, kv, report)
    told = fleet_admin.tell if fleet_admin is not None else None
    admin = AdminAPI(view, config, link.publish if link is not None else None, told)
    legs = Legs(backends, kv, clock, metrics, config, slots, handles)
    serving = Serving(legs, responses)
    # The status page's charts and warning lines: sampled and kept only while the root runs.
    history = History(clock, metrics.sampled)
    warnings = RecentWarnings()
    status = StatusPage(
        view, serving, admission, tenancy, history, warnings, config.worker, replicas
    )
    app = ProxyApp(config, view, serving, admission, tenancy, admin, observed, status)
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
    if fleet_admin is not None:  # (after a reload, the fleet's changes are made again)
        configured.append(fleet_admin)
    served = StopOrder(admission, serving, observed.refusals.throttle, keys)
    root = ProxyService(
        config, app, site, checks, reactor, clock, served, found, configured, logging
    )
    if replicas is not None:  # (before the listeners: shared before the first request)
        replicas.setServiceParent(root)
    if routes is not None:
        routes.setServiceParent(root)
    if fleet_admin is not None:
        fleet_admin.setServiceParent(root)
    history.setServiceParent(root)
    warnings.setServiceParent(root)
    GcPauses(metrics.gc_pauses, clock).setServiceParent(root)
    if shared:  # (other workers answer scrapes from this one's file)
        Sampling(metrics.saturation, clock).setServiceParent(root)
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
        link.on_reloaded(root.reconfigure)  # (as the supervisor reloaded it, as a SIGHUP would)
        link.setServiceParent(root)
    return root
