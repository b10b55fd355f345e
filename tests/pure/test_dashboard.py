"""The Grafana dashboard in docs/ asks only for metrics the proxy really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from twisted.internet.task import Clock

from nixl_twisted.backends.pools import BackendPool
from nixl_twisted.observe.metrics import ProxyMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported() -> set[str]:
    pool = BackendPool("decode", ["http://d:1"], Clock())
    names: set[str] = set()
    for family in ProxyMetrics([pool]).registry.collect():
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
    return names


def test_every_query_names_an_exported_metric() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    asked = {name for query in queries for name in re.findall(r"nixlproxy_[a-z_]+", query)}
    assert asked, "the dashboard asks for nothing"
    assert asked <= exported(), asked - exported()


def test_the_dashboard_covers_what_an_operator_looks_at() -> None:
    text = DASHBOARD.read_text(encoding="utf-8")
    wanted = (
        "nixlproxy_requests_total",
        "nixlproxy_time_to_first_byte_seconds_bucket",
        "nixlproxy_prefill_seconds_bucket",
        "nixlproxy_backend_healthy",
        "nixlproxy_backend_in_flight",
        "nixlproxy_retries_total",
        "nixlproxy_client_disconnects_total",
        "nixlproxy_requests_in_flight",
        "nixlproxy_pool_refused_total",
    )
    for metric in wanted:
        assert metric in text, metric


def test_the_dashboard_shows_each_pools_saturation_as_the_docs_and_keda_work_it_out() -> None:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    queries = [" ".join(t["expr"].split()) for p in dashboard["panels"] for t in p["targets"]]
    part = 'sum by (pool, model) (nixlproxy_pool_{}{{job=~"$job"}})'
    saturation = (
        f"({part.format('slots_in_use')} + {part.format('queued')}) / {part.format('slots')}"
    )
    assert saturation in queries
