"""Prometheus metrics of one proxy: a registry of its own, exposed at /metrics.

Labels are bounded: routes are the proxy's own (anything else is
``other``), instances are the configured backend URLs. A request id or a
prompt is never a label. Here are the counters and histograms the requests
move; what the backends hold when Prometheus asks is ``scrape_metrics``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.multiprocess import MultiProcessCollector
from twisted.web.iweb import IRequest
from twisted.web.resource import Resource

from nixl_twisted.observe.gc_pauses import GC_BUCKETS
from nixl_twisted.observe.replica_metrics import ReplicaMetrics
from nixl_twisted.observe.saturation import Saturation, Summed
from nixl_twisted.observe.scrape_metrics import ScrapeMetrics
from nixl_twisted.protocol import routes

if TYPE_CHECKING:
    from nixl_twisted.backends.pools import BackendPool

#: Prompt tokens an instance held, by kv-aware's index: from nothing to a long document.
TOKEN_BUCKETS = (0, 16, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
#: Seconds a request may wait in the proxy's queue, up to a long --queue-timeout.
QUEUE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120)
#: Seconds, from a fast loopback leg to a long prefill or generation.
LEG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
#: Actual over predicted: a quarter to four times, finest around right.
RATIO_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 3, 4)

CONTENT_TYPE = CONTENT_TYPE_LATEST
#: Set by a ``--workers`` supervisor for its workers: prometheus_client's multiprocess mode.
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


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

    def __init__(self, pools: Iterable[BackendPool] = (), shared_dir: str | None = None) -> None:
        """``pools``: what the backends hold is read from them at each scrape (``read_at_scrape``
        adds the rest); ``shared_dir``: a worker's, its /metrics then sums every worker's
        files there."""
        self._scraped = ScrapeMetrics(pools)
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
        self.ttft_outcomes = Counter(
            "nixlproxy_ttft_outcomes",
            "Two-leg requests with a first-token target, by their tenant's class (its "
            "configured class, else its priority, never its name) and outcome: on_time, "
            "late, refused or failed before a first byte.",
            ["tenant_class", "outcome"],
            registry=r,
        )
        self.ttft_prediction_ratio = Histogram(
            "nixlproxy_ttft_prediction_ratio",
            "Two-leg requests with a first-token target predicted when they entered the "
            "proxy's queue: their actual first byte over the predicted one (1: right).",
            registry=r,
            buckets=RATIO_BUCKETS,
        )
        self.decode_drain_rate = Gauge(
            "nixlproxy_decode_drain_rate",
            "Decode slots freed per second lately, by model, as the proxy's queue predicts "
            "first tokens with it (the fleet's grants with --replicas-redis).",
            ["model"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.measured_prefill_seconds = Gauge(
            "nixlproxy_measured_prefill_seconds",
            "A prefill leg's seconds, moving average, by model (the queue's prediction).",
            ["model"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.measured_first_byte_seconds = Gauge(
            "nixlproxy_measured_first_byte_seconds",
            "Decode's first byte after the handoff, seconds, moving average, by model (the "
            "queue's prediction).",
            ["model"],
            registry=r,
            multiprocess_mode="livemax",
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
        self.migrations = Counter(
            "nixlproxy_migrations",
            "Completions whose decode instance failed after their first byte, by what came "
            "of it: completed or failed (a continuation on another decode instance), "
            "refused, exhausted, past_deadline (none sent: docs/failures.md).",
            ["outcome"],
            registry=r,
        )
        self.migration_seconds = Histogram(
            "nixlproxy_migration_seconds",
            "From a decode instance failing mid-answer to the first byte of the answer's "
            "continuation on another: how long a moved stream stalled.",
            buckets=LEG_BUCKETS,
            registry=r,
        )
        self.reuse_handles = Counter(
            "nixlproxy_reuse_handles",
            "Handles decode answered (vLLM's bidirectional KV transfer), each taken out of "
            "the client's answer, by outcome: kept (for the conversation's next turn), off "
            "(--multi-turn-reuse is off), no_token_ids, too_short, too_long, not_readable.",
            ["outcome"],
            registry=r,
        )
        self.reuse_lookups = Counter(
            "nixlproxy_reuse_lookups",
            "Two-leg completions under --multi-turn-reuse, by what came of the handle their "
            "prompt extends: used, none, mismatch, expired, taken, failed, decode_only, gone, "
            "disallowed_host, no_token_ids.",
            ["outcome"],
            registry=r,
        )
        self.reuse_tokens = Counter(
            "nixlproxy_reuse_tokens",
            "Prompt tokens the handles used covered: read back from decode by prefill (or "
            "found in prefill's own cache) instead of computed.",
            registry=r,
        )
        self.admissions = Counter(
            "nixlproxy_admissions",
            "Completions at the proxy's queue while instances are capped, by outcome: "
            "at_once, after_wait, queue_full, pushed_out, timed_out, shed, left, shut, "
            "failed, ttft_refused; and, prefilled, for their decode slot: ready_at_once, "
            "ready_after_wait.",
            ["outcome"],
            registry=r,
        )
        self.queue_seconds = Histogram(
            "nixlproxy_queue_seconds",
            "How long completions waited in the proxy's queue for their slots.",
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.ready_wait_seconds = Histogram(
            "nixlproxy_ready_wait_seconds",
            "How long prefilled completions waited in the proxy's queue for their decode "
            "slot (between their legs, their KV held on prefill under its lease).",
            buckets=QUEUE_BUCKETS,
            registry=r,
        )
        self.lease_guard = Counter(
            "nixlproxy_lease_guard",
            "Prefilled completions sent to decode over its cap because their KV lease on "
            "prefill neared its end (--kv-lease-duration).",
            registry=r,
        )
        self.prefill_ahead = Gauge(
            "nixlproxy_prefill_ahead",
            "Completions of a model holding a prefill slot or waiting, prefilled, for a "
            "decode slot (how far prefill runs ahead of decode).",
            ["model"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.prefill_ahead_limit = Gauge(
            "nixlproxy_prefill_ahead_limit",
            "The most completions of a model this process lets run ahead of decode "
            "(--prefill-run-ahead, else its decode caps; the fleet's when replicas share, "
            "its share while Redis is away).",
            ["model"],
            registry=r,
            multiprocess_mode="livesum",
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
        self.gc_pauses = Histogram(
            "nixlproxy_gc_pause_seconds",
            "How long each garbage collection held the process (and every request in it), "
            "by generation (2: a full collection).",
            ["generation"],
            registry=r,
            buckets=GC_BUCKETS,
        )
        #: ``--replicas-redis``: this replica's part of the fleet.
        self.replicas = ReplicaMetrics(r)
        #: Each pool's saturation and its parts, by model (``observe.saturation``); the queue
        #: it reads is the fleet's (``read_at_scrape``).
        self.saturation = Saturation(r, self._scraped.pools)
        r.register(self._scraped)

    def read_at_scrape(self, scraped: ScrapeMetrics) -> None:
        """What the backends hold is read from ``scraped`` at each scrape from now on: the root's,
        made once the KV events, discovery's report and the queue it reads exist (each of
        which counts into these metrics, so is made after them); the saturation reads the
        same queue."""
        self.registry.unregister(self._scraped)
        self._scraped = scraped
        self.registry.register(scraped)
        self.saturation.reads(scraped.queued)

    def kv_event(self, role: str, url: str, kind: str) -> None:
        """A batch of an instance's KV events, a gap, a bad message (``KvEvents``' count)."""
        self.child(self.kv_events, role, url, kind).inc()

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

    def sampled(self) -> list[Metric]:
        """The counters and histograms the status page charts (``observe.history``); a
        worker's: every worker's, summed from their files as ``exposition`` sums them."""
        wanted = (
            self.requests,
            self.time_to_first_byte,
            self.handoff_gap,
            self.disaggregation_decisions,
            self.routing_decisions,
            self.refused,
            self.ttft_outcomes,
        )
        if self._shared_dir is None:
            return [family for metric in wanted for family in metric.collect()]
        names = {family.name for metric in wanted for family in metric.describe()}
        summed = MultiProcessCollector(None, path=self._shared_dir).collect()
        return [family for family in summed if family.name in names]

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format; a worker's: the whole proxy's."""
        self.saturation.sample()
        if self._shared_dir is None:
            return generate_latest(self.registry)
        # The library's multiprocess collector, read afresh per scrape, as its docs say.
        scrape = CollectorRegistry()
        scrape.register(Summed(self._shared_dir))
        # Health is the supervisor's verdict, the same in every worker: this one's will do.
        scrape.register(self._scraped)
        return generate_latest(scrape)
