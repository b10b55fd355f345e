"""Prometheus metrics of one proxy: a registry of its own, exposed at /metrics.

Labels are bounded: routes are the proxy's own (anything else is
``other``), instances are the configured backend URLs. A request id or a
prompt is never a label.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from twisted.web.iweb import IRequest
from twisted.web.resource import Resource

from nixl_twisted.protocol import routes

if TYPE_CHECKING:
    from nixl_twisted.backends.pools import BackendPool


class KvStatus(Protocol):
    """What the KV events say of an instance (``kv.events.KvEvents``)."""

    def status(self, role: str, url: str) -> dict[str, Any] | None: ...


#: Prompt tokens an instance held, by kv-aware's index: from nothing to a long document.
TOKEN_BUCKETS = (0, 16, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
#: Seconds a request may wait in the proxy's queue, up to a long --queue-timeout.
QUEUE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120)
#: A request waiting in the proxy's queue: (the pool it found full, its model, its tenant).
Queued = tuple[str, str, str]
#: Seconds, from a fast loopback leg to a long prefill or generation.
LEG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

CONTENT_TYPE = CONTENT_TYPE_LATEST
#: Set by a ``--workers`` supervisor for its workers: prometheus_client's multiprocess mode.
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


class _InstanceHealth(Collector):
    """Reads the pools at scrape time: health, legs in flight and vLLM's scraped load.

    Under ``--workers`` these are the answering worker's view: health is the
    supervisor's verdict (the same in every worker), legs in flight its own.
    """

    def __init__(
        self,
        pools: Iterable[BackendPool],
        events: KvStatus | None = None,
        sources: Callable[[], Sequence[Mapping[str, Any]]] | None = None,
        queued: Callable[[], Iterable[Queued]] | None = None,
    ) -> None:
        self._pools = list(pools)
        self._events = events
        self._sources = sources
        self._queued = queued

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily(
            "nixlproxy_backend_healthy",
            "Whether a backend instance is up (1), or down or not yet checked (0).",
            labels=["pool", "instance"],
        )
        in_flight = GaugeMetricFamily(
            "nixlproxy_backend_in_flight",
            "Legs being served by each backend instance now (this process's).",
            labels=["pool", "instance"],
        )
        load = GaugeMetricFamily(
            "nixlproxy_backend_load",
            "vLLM's own load as last scraped (policy load, busy-prefill rule): running, waiting, "
            "kv_cache_usage.",
            labels=["pool", "instance", "kind"],
        )
        blocks = GaugeMetricFamily(
            "nixlproxy_kv_index_blocks",
            "KV blocks the index says each instance holds, from its KV events (kv-aware).",
            labels=["pool", "instance"],
        )
        stale = GaugeMetricFamily(
            "nixlproxy_kv_index_stale",
            "Whether an instance's index may be wrong now (1): a gap being replayed, or "
            "cleared after one it could not fill.",
            labels=["pool", "instance"],
        )
        predicted = GaugeMetricFamily(
            "nixlproxy_kv_index_predicted",
            "KV blocks kv-aware predicted for each instance when it routed there, not yet "
            "confirmed by its events.",
            labels=["pool", "instance"],
        )
        predictions = CounterMetricFamily(
            "nixlproxy_kv_predictions",
            "What became of the blocks kv-aware predicted: confirmed (a BlockStored), expired, "
            "removed (a BlockRemoved), cleared, failed (their leg failed).",
            labels=["pool", "instance", "outcome"],
        )
        discovered = GaugeMetricFamily(
            "nixlproxy_discovered_instances",
            "Instances in rotation (not draining) by where they came from: static, admin, dns, "
            "dnssrv, kubernetes.",
            labels=["pool", "source"],
        )
        caps = GaugeMetricFamily(
            "nixlproxy_backend_max_in_flight",
            "Legs each capped backend instance may take from this process at once (its "
            "max-in-flight, or this worker's share of it).",
            labels=["pool", "instance"],
        )
        recompute = GaugeMetricFamily(
            "nixlproxy_decode_recompute_ratio",
            "The share of the prompt tokens of P/D legs each decode instance computed itself "
            "over the last 60 s (its vLLM's counters): near 0 when the KV handoff works.",
            labels=["instance"],
        )
        episodes = CounterMetricFamily(
            "nixlproxy_decode_recompute_episodes",
            "Episodes of a decode instance computing half or more of the P/D legs' prompt "
            "tokens itself (each one warning line).",
            labels=["instance"],
        )
        queued = GaugeMetricFamily(
            "nixlproxy_queued",
            "Requests waiting in the proxy's queue for their slots, by model, tenant and "
            "the pool they found full.",
            labels=["pool", "model", "tenant"],
        )
        for key, count in Tally(self._queued() if self._queued is not None else ()).items():
            queued.add_metric(list(key), float(count))
        errors = CounterMetricFamily(
            "nixlproxy_discovery_errors",
            "Lookups and watches that failed (the last known instances were kept), by source.",
            labels=["pool", "source"],
        )
        for said in self._sources() if self._sources is not None else ():
            errors.add_metric([str(said["pool"]), str(said["source"])], float(said["errors"]))
        for pool in self._pools:
            kinds = Tally(i.source for i in pool.instances if not i.draining)
            for kind, count in kinds.items():
                discovered.add_metric([pool.role, kind], float(count))
            for instance in pool.instances:
                labels = [pool.role, instance.url]
                events = self._events.status(pool.role, instance.url) if self._events else None
                if events is not None:
                    blocks.add_metric(labels, float(events["blocks"]))
                    stale.add_metric(labels, 1.0 if events["state"] == "stale" else 0.0)
                    predicted.add_metric(labels, float(events["predicted"]))
                    for outcome, count in events["predictions"].items():
                        predictions.add_metric([*labels, outcome], float(count))
                healthy.add_metric(labels, 1.0 if instance.healthy else 0.0)
                in_flight.add_metric(labels, float(instance.in_flight))
                if instance.slots is not None:
                    caps.add_metric(labels, float(instance.slots))
                for kind, value in instance.load.items():
                    if kind != "ours":
                        load.add_metric([*labels, kind], value)
                if instance.recompute is not None:
                    recompute.add_metric([instance.url], instance.recompute)
                    episodes.add_metric([instance.url], float(instance.recompute_episodes))
        yield healthy
        yield in_flight
        yield load
        yield blocks
        yield stale
        yield predicted
        yield predictions
        yield discovered
        yield errors
        yield caps
        yield queued
        yield recompute
        yield episodes


class MetricsResource(Resource):
    """``GET /metrics`` alone, for a separate ``--metrics-listen`` endpoint."""

    isLeaf = True

    def __init__(self, metrics: ProxyMetrics) -> None:
        super().__init__()
        self._metrics = metrics

    def render_GET(self, request: IRequest) -> bytes:
        if request.path != routes.METRICS.encode():
            request.setResponseCode(404)
            return b"metrics are at /metrics\n"
        request.setHeader(b"Content-Type", CONTENT_TYPE.encode("ascii"))
        return self._metrics.exposition()


class ProxyMetrics:
    """Every metric the proxy exports, and the events that move them."""

    def __init__(
        self,
        pools: Iterable[BackendPool] = (),
        shared_dir: str | None = None,
        events: KvStatus | None = None,
        sources: Callable[[], Sequence[Mapping[str, Any]]] | None = None,
        queued: Callable[[], Iterable[Queued]] | None = None,
    ) -> None:
        """``shared_dir``: a worker's; its /metrics then sums every worker's files there.

        ``queued``: each request waiting in the proxy's queue, as (pool it found full,
        model, tenant).

        ``sources``: discovery's failures by pool and kind (``BackendService.discovery_errors``).
        """
        self._pools = list(pools)
        self._events = events
        self._sources = sources
        self._queued = queued
        self._shared_dir = shared_dir
        self._children: dict[tuple[MetricWrapperBase, tuple[str, ...]], Any] = {}
        # No ``*_created`` series: one per counter and histogram child, they
        # doubled the exposition for a timestamp Prometheus does not need.
        # (prometheus_client keeps this switch process-wide.)
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "nixlproxy_requests",
            "Client requests by route, final status and the model served ('' when not known).",
            ["route", "status", "model"],
            registry=r,
        )
        self.backend_requests = Counter(
            "nixlproxy_backend_requests",
            "Legs sent to each backend instance, by outcome "
            "(answered, error_status, unreachable, timeout, bad_handoff).",
            ["pool", "instance", "outcome"],
            registry=r,
        )
        self.prefill_seconds = Histogram(
            "nixlproxy_prefill_seconds",
            "Prefill leg, request sent to params read, by the instance that answered.",
            ["instance"],
            registry=r,
            buckets=LEG_BUCKETS,
        )
        self.decode_first_byte_seconds = Histogram(
            "nixlproxy_decode_first_byte_seconds",
            "Decode leg, request sent to the first byte of its body, by instance.",
            ["instance"],
            registry=r,
            buckets=LEG_BUCKETS,
        )
        self.time_to_first_byte = Histogram(
            "nixlproxy_time_to_first_byte_seconds",
            "The client's request arriving to the first byte of the answer written to it, "
            "by route and model.",
            ["route", "model"],
            registry=r,
            buckets=LEG_BUCKETS,
        )
        self.handoff_gap = Histogram(
            "nixlproxy_handoff_gap_seconds",
            "Prefill answered (its kv_transfer_params read) to decode's request sent.",
            registry=r,
            buckets=LEG_BUCKETS,
        )
        self.handoff_gap_over_warning = Counter(
            "nixlproxy_handoff_gap_over_warning",
            "Requests whose handoff gap passed --handoff-warning (vLLM's KV lease is 30 s).",
            registry=r,
        )
        self.request_seconds = Histogram(
            "nixlproxy_request_seconds",
            "Completions end to end, as the proxy saw them.",
            registry=r,
            buckets=LEG_BUCKETS,
        )
        self.in_flight = Gauge(
            "nixlproxy_requests_in_flight",
            "Requests being served now.",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.tenant_limits_fallback = Gauge(
            "nixlproxy_tenant_limits_fallback",
            "1 while --limits-redis does not answer and this process counts tenants' requests "
            "and tokens per minute alone; 0 while they are shared.",
            registry=r,
            multiprocess_mode="livemax",
        )
        self.tenant_limits_decided_alone = Counter(
            "nixlproxy_tenant_limits_decided_alone",
            "Requests whose tenant's requests and tokens per minute this process decided "
            "alone because --limits-redis could not say, by why.",
            ["reason"],
            registry=r,
        )
        self.missing_kv_transfer_params = Counter(
            "nixlproxy_prefill_missing_kv_transfer_params",
            "Prefill answers without usable kv_transfer_params.",
            registry=r,
        )
        self.bad_handoffs = Counter(
            "nixlproxy_prefill_bad_handoffs",
            "Prefill answers whose kv_transfer_params decode could not pull with, by "
            "instance and problem (missing, not_object, not_remote_prefill, missing_key, "
            "bad_value, no_blocks); each retried on another prefill instance.",
            ["instance", "problem"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "nixlproxy_client_disconnects",
            "Clients that left before their answer ended.",
            ["phase"],
            registry=r,
        )
        self.panic_legs = Counter(
            "nixlproxy_panic_legs",
            "Legs sent while every instance of their pool was marked down (best effort).",
            ["pool"],
            registry=r,
        )
        self.refused = Counter(
            "nixlproxy_refused",
            "Requests and connections refused before they were served, by reason "
            "(the error code the client got, docs/failures.md).",
            ["reason"],
            registry=r,
        )
        self.routing_decisions = Counter(
            "nixlproxy_routing_decisions",
            "Legs by pool, its policy and the policy's decision (docs/routing.md).",
            ["pool", "policy", "decision"],
            registry=r,
        )
        self.disaggregation_decisions = Counter(
            "nixlproxy_disaggregation_decisions",
            "Completions by whether they took a prefill leg (decision: pd, decode_only) "
            "and the rule that decided (docs/routing.md).",
            ["decision", "reason"],
            registry=r,
        )
        self.retries = Counter(
            "nixlproxy_retries", "Legs sent again to another instance.", ["pool"], registry=r
        )
        self.admissions = Counter(
            "nixlproxy_admissions",
            "Completions at the proxy's queue while instances are capped, by outcome: "
            "at_once, after_wait, queue_full, timed_out, shed, left, shut, failed.",
            ["outcome"],
            registry=r,
        )
        self.queue_seconds = Histogram(
            "nixlproxy_queue_seconds",
            "How long completions waited in the proxy's queue for their slots.",
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.kv_events = Counter(
            "nixlproxy_kv_events",
            "KV event batches from each instance (batch), and what went wrong on the way: "
            "gap, replay (asked), restart (the sequence went back), bad (refused), dropped "
            "(a connection lost).",
            ["pool", "instance", "kind"],
            registry=r,
        )
        self.kv_matched_tokens = Histogram(
            "nixlproxy_kv_matched_tokens",
            "Prompt tokens the instance kv-aware chose already held, by its index.",
            ["pool"],
            registry=r,
            buckets=TOKEN_BUCKETS,
        )
        r.register(_InstanceHealth(self._pools, events, sources, queued))

    def child(self, metric: MetricWrapperBase, *labels: str) -> Any:
        """``metric.labels(*labels)``, remembered: the hot path asks for the same few.

        prometheus_client builds, checks and looks the label tuple up under a
        lock on each call; the label sets here are bounded (routes, statuses,
        instances, outcomes), so each child is made once.
        """
        key = (metric, labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format; a worker's: the whole proxy's."""
        if self._shared_dir is None:
            return generate_latest(self.registry)
        # The library's multiprocess collector, read afresh per scrape, as its docs say.
        scrape = CollectorRegistry()
        MultiProcessCollector(scrape, path=self._shared_dir)
        # Health is the supervisor's verdict, the same in every worker: this one's will do.
        scrape.register(_InstanceHealth(self._pools, self._events, self._sources, self._queued))
        return generate_latest(scrape)
