"""The status page's charts, read from the counters' samples (``observe.history``)."""

from __future__ import annotations

import math

from nixl_twisted.observe.history import Sample, point, quantile


def test_a_quantile_is_interpolated_within_its_bucket_as_prometheus_does() -> None:
    buckets = {0.1: 0.0, 0.2: 10.0, 0.4: 20.0, math.inf: 20.0}
    assert quantile(0.5, buckets) == 0.2
    assert quantile(0.25, buckets) == 0.15000000000000002
    assert quantile(0.75, buckets) == 0.30000000000000004
    assert quantile(0.5, {0.1: 0.0, math.inf: 0.0}) is None
    assert quantile(0.99, {0.1: 0.0, 1.0: 1.0, math.inf: 5.0}) == 1.0  # (past the last bound)


def test_a_point_reads_rates_over_a_second_and_shares_over_its_window() -> None:
    before = Sample(0.0, decisions={("pd", "default"): 10.0})
    older = Sample(
        9.0, requests=100.0, decisions={("pd", "default"): 12.0}, refused={"queue_full": 1.0}
    )
    newer = Sample(
        10.0,
        requests=104.0,
        decisions={("pd", "default"): 13.0, ("decode_only", "short_prompt"): 1.0},
        refused={"queue_full": 3.0},
        routing={("cache-aware", "prefix"): 3.0, ("cache-aware", "affinity"): 1.0},
    )
    said = point(newer, older, before)
    assert said["requests_per_second"] == 4.0
    assert said["decode_only"] == {"short_prompt": 0.25}  # one of the 4 in the window
    assert said["refused_per_second"] == {"queue_full": 2.0}
    assert said["prefix_hit_rate"] == {"cache-aware": 0.75}
    assert said["first_token_p50"] is None  # (nothing observed)
    assert (said["ttft_outcomes"], said["ttft_on_time"]) == ({}, {})


def test_first_token_outcomes_are_counted_a_second_and_shared_over_the_window() -> None:
    before = Sample(0.0, ttft={("gold", "on_time"): 1.0})
    older = Sample(9.0, ttft={("gold", "on_time"): 4.0, ("gold", "late"): 1.0})
    newer = Sample(
        10.0, ttft={("gold", "on_time"): 6.0, ("gold", "late"): 2.0, ("default", "failed"): 1.0}
    )
    said = point(newer, older, before)
    assert said["ttft_outcomes"] == {"default": {"failed": 1}, "gold": {"late": 1, "on_time": 2}}
    assert said["ttft_on_time"] == {"default": 0.0, "gold": 0.7143}  # 5 of 7 in the window


def test_a_counter_that_went_back_is_a_restart_not_a_negative_rate() -> None:
    said = point(Sample(2.0, requests=3.0), Sample(1.0, requests=50.0), Sample(0.0))
    assert said["requests_per_second"] == 3.0  # (counted again from 0)
