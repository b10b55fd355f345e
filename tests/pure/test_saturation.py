"""Each pool's saturation by model, ``(slots in use + queued) / slots``, as /metrics says it,
and the queue's refusals counted against the pool it found full."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client.parser import text_string_to_metric_families
from twisted.internet.task import Clock

from nixl_twisted.backends.capacity import Caps
from nixl_twisted.backends.health import State
from nixl_twisted.backends.pools import BackendPool
from nixl_twisted.observe.metrics import ProxyMetrics
from nixl_twisted.observe.saturation import SAMPLE, Sampling
from nixl_twisted.observe.scrape_metrics import ScrapeMetrics

Rows = dict[tuple[str, str], float]


def scraped(metrics: ProxyMetrics, name: str) -> Rows:
    """One metric of a scrape, by (pool, model)."""
    text = metrics.exposition().decode()
    return {
        (sample.labels["pool"], sample.labels["model"]): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


def pools(decode: Sequence[str], prefill: Sequence[str] = ("http://p:1",)) -> list[BackendPool]:
    clock = Clock()
    return [BackendPool("prefill", prefill, clock), BackendPool("decode", decode, clock)]


def hold(pool: BackendPool, legs: int, at: int = 0) -> None:
    for _ in range(legs):
        pool.lease(pool.instances[at])


def queueing(metrics: ProxyMetrics, queued: list[tuple[str, str, str]]) -> ProxyMetrics:
    """``metrics`` reading a queue that holds ``queued`` (as the root makes it read one)."""
    metrics.read_at_scrape(ScrapeMetrics(metrics.saturation.pools, queued=lambda: queued))
    return metrics


def test_the_ratio_is_the_slots_in_use_and_the_queued_over_the_slots() -> None:
    prefill, decode = pools(
        ["http://d1:1#max-in-flight=4", "http://d2:1#max-in-flight=4", "http://d3:1"],
        ["http://p1:1#max-in-flight=1"],
    )
    hold(decode, 4, at=0)
    hold(decode, 2, at=1)
    hold(decode, 5, at=2)  # (no cap: no part of the ratio)
    hold(prefill, 1)
    queued = [("decode", "", "team-a")] * 3 + [("prefill", "", "")]
    metrics = queueing(ProxyMetrics([prefill, decode]), queued)
    assert scraped(metrics, "nixlproxy_pool_slots_in_use") == {
        ("decode", ""): 6.0,
        ("prefill", ""): 1.0,
    }
    assert scraped(metrics, "nixlproxy_pool_slots") == {("decode", ""): 8.0, ("prefill", ""): 1.0}
    assert scraped(metrics, "nixlproxy_pool_queued") == {("decode", ""): 3.0, ("prefill", ""): 1.0}
    assert scraped(metrics, "nixlproxy_pool_saturation") == {
        ("decode", ""): (6 + 3) / 8,
        ("prefill", ""): (1 + 1) / 1,
    }


def test_an_instance_down_or_draining_gives_no_slots_but_its_legs_still_count() -> None:
    prefill, decode = pools(["http://d1:1", "http://d2:1", "http://d3:1"])
    decode.use_caps(Caps(default=2))
    hold(decode, 2, at=0)
    hold(decode, 1, at=1)
    decode.instances[1].state = State.DOWN
    decode.instances[2].draining = True
    metrics = ProxyMetrics([prefill, decode])
    assert scraped(metrics, "nixlproxy_pool_saturation") == {("decode", ""): 3 / 2}


def test_each_worker_counts_its_share_of_a_cap() -> None:
    shares = []
    for worker in (0, 1, 2):
        prefill, decode = pools(["http://d1:1"])
        decode.use_caps(Caps(default=10, worker=worker, workers=3))
        shares.append(scraped(ProxyMetrics([prefill, decode]), "nixlproxy_pool_slots"))
    assert sum(share[("decode", "")] for share in shares) == 10.0


def test_an_instance_counts_under_its_base_model_and_an_adapters_queue_with_it() -> None:
    prefill, decode = pools(
        ["http://d1:1#max-in-flight=2", "http://d2:1#max-in-flight=2", "http://d3:1"]
    )
    base = {"id": "llama", "parent": None}
    decode.instances[0].models = {"llama": base, "sql-lora": {"id": "sql-lora", "parent": "llama"}}
    decode.instances[1].models = {"qwen": {"id": "qwen", "parent": None}}
    decode.instances[2].models = {"llama": base}  # (no cap: in no row)
    hold(decode, 1, at=0)
    queued = [("decode", "sql-lora", ""), ("decode", "llama", ""), ("decode", "qwen", "")]
    metrics = queueing(ProxyMetrics([prefill, decode]), queued)
    assert scraped(metrics, "nixlproxy_pool_saturation") == {
        ("decode", "llama"): (1 + 2) / 2,
        ("decode", "qwen"): (0 + 1) / 2,
    }
    # The rows of a pool add up to the pool.
    assert sum(scraped(metrics, "nixlproxy_pool_slots").values()) == 4.0


def test_a_row_that_went_is_said_as_nothing_not_as_it_was() -> None:
    prefill, decode = pools(["http://d1:1#max-in-flight=2", "http://d2:1#max-in-flight=2"])
    decode.instances[0].named = frozenset({"gone"})
    hold(decode, 1, at=0)
    metrics = ProxyMetrics([prefill, decode])
    assert scraped(metrics, "nixlproxy_pool_slots_in_use") == {
        ("decode", "gone"): 1,
        ("decode", ""): 0,
    }
    decode.instances.pop(0)
    assert scraped(metrics, "nixlproxy_pool_slots_in_use") == {
        ("decode", "gone"): 0,
        ("decode", ""): 0,
    }
    assert scraped(metrics, "nixlproxy_pool_saturation") == {("decode", ""): 0.0}


def test_a_refusal_counts_against_the_pool_found_full() -> None:
    prefill, decode = pools(["http://d1:1#max-in-flight=1"], ["http://p1:1#max-in-flight=1"])
    metrics = ProxyMetrics([prefill, decode])
    hold(prefill, 1)
    metrics.saturation.told("queue_full", None)  # decode has room: prefill held it
    hold(decode, 1)
    for outcome in ("timed_out", "shed", "at_once", "after_wait", "left", "shut", "failed"):
        metrics.saturation.told(outcome, None)
    assert scraped(metrics, "nixlproxy_pool_refused_total") == {
        ("prefill", ""): 1.0,
        ("decode", ""): 2.0,
    }


def test_a_worker_writes_its_parts_every_second_without_being_scraped() -> None:
    prefill, decode = pools(["http://d1:1#max-in-flight=2"])
    metrics = ProxyMetrics([prefill, decode])
    clock = Clock()
    sampling = Sampling(metrics.saturation, clock)
    sampling.startService()
    in_use = {"pool": "decode", "model": ""}
    assert metrics.registry.get_sample_value("nixlproxy_pool_slots_in_use", in_use) == 0.0
    hold(decode, 2)
    clock.advance(SAMPLE / 2)
    assert metrics.registry.get_sample_value("nixlproxy_pool_slots_in_use", in_use) == 0.0
    clock.advance(SAMPLE / 2)
    assert metrics.registry.get_sample_value("nixlproxy_pool_slots_in_use", in_use) == 2.0
    sampling.stopService()


def test_an_instance_not_checked_yet_makes_no_row_of_its_own() -> None:
    clock = Clock()
    decode = BackendPool("decode", ["http://d1:1#max-in-flight=2"], clock, checked=True)
    metrics = ProxyMetrics([BackendPool("prefill", ["http://p:1"], clock), decode])
    assert scraped(metrics, "nixlproxy_pool_slots") == {}  # (its model not read yet)
    decode.instances[0].state = State.UP
    decode.instances[0].models = {"fake-model": {"id": "fake-model"}}
    assert scraped(metrics, "nixlproxy_pool_slots") == {("decode", "fake-model"): 2.0}
