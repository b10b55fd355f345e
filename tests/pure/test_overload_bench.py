"""``bench.overload``'s definitions: the fleet's capacity, the arrivals, goodput and shares.

The figures docs/performance.md prints come from these; the run itself is
a smoke test (``tests/smoke/test_bench.py``).
"""

from __future__ import annotations

import pytest

from bench.open_loop import Gauges, Outcome, arrivals
from bench.overload import Fleet, summary
from nixl_twisted.testing.prefix_cache import prompt_tokens


def test_the_fleets_capacity_is_what_its_decodes_complete_unless_prefill_computes_fewer() -> None:
    fleet = Fleet(2, 2, max_num_seqs=4, tokens=32, token_interval=0.05, prefill_cost=0.0)
    # A chat stream: its role event, 32 tokens and [DONE], 0.05 s apart.
    assert fleet.capacity == pytest.approx(2 * 4 / (33 * 0.05))
    slow = Fleet(2, 2, max_num_seqs=4, tokens=32, token_interval=0.05, prefill_cost=0.01)
    computed = len(prompt_tokens(slow.body(0, "a")))
    assert slow.capacity == pytest.approx(2 * 4 / (computed * 0.01))
    assert slow.capacity < fleet.capacity


def test_each_prompt_is_its_own_so_no_prefill_finds_another_in_its_cache() -> None:
    fleet = Fleet(1, 1, max_num_seqs=1, tokens=4, token_interval=0.01, prefill_cost=0.001)
    first, second = (prompt_tokens(fleet.body(n, "a")) for n in (1, 2))
    assert first[:4] != second[:4]


def test_arrivals_are_seeded_and_the_tenants_send_the_same_amount() -> None:
    def body(number: int, tenant: str) -> dict[str, object]:
        return {"n": number}

    timed = arrivals(10.0, ["a", "b"], 7, body, seconds=100.0, count=None)
    assert timed == arrivals(10.0, ["a", "b"], 7, body, seconds=100.0, count=None)
    assert timed != arrivals(10.0, ["a", "b"], 8, body, seconds=100.0, count=None)
    assert 900 < len(timed) < 1100 and timed[-1].at <= 100.0
    assert [a.tenant for a in timed[:4]] == ["a", "b", "a", "b"]
    counted = arrivals(10.0, ["a", "b"], 7, body, seconds=0.0, count=5)
    assert [a.at for a in counted] == [a.at for a in timed[:5]]


def test_goodput_counts_first_tokens_within_the_bound_that_came_within_the_window() -> None:
    outcomes = [
        Outcome("a", 200, ttft=1.0, first_at=2.0, served=True),  # good
        Outcome("b", 200, ttft=6.0, first_at=7.0, served=True),  # past the bound
        Outcome("a", 200, ttft=1.0, first_at=11.0, served=True),  # after the window
        Outcome("b", 503, retry_after=True),
        Outcome("a", 0),  # no answer
        Outcome("b", 200, served=False),  # a stream that broke
    ]
    gauges = Gauges({"decode": [0.0, 4.0, 2.0], "prefill": [1.0]})
    result = summary(outcomes, gauges, window=10.0, capacity=0.2, bound=5.5)
    assert (result["goodput"], result["goodput_share"]) == (0.1, 0.5)
    assert (result["served"], result["ttft_p50_s"], result["ttft_p99_s"]) == (3, 1.0, 6.0)
    assert result["refused"] == {"0": 0.167, "200": 0.167, "503": 0.167}
    assert result["refusals_with_retry_after"] == 1
    assert result["waiting"] == {
        "decode": {"mean": 2.0, "max": 4.0},
        "prefill": {"mean": 1.0, "max": 1.0},
    }
    assert result["served_shares"] == {"a": 0.667, "b": 0.333}
    assert result["good_shares"] == {"a": 1.0, "b": 0.0}
