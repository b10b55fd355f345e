"""``bench.goodput``'s definitions: the shapes' prompts, the targets, goodput against each
request's own target.

The figures docs/performance.md prints come from these; the run itself is a smoke test
(``tests/smoke/test_bench.py``).
"""

from __future__ import annotations

import pytest

from bench.goodput import SHAPES, figures, targeted, targets_of
from bench.open_loop import Arrival, Gauges, Outcome
from bench.overload import Fleet
from nixl_twisted.testing.prefix_cache import prompt_tokens


def test_a_shapes_prompts_have_its_tokens_and_prefill_its_seconds() -> None:
    today, mixed = SHAPES["today"], SHAPES["mixed"]
    assert len(prompt_tokens(today.body(3, "a"))) == 258
    assert today.prefill_seconds == pytest.approx(0.129)
    assert SHAPES["third"].prefill_seconds == pytest.approx(0.3)
    lengths = [len(prompt_tokens(mixed.body(n, "b"))) for n in range(400)]
    assert set(lengths) == {258, 1000} and lengths.count(1000) == pytest.approx(100, abs=2)
    first, second = (prompt_tokens(today.body(n, "a")) for n in (1, 2))
    assert first[:8] != second[:8]


def test_targets_are_milliseconds_with_shares_that_sum_to_one() -> None:
    assert targets_of("5500") == [(5.5, 1.0)]
    assert targets_of("1000:0.5,10000:0.5") == [(1.0, 0.5), (10.0, 0.5)]
    for bad in ("1000:0.5", "0", "1000:0.5,-1:0.5"):
        with pytest.raises(ValueError, match="--targets"):
            targets_of(bad)


def test_each_tenant_sends_each_target_its_share() -> None:
    planned = [Arrival(i / 10, "ab"[i % 2], b"{}") for i in range(400)]
    chosen = targeted(planned, [(1.0, 0.5), (10.0, 0.5)])
    for tenant in "ab":
        mine = [t for a, t in zip(planned, chosen, strict=True) if a.tenant == tenant]
        assert mine.count(1.0) == pytest.approx(100, abs=2)
        assert {1.0, 10.0} == set(mine[:2])  # spread, not the first half then the second


def test_goodput_counts_each_first_token_against_its_own_target() -> None:
    fleet = Fleet(2, 2, max_num_seqs=1, tokens=9, token_interval=0.1, prefill_cost=0.0)
    outcomes = [
        Outcome("a", 200, ttft=0.5, first_at=1.0, served=True, answered=0.1),  # within 1 s
        Outcome("b", 200, ttft=2.0, first_at=3.0, served=True, answered=0.1),  # 1 s: late
        Outcome("a", 200, ttft=2.0, first_at=3.0, served=True, answered=0.1),  # 10 s: good
        Outcome("b", 503, retry_after=True, answered=0.5),  # refused within its 1 s
        Outcome("a", 503, retry_after=True, answered=4.0),  # refused past its 1 s
        Outcome("b", 0),  # no answer
    ]
    targets = [1.0, 1.0, 10.0, 1.0, 1.0, 10.0]
    gauges = Gauges({"decode": [1.0, 3.0]}, {"decode": [2.0, 1.0]})
    result = figures(outcomes, targets, gauges, window=10.0, fleet=fleet)
    # Decode capacity: 2 x 1 / 1 s; two good first tokens in 10 s.
    assert (result["goodput"], result["goodput_share"]) == (0.2, 0.1)
    assert (result["late_share"], result["late_by_target"]) == (
        0.333,
        {"1 s": 0.5, "10 s": 0.0},
    )
    assert (result["refusals"], result["refused_inside_target"]) == (3, 1)
    assert result["decode_busy"] == 0.75
    assert result["served_ratio"] == 2.0
