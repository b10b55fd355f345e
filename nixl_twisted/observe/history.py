"""``History``: the last minutes of the proxy's counters, sampled once a second while looked at.

The status page's charts are differences between samples of the counters and
histograms requests already move (``metrics.ProxyMetrics.sampled``: this
process's, or under ``--workers`` every worker's summed as ``/metrics`` sums
them). Nothing is sampled until the page or its JSON is asked for; sampling
stops a minute after the last time it was (``LOOKED_AT``), so a proxy nobody
looks at does no work for it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import Metric
from twisted.application.service import Service
from twisted.internet.interfaces import IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from nixl_twisted.backends.policies import finds_prefixes
from nixl_twisted.protocol import routes

log = Logger()

#: Seconds between samples, points kept (five minutes), and how long after the last look
#: sampling goes on.
INTERVAL = 1.0
KEPT = 300
LOOKED_AT = 60.0
#: Seconds of samples each quantile and share is read over: a point is the last 10 s.
WINDOW = 10
#: The routing decisions that found the prompt's prefix where they sent it (``routing.md``),
#: of the policies that look for one.
HITS = frozenset({"prefix", "kv_match", "kv_predicted"})
#: The routes whose requests the chart counts: the clients', not the proxy's own.
_OWN = frozenset(
    {
        routes.HEALTH,
        routes.HEALTHCHECK,
        routes.METRICS,
        routes.ADMIN_BACKENDS,
        routes.ADMIN_DRAIN,
        *routes.STATUS,
    }
)


@dataclass
class Sample:
    """The counters' totals at one moment (each only grows, or restarts from 0)."""

    time: float
    requests: float = 0.0
    #: Cumulative bucket counts by upper bound, as Prometheus' ``le``.
    first_token: dict[float, float] = field(default_factory=dict)
    handoff: dict[float, float] = field(default_factory=dict)
    #: Completions by (decision, reason), routing decisions by (policy, decision),
    #: refusals by reason.
    decisions: dict[tuple[str, str], float] = field(default_factory=dict)
    routing: dict[tuple[str, str], float] = field(default_factory=dict)
    refused: dict[str, float] = field(default_factory=dict)
    #: First-token outcomes by (tenant class, outcome).
    ttft: dict[tuple[str, str], float] = field(default_factory=dict)


def sample_of(families: Iterable[Metric], now: float) -> Sample:
    """One ``Sample`` read from the families of ``ProxyMetrics.sampled``."""
    taken = Sample(now)
    for family in families:
        for s in family.samples:
            labels, value = s.labels, s.value
            if s.name == "nixlproxy_requests_total":
                if labels.get("route") not in _OWN:
                    taken.requests += value
            elif s.name == "nixlproxy_time_to_first_byte_seconds_bucket":
                if labels.get("route") not in _OWN:
                    _add(taken.first_token, float(labels["le"]), value)
            elif s.name == "nixlproxy_handoff_gap_seconds_bucket":
                _add(taken.handoff, float(labels["le"]), value)
            elif s.name == "nixlproxy_disaggregation_decisions_total":
                _add(taken.decisions, (labels["decision"], labels["reason"]), value)
            elif s.name == "nixlproxy_routing_decisions_total":
                _add(taken.routing, (labels["policy"], labels["decision"]), value)
            elif s.name == "nixlproxy_refused_total":
                _add(taken.refused, labels["reason"], value)
            elif s.name == "nixlproxy_ttft_outcomes_total":
                _add(taken.ttft, (labels["tenant_class"], labels["outcome"]), value)
    return taken


def _add(into: dict[Any, float], key: Any, value: float) -> None:
    into[key] = into.get(key, 0.0) + value


def _grown(new: dict[Any, float], old: dict[Any, float]) -> dict[Any, float]:
    """What each counter grew by (a counter that went back, a restart: its new value)."""
    return {k: (v - old.get(k, 0.0) if v >= old.get(k, 0.0) else v) for k, v in new.items()}


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The ``q`` quantile of cumulative ``buckets`` (upper bound -> count), interpolated
    within its bucket as Prometheus' ``histogram_quantile``; None with no observation."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    below, lower = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower  # (past the last finite bucket: its bound, as Prometheus says)
            inside = count - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 0.0)
        below, lower = count, bound
    return lower


def _shares(grown: dict[tuple[str, str], float], hit: Callable[[str], bool]) -> dict[str, float]:
    """For each first label, the share of its counts whose second label is ``hit``."""
    totals: dict[str, float] = {}
    hits: dict[str, float] = {}
    for (first, second), count in grown.items():
        _add(totals, first, count)
        if hit(second):
            _add(hits, first, count)
    return {k: round(hits.get(k, 0.0) / v, 4) for k, v in sorted(totals.items()) if v > 0}


def point(newer: Sample, older: Sample, before: Sample) -> dict[str, Any]:
    """One chart point at ``newer``: rates over the last second (since ``older``), quantiles
    and shares over the last ``WINDOW`` seconds (since ``before``)."""
    seconds = max(newer.time - older.time, 1e-9)
    first_token = _grown(newer.first_token, before.first_token)
    handoff = _grown(newer.handoff, before.handoff)
    decisions = _grown(newer.decisions, before.decisions)
    completions = sum(decisions.values())
    decode_only = {
        reason: round(count / completions, 4)
        for (decision, reason), count in sorted(decisions.items())
        if decision == "decode_only" and count > 0
    }
    requests = newer.requests - older.requests
    requests = requests if requests >= 0 else newer.requests  # (a restart, from 0)
    refused = _grown(newer.refused, older.refused)
    outcomes: dict[str, dict[str, int]] = {}
    for (tenant_class, outcome), count in sorted(_grown(newer.ttft, older.ttft).items()):
        if count:
            outcomes.setdefault(tenant_class, {})[outcome] = round(count)
    return {
        "time": round(newer.time, 3),
        "requests_per_second": round(requests / seconds, 3),
        "first_token_p50": _rounded(quantile(0.5, first_token)),
        "first_token_p99": _rounded(quantile(0.99, first_token)),
        "handoff_p50": _rounded(quantile(0.5, handoff)),
        "handoff_p99": _rounded(quantile(0.99, handoff)),
        "decode_only": decode_only,
        "prefix_hit_rate": _shares(
            {
                k: v
                for k, v in _grown(newer.routing, before.routing).items()
                if finds_prefixes(k[0])
            },
            HITS.__contains__,
        ),
        "refused_per_second": {
            reason: round(count / seconds, 3) for reason, count in sorted(refused.items()) if count
        },
        "ttft_outcomes": outcomes,
        "ttft_on_time": _shares(_grown(newer.ttft, before.ttft), "on_time".__eq__),
    }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


class History(Service):
    """Samples the counters once a second while the page is looked at; the last ``KEPT``
    points of the charts, each made once, as its sample is taken."""

    def __init__(self, clock: IReactorTime, families: Callable[[], Iterable[Metric]]) -> None:
        self.clock = clock
        self._families = families
        #: The last ``WINDOW`` + 1 samples, and the points made of them as each came.
        self._samples: deque[Sample] = deque(maxlen=WINDOW + 1)
        self._points: deque[dict[str, Any]] = deque(maxlen=KEPT)
        self._looked_at = -math.inf
        self._loop: LoopingCall | None = None

    def looked_at(self) -> None:
        """The page or its JSON was asked for: sample (again) from now on, for ``LOOKED_AT`` s."""
        self._looked_at = self.clock.seconds()
        if self.running and (self._loop is None or not self._loop.running):
            self._loop = LoopingCall(self._sample)
            self._loop.clock = self.clock
            self._loop.start(INTERVAL, now=True).addErrback(
                lambda failure: log.failure("status page sampling stopped", failure)
            )

    @property
    def sampling(self) -> bool:
        return self._loop is not None and self._loop.running

    def _sample(self) -> None:
        now = self.clock.seconds()
        if now - self._looked_at > LOOKED_AT:
            self._stop()
            return
        try:
            taken = sample_of(self._families(), now)
        except Exception:  # (a loop that raises dies: this one says why and samples on)
            log.failure("status page: the counters could not be sampled")
            return
        samples = self._samples
        samples.append(taken)
        if len(samples) > 1:
            self._points.append(point(taken, samples[-2], samples[0]))

    def points(self) -> list[dict[str, Any]]:
        """The charts' points, oldest first (none until two samples are taken)."""
        return list(self._points)

    def ttft_last_minute(self) -> dict[str, dict[str, int]]:
        """First-token outcomes by tenant class, then outcome, over the last minute's points
        (what was sampled of it: nothing before the page was first looked at)."""
        since = self.clock.seconds() - 60.0
        summed: dict[str, dict[str, int]] = {}
        for taken in self._points:
            if taken["time"] > since:
                for tenant_class, outcomes in taken["ttft_outcomes"].items():
                    into = summed.setdefault(tenant_class, {})
                    for outcome, count in outcomes.items():
                        into[outcome] = into.get(outcome, 0) + count
        return summed

    def _stop(self) -> None:
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._samples.clear()
        self._points.clear()  # (a gap of minutes is not drawn as a line across it)

    def stopService(self) -> None:
        super().stopService()
        self._stop()
