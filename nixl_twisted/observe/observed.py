"""``Observed``: what sees every request, made once and handed to whoever serves one."""

from __future__ import annotations

from dataclasses import dataclass

from nixl_twisted.observe.metrics import ProxyMetrics
from nixl_twisted.observe.refusals import Refusals
from nixl_twisted.observe.tracing import Tracing


@dataclass(frozen=True)
class Observed:
    """The proxy's metrics, its traces, and the refusals' counts and log lines."""

    metrics: ProxyMetrics
    tracing: Tracing
    refusals: Refusals
