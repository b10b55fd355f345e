"""The backends' metrics, read at scrape time: instances, their KV index, discovery, the queue.

These are no counters the hot path moves but what the pools, the KV events,
discovery and the proxy's queue hold when Prometheus asks: one collector,
registered by ``ProxyMetrics`` (and afresh per scrape in a worker).
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from nixl_twisted.backends.pools import BackendPool


class KvStatus(Protocol):
    """What the KV events say of an instance (``kv.events.KvEvents``)."""

    def status(self, role: str, url: str) -> dict[str, Any] | None: ...


#: A request waiting in the proxy's queue: (the pool it found full, "" when it waits
#: behind another of its model; its model; its tenant).
Queued = tuple[str, str, str]


class ScrapeMetrics(Collector):
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
        #: What the pools are, and what waits in the queue (the saturation reads them too).
        self.pools = self._pools
        self._events = events
        self._sources = sources
        self._queued = queued
        self.queued = queued

    def describe(self) -> Iterator[Metric]:
        """Nothing up front: its families are read from the pools and the queue when
        scraped, which may be made after the metrics (the root makes the queue later)."""
        return iter(())

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
        ejections = CounterMetricFamily(
            "nixlproxy_outlier_ejections",
            "Times a backend instance was ejected from rotation a while after failed legs in a "
            "row (--outlier-consecutive-failures; this process's legs).",
            labels=["pool", "instance"],
        )
        ejected = GaugeMetricFamily(
            "nixlproxy_backend_ejected",
            "Whether a backend instance is ejected from rotation now (1), after failed legs in "
            "a row.",
            labels=["pool", "instance"],
        )
        queued = GaugeMetricFamily(
            "nixlproxy_queued",
            "Requests waiting in the proxy's queue for their slots, by model, tenant and "
            "the pool they found full.",
            labels=["pool", "model", "tenant"],
        )
        waiting = self._queued() if self._queued is not None else ()
        for (found, *key), count in Tally(waiting).items():
            queued.add_metric([found or "decode", *key], float(count))
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
                ejections.add_metric(labels, float(instance.ejected_total))
                ejected.add_metric(labels, 1.0 if pool.ejected(instance) else 0.0)
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
        yield ejections
        yield ejected
