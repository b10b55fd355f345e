"""Each pool's saturation by model: the signal an operator scales the vLLM pools by.

    saturation = (slots in use + requests queued for the pool) / slots

where the slots are the caps (``--prefill-max-in-flight``,
``--decode-max-in-flight``, ``[models.NAME]``, ``#max-in-flight=``) of the
pool's capped instances that are up and not draining, the slots in use
the legs those capped instances serve now, and the queued the requests
waiting in the proxy's queue that found this pool full. Under 1 the pool
has room; 1 is every slot taken; over 1 requests wait. Requests the queue
refused for want of the pool's slots (full, timed out, shed) are counted
beside it: they are what a saturation held at its ceiling no longer shows.

The three parts are gauges summed over ``--workers`` (``livesum``: each
worker's share of a cap adds up to the cap; under ``--replicas-redis`` each
replica's share is the cap over the replicas alive), the ratio is worked out from
their sums at scrape time, so it is exact for the whole proxy, and a
PromQL ``sum(...) / sum(...)`` of the parts is exact across proxies.
An instance counts under one model, its base model (not a LoRA adapter),
so that the rows of a pool add up to the pool.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from twisted.application.internet import TimerService
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from nixl_twisted.backends.capacity import has_room
from nixl_twisted.backends.instances import Instance

if TYPE_CHECKING:
    from nixl_twisted.backends.pools import BackendPool

log = Logger()

#: Seconds between a worker's samples of its parts (one scraped answers with its own now).
SAMPLE = 1.0
#: The queue's outcomes that refuse a request for want of slots (``admission.outcomes``' names).
REFUSED = frozenset({"queue_full", "timed_out", "shed", "pushed_out"})
#: The parts, by metric name: their place in a row (slots in use, queued, slots).
IN_USE, QUEUED, SLOTS = (
    "nixlproxy_pool_slots_in_use",
    "nixlproxy_pool_queued",
    "nixlproxy_pool_slots",
)
PARTS = {IN_USE: 0, QUEUED: 1, SLOTS: 2}

#: A request waiting in the proxy's queue: (the pool it found full, "" when it waits
#: behind another of its model; its model or ""; ...).
Waiting = Sequence[str]


def model_of(instance: Instance) -> str:
    """The one model ``instance``'s slots count under: the base model its ``/v1/models``
    names (a LoRA adapter's card has a ``parent``), else its ``[models.NAME]``, else ""."""
    if instance.models:
        bases = sorted(m for m, card in instance.models.items() if not card.get("parent"))
        return (bases or sorted(instance.models))[0]
    return sorted(instance.named)[0] if instance.named else ""


def model_label(pool: BackendPool, model: str | None) -> str:
    """The row a request for ``model`` (None: any) counts in: its instances' model."""
    for instance in pool.instances:
        if model is None or instance.serves(model):
            return model_of(instance)
    return model or ""


def full_pool(pools: Iterable[BackendPool], model: str | None) -> BackendPool | None:
    """The pool whose instances serving ``model`` have no room now, decode first (a
    request takes its decode slot first); None: neither."""
    for pool in sorted(pools, key=lambda p: p.role != "decode"):
        now = pool.clock.seconds()
        serving = [
            i for i in pool.instances if not i.draining and (model is None or i.serves(model))
        ]
        if serving and not any(has_room(i, now) for i in serving):
            return pool
    return None


def saturation_of(families: Iterable[Metric]) -> GaugeMetricFamily:
    """``nixlproxy_pool_saturation`` from the parts' families (one process's, or summed)."""
    rows: dict[tuple[str, str], list[float]] = {}
    for family in families:
        place = PARTS.get(family.name)
        if place is None:
            continue
        for sample in family.samples:
            key = (sample.labels["pool"], sample.labels["model"])
            rows.setdefault(key, [0.0, 0.0, 0.0])[place] += sample.value
    ratio = GaugeMetricFamily(
        "nixlproxy_pool_saturation",
        "(slots in use + requests queued for the pool) / slots, by pool and model: what to "
        "scale the vLLM pools by (docs/metrics.md); left out while the pool has no slot up.",
        labels=["pool", "model"],
    )
    for key, (in_use, queued, slots) in sorted(rows.items()):
        if slots > 0:
            ratio.add_metric(list(key), (in_use + queued) / slots)
    return ratio


class Saturation(Collector):
    """The parts of each pool's saturation, sampled from the pools and the queue, and the
    ratio of this process's parts (registered with the proxy's registry)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        pools: Sequence[BackendPool],
        queued: Callable[[], Iterable[Waiting]] | None = None,
    ) -> None:
        """``queued``: each request waiting in the proxy's queue, as (pool, model, ...)."""
        self._pools = self.pools = pools
        self._queued = queued
        self._shown: set[tuple[str, str]] = set()
        labels = ["pool", "model"]
        self.in_use = Gauge(
            IN_USE,
            "Legs the pool's capped instances serve now, by pool and model.",
            labels,
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.queued = Gauge(
            QUEUED,
            "Requests waiting in the proxy's queue that found the pool full, by pool and model.",
            labels,
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.slots = Gauge(
            SLOTS,
            "Legs the pool's capped instances that are up and not draining may take at once "
            "(their caps), by pool and model.",
            labels,
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.refused = Counter(
            "nixlproxy_pool_refused",
            "Requests the proxy's queue refused for want of the pool's slots (queue_full, "
            "timed_out, shed), by pool and model.",
            labels,
            registry=registry,
        )
        registry.register(self)

    def reads(self, queued: Callable[[], Iterable[Waiting]] | None) -> None:
        """The queue to read from now on (the root's, made after the metrics)."""
        self._queued = queued

    def collect(self) -> Iterator[Metric]:
        parts = (self.in_use, self.queued, self.slots)
        yield saturation_of(family for part in parts for family in part.collect())

    def sample(self) -> None:
        """The parts as the pools and the queue hold them now; a row gone is said as 0."""
        rows: dict[tuple[str, str], list[float]] = {}
        for pool in self._pools:
            for instance in pool.instances:
                if instance.slots is None:
                    continue  # (no cap: no part of the ratio)
                if not instance.healthy and not instance.in_flight:
                    continue  # (nothing to count: no row yet for one not checked yet)
                row = rows.setdefault((pool.role, model_of(instance)), [0.0, 0.0, 0.0])
                row[0] += instance.in_flight
                if instance.healthy and not instance.draining:
                    row[2] += instance.cap_share or 0.0
        roles = {pool.role: pool for pool in self._pools}
        waiting = list(self._queued() if self._queued is not None else ())
        # One behind another of its model waits for what that one found full.
        heads = {model: role for role, model, *_ in reversed(waiting) if role}
        for role, model, *_ in waiting:
            role = role or heads.get(model, "decode")
            found = roles.get(role)
            label = model_label(found, model or None) if found is not None else model
            rows.setdefault((role, label), [0.0, 0.0, 0.0])[1] += 1
        for key in self._shown - rows.keys():
            rows[key] = [0.0, 0.0, 0.0]  # (a worker's file keeps what was set last)
        for key, (in_use, queued, slots) in rows.items():
            self.in_use.labels(*key).set(in_use)
            self.queued.labels(*key).set(queued)
            self.slots.labels(*key).set(slots)
        self._shown.update(rows)

    def told(self, outcome: str, model: str | None) -> None:
        """A request's outcome at the proxy's queue: a refusal is counted against the pool
        it found full (decode when neither is now)."""
        if outcome not in REFUSED:
            return
        decode = next((p for p in self._pools if p.role == "decode"), None)
        pool = full_pool(self._pools, model) or decode
        if pool is None:
            self.refused.labels("decode", model or "").inc()
        else:
            self.refused.labels(pool.role, model_label(pool, model)).inc()


class Summed(Collector):
    """Every worker's metrics summed from their files (prometheus_client's multiprocess
    collector, read afresh), and the saturation worked out from those sums."""

    def __init__(self, path: str) -> None:
        self._path = path

    def collect(self) -> Iterator[Metric]:
        families = list(MultiProcessCollector(None, path=self._path).collect())
        yield from families
        yield saturation_of(families)


class Sampling(TimerService):
    """A worker writes its parts to its file every ``SAMPLE`` seconds, for the scrapes
    another worker answers."""

    def __init__(self, saturation: Saturation, clock: IReactorTime) -> None:
        super().__init__(SAMPLE, self._sample)
        self.clock = clock
        self._saturation = saturation

    def _sample(self) -> None:
        try:
            self._saturation.sample()
        except Exception:  # (a loop that raised would stop for good)
            log.failure("sampling the pools' saturation failed")
