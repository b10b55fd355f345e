"""First-token deadlines: the rates measured, the prediction, early refusal, the latest
start and the earliest deadline first within a tenant, by a Clock."""

from __future__ import annotations

import heapq
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from nixl_twisted.admission.deadlines import (
    MISS_FACTOR,
    MISS_SLACK,
    fleet_refusal,
    fleet_too_late,
    misses,
    unreachable,
)
from nixl_twisted.admission.fair_queue import FairQueue
from nixl_twisted.admission.outcomes import TTFT_REFUSED
from nixl_twisted.admission.predictor import MEASURED, Rates, predict
from nixl_twisted.admission.waiting import Claim as Ticket
from nixl_twisted.config import TenantRule
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.errors import ProxyError
from nixl_twisted.protocol.targets import Target
from tests.pure.test_fair_queue import Slots, outcome


def legs(
    prefill: float | None = 0.2,
    first_byte: float | None = 0.05,
    predicted: float | None = None,
    actual: float | None = None,
    target_ms: int = 1000,
    prompt: int | None = None,
) -> Any:
    """An access record's leg times (and its first token, with what was predicted of it)."""
    return SimpleNamespace(
        prefill_seconds=prefill,
        decode_first_byte_seconds=first_byte,
        ttft_predicted_base_seconds=predicted,
        time_to_first_byte_seconds=actual,
        ttft_target=Target(target_ms, "x-slo-ttft-ms"),
        prompt_estimate=prompt,
    )


def warmed(clock: Clock, rate: float = 10.0, model: str | None = None, **times: Any) -> Rates:
    """Rates that saw ``MEASURED`` decode slots free at ``rate`` per second."""
    rates = Rates(clock)
    for _ in range(MEASURED):
        rates.ended(model, legs(**times), prefilled=True)
        clock.advance(1 / rate)
    return rates


def targeted(tenant: str, ms: int | None, weight: float = 1.0, miss: str = "refuse") -> Ticket:
    target = None if ms is None else Target(ms, "x-slo-ttft-ms")
    return Ticket(tenant, TenantRule(weight=weight, ttft_miss=miss), target=target)


def fair_queue(rate: float = 10.0, **times: Any) -> tuple[FairQueue[Any], Clock, list[str]]:
    clock = Clock()
    said: list[str] = []
    rates = warmed(clock, rate, **times)
    fair: FairQueue[Any] = FairQueue(clock, 1000, 30.0, lambda o, w, t: said.append(o), rates)
    return fair, clock, said


# -- the rates ----------------------------------------------------------------------------


def test_nothing_is_predicted_until_enough_decode_slots_freed() -> None:
    clock = Clock()
    rates = Rates(clock)
    for _ in range(MEASURED - 1):
        rates.ended("m", legs(), prefilled=True)
        clock.advance(0.5)
    assert rates.drain_rate("m") is None and rates.predict("m", 3, 0, 1.0) is None
    rates.ended("m", legs(), prefilled=True)
    assert rates.drain_rate("m") == pytest.approx(2.0)
    assert rates.drain_rate("other") is None  # (each model its own)


def test_leg_times_are_moving_averages_and_a_decode_alone_counts_no_prefill() -> None:
    clock = Clock()
    rates = Rates(clock)
    rates.ended("m", legs(0.2, 0.05), prefilled=True)
    assert (rates.prefill_seconds("m"), rates.first_byte_seconds("m")) == (0.2, 0.05)
    rates.ended("m", legs(1.2, 0.15), prefilled=True)
    assert rates.prefill_seconds("m") == pytest.approx(0.4)
    assert rates.first_byte_seconds("m") == pytest.approx(0.07)
    rates.ended("m", legs(9.0, None), prefilled=False)  # (its prefill was not a leg)
    assert rates.prefill_seconds("m") == pytest.approx(0.4)


def test_releases_older_than_the_horizon_say_nothing() -> None:
    clock = Clock()
    rates = warmed(clock, 4.0, "m")
    assert rates.drain_rate("m") == pytest.approx(4.0)
    clock.advance(61)
    assert rates.drain_rate("m") is None


def test_shared_the_drain_rate_is_the_fleets_grants() -> None:
    clock = Clock()
    rates = warmed(clock, 4.0, "m")
    rates.fleet([float(t) for t in range(10_000, 9_000 - 1, -100)])  # (ms, newest first)
    assert rates.drain_rate("m") == pytest.approx(10.0)
    rates.fleet(None)  # (alone again: its own releases)
    assert rates.drain_rate("m") == pytest.approx(4.0)


# -- the prediction and the refusal ---------------------------------------------------------


def test_the_prediction_overlaps_prefill_with_the_wait() -> None:
    waited = predict(ahead=20, own=2, share=0.5, drain_rate=10, prefill=0.3, first_byte=0.1)
    assert waited.seconds == pytest.approx(2.1) and not waited.tenant_bound
    short = predict(ahead=1, own=0, share=1, drain_rate=10, prefill=0.3, first_byte=0.1)
    assert short.seconds == pytest.approx(0.4)  # (prefill is the wait)
    own = predict(ahead=6, own=5, share=0.25, drain_rate=10, prefill=0.3, first_byte=0.1)
    assert own.seconds == pytest.approx(2.1) and own.tenant_bound


def test_a_miss_is_past_the_target_by_the_margin_and_says_whose_backlog() -> None:
    edge = 1.0 * MISS_FACTOR + MISS_SLACK
    at = predict(ahead=0, own=0, share=1, drain_rate=1, prefill=0.0, first_byte=edge)
    past = predict(ahead=0, own=0, share=1, drain_rate=1, prefill=0.0, first_byte=edge + 0.01)
    assert not misses(at, 1000) and misses(past, 1000)
    fleet = unreachable(predict(30, 2, 0.5, 10, 0.3, 0.1), 1000)
    assert (fleet.code, fleet.retry_after) == (ErrorCode.TTFT_UNREACHABLE, 3.0)
    own = unreachable(predict(6, 5, 0.25, 10, 0.3, 0.1), 1000)
    assert (own.code, own.retry_after) == (ErrorCode.TTFT_UNREACHABLE_FOR_TENANT, 2.0)
    assert (own.code.status, fleet.code.status) == (429, 503)
    soon = unreachable(predict(2, 0, 1, 10, 1.0, 0.1), 100)
    assert soon.retry_after == 1.0  # (at least 1 s)


# -- the queue ------------------------------------------------------------------------------


def test_a_request_predicted_to_miss_is_refused_at_once_with_retry_after() -> None:
    fair, _, said = fair_queue(rate=10.0)
    slots = Slots()  # (decode full: everything waits)
    for n in range(15):
        fair.enter(Ticket(f"t{n}"), slots.place(f"w{n}"))
    with pytest.raises(ProxyError) as refused:
        fair.enter(targeted("late", 1000), slots.place("late"))
    # 15 ahead at 10/s: 1.5 s + 0.05 first byte, past 1 s x 1.1 + 0.05.
    assert refused.value.code == ErrorCode.TTFT_UNREACHABLE
    assert refused.value.retry_after == pytest.approx(1.5)
    assert said[-1] == TTFT_REFUSED and len(fair) == 15
    assert isinstance(fair.enter(targeted("fine", 2000), slots.place("fine")), Deferred)
    assert isinstance(fair.enter(Ticket("none"), slots.place("none")), Deferred)  # no target
    served = targeted("patient", 1000, miss="serve")
    assert isinstance(fair.enter(served, slots.place("patient")), Deferred)


def test_a_tenant_past_its_share_is_refused_429() -> None:
    fair, _, _ = fair_queue(rate=10.0)
    slots = Slots()
    for n in range(8):  # (due before it: let go before it within its tenant)
        fair.enter(targeted("busy", 500, miss="serve"), slots.place(f"busy{n}"))
        fair.enter(Ticket("other", TenantRule(weight=3)), slots.place(f"other{n}"))
    with pytest.raises(ProxyError) as refused:
        fair.enter(targeted("busy", 1000), slots.place("late"))
    # Its 8 waiting at a quarter of 10/s: 3.2 s, more than the 8 + 2 others ahead.
    assert refused.value.code == ErrorCode.TTFT_UNREACHABLE_FOR_TENANT
    assert refused.value.retry_after == pytest.approx(3.2)


def test_a_request_that_can_go_at_once_goes_whatever_its_prediction() -> None:
    fair, _, _ = fair_queue(rate=10.0, prefill=2.0)
    assert fair.enter(targeted("a", 100), Slots(decode=1).place("x")) == ("placed", "x")


def test_nothing_measured_nothing_refused() -> None:
    clock = Clock()
    fair: FairQueue[Any] = FairQueue(clock, 1000, 30.0)
    slots = Slots()
    for n in range(50):
        fair.enter(Ticket(f"t{n}"), slots.place(f"w{n}"))
    assert isinstance(fair.enter(targeted("a", 100), slots.place("a")), Deferred)
    clock.advance(10)
    assert len(fair) == 51  # (no latest start without a prediction)


def test_still_waiting_at_its_latest_start_it_is_refused_inside_its_target() -> None:
    fair, clock, said = fair_queue(rate=10.0, prefill=0.2, first_byte=0.05)
    slots = Slots()
    for n in range(5):
        fair.enter(Ticket(f"t{n}"), slots.place(f"w{n}"))
    waiting = fair.enter(targeted("a", 1000), slots.place("a"))  # predicted 0.55 s: waits
    clock.advance(0.74)
    assert outcome(waiting) is None
    clock.advance(0.02)  # (its latest start: 1 s - 0.2 s - 0.05 s)
    refused = outcome(waiting)
    assert isinstance(refused, ProxyError) and refused.code == ErrorCode.TTFT_UNREACHABLE
    assert said[-1] == TTFT_REFUSED and len(fair) == 5
    served = fair.enter(targeted("b", 1000, miss="serve"), slots.place("b"))
    clock.advance(5)
    assert outcome(served) is None  # ("serve": never refused for its target)


def test_a_request_let_go_before_its_latest_start_is_not_refused_after() -> None:
    fair, clock, _ = fair_queue(rate=10.0)
    slots = Slots()
    waiting = fair.enter(targeted("a", 1000), slots.place("a"))
    slots.free["decode"] = 1
    fair.pump()
    clock.advance(5)
    assert outcome(waiting) == ("placed", "a")


def test_within_a_tenant_the_earliest_deadline_goes_first_across_tenants_the_tags() -> None:
    fair, _, _ = fair_queue(rate=1000.0)  # (fast: nothing is refused)
    slots = Slots()
    fair.enter(Ticket("a"), slots.place("a-none"))
    fair.enter(targeted("a", 9000), slots.place("a-9s"))
    fair.enter(targeted("b", 5000), slots.place("b-5s"))
    fair.enter(targeted("a", 1000), slots.place("a-1s"))
    for _ in range(4):
        slots.free["decode"] = 1
        fair.pump()
    assert slots.placed == ["a-1s", "b-5s", "a-9s", "a-none"]


def test_a_serve_request_past_its_deadline_is_demoted() -> None:
    fair, clock, _ = fair_queue(rate=1000.0)
    slots = Slots()
    for ticket, name in (
        (Ticket("a"), "a-none"),
        (targeted("a", 500, miss="serve"), "a-late"),
        (targeted("a", 3000), "a-3s"),
    ):
        fair.enter(ticket, slots.place(name))
        clock.advance(0.1)
    clock.advance(1)  # (a-late's deadline passed: ordered as no target, by arrival)
    for _ in range(3):
        slots.free["decode"] = 1
        fair.pump()
    assert slots.placed == ["a-3s", "a-none", "a-late"]


@settings(max_examples=60, deadline=None)
@given(
    arrivals=st.lists(
        st.tuples(st.sampled_from("abc"), st.sampled_from([None, 500, 2000, 9000])),
        min_size=5,
        max_size=60,
    ),
    frees=st.lists(st.integers(0, 3), min_size=1, max_size=40),
)
def test_deadlines_reorder_within_a_tenant_never_the_tenants_share(
    arrivals: list[tuple[str, int | None]], frees: list[int]
) -> None:
    """The same arrivals with and without targets: the tenants let go, in order, are the
    same (fairness keeps its tags); each tenant's own requests go earliest deadline first."""
    weights = {"a": 1.0, "b": 2.0, "c": 3.0}
    orders = []
    for with_targets in (False, True):
        fair, _, _ = fair_queue(rate=1e6)  # (fast: nothing is refused)
        slots = Slots()
        for n, (tenant, ms) in enumerate(arrivals):
            ticket = targeted(tenant, ms if with_targets else None, weights[tenant])
            fair.enter(ticket, slots.place(f"{tenant}:{ms}:{n}"))
        for taken in frees:
            slots.free["decode"] = taken
            fair.pump()
        orders.append(slots.placed)
    plain, deadlines = orders
    assert [p.split(":")[0] for p in plain] == [p.split(":")[0] for p in deadlines]
    for tenant in weights:
        # All arrived before the first slot freed: each tenant's own go by (deadline, arrival).
        due = [_due(p) for p in deadlines if p.startswith(f"{tenant}:")]
        assert due == sorted(due)


def _due(placed: str) -> tuple[float, int]:
    _, ms, n = placed.split(":")
    return (float("inf") if ms == "None" else float(ms), int(n))


# -- no target: today's queue ---------------------------------------------------------------


class Reference:
    """Today's order for one model, as the fair queue's docstring gives it: a tag
    ``max(V, its tenant's last) + 1 / weight``, the smallest first, ``V`` the tag let go."""

    def __init__(self, size: int) -> None:
        self.size, self.now, self.n = size, 0.0, 0
        self.last: dict[str, float] = {}
        self.heap: list[tuple[float, int, str, str, float]] = []
        self.placed: list[str] = []
        self.pushed = 0

    def enter(self, tenant: str, weight: float, name: str, free: dict[str, int]) -> str:
        finish = max(self.now, self.last.get(tenant, 0.0)) + 1.0 / weight
        self.n += 1
        if not self.heap and free["decode"] > 0:
            free["decode"] -= 1
            self.now = self.last[tenant] = finish
            self.placed.append(name)
            return "at_once"
        if len(self.heap) >= self.size:
            # Full: the one the order lets go last leaves for a newcomer it lets go sooner,
            # its tenant given its tag back (``operations.md``, "Overload").
            last = max(self.heap)
            if last[:2] < (finish, self.n):
                return "queue_full"
            self.heap.remove(last)
            heapq.heapify(self.heap)
            self.pushed += 1
            f, _, _, its, w = last
            if self.last.get(its) == f:
                self.last[its] = f - 1.0 / w
        self.last[tenant] = finish
        heapq.heappush(self.heap, (finish, self.n, name, tenant, weight))
        return "waits"

    def pump(self, free: dict[str, int]) -> None:
        while self.heap and free["decode"] > 0:
            finish, _, name, _, _ = heapq.heappop(self.heap)
            free["decode"] -= 1
            self.now = max(self.now, finish)
            self.placed.append(name)


@settings(max_examples=80, deadline=None)
@given(
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("arrive"), st.sampled_from("abc")),
            st.tuples(st.just("free"), st.integers(0, 3)),
        ),
        min_size=1,
        max_size=80,
    ),
    size=st.integers(1, 12),
)
def test_with_no_target_the_queue_is_todays(steps: list[tuple[str, Any]], size: int) -> None:
    """Random arrivals without targets, with the rates measured: the same outcomes, in the
    same order, as today's queue."""
    weights = {"a": 1.0, "b": 2.0, "c": 0.5}
    fair, _, said = fair_queue(rate=10.0)
    fair.size = size
    slots, reference, free = Slots(), Reference(size), {"decode": 0}
    outcomes, expected, pushed = [], [], []
    for n, (kind, value) in enumerate(steps):
        if kind == "free":
            slots.free["decode"] += value
            free["decode"] += value
            fair.pump()
            reference.pump(free)
            continue
        name = f"{value}{n}"
        try:
            got = fair.enter(Ticket(value, TenantRule(weight=weights[value])), slots.place(name))
            outcomes.append("waits" if isinstance(got, Deferred) else "at_once")
            if isinstance(got, Deferred):  # (pushed out later, maybe: its 503 is read here)
                got.addErrback(lambda failure: pushed.append(failure.trap(ProxyError)))
        except ProxyError as error:
            outcomes.append(error.code.value)
        expected.append(reference.enter(value, weights[value], name, free))
    assert outcomes == expected
    assert slots.placed == reference.placed
    assert len(pushed) == reference.pushed
    assert Counter(said) == Counter(
        {
            "at_once": expected.count("at_once"),
            "queue_full": expected.count("queue_full"),
            "pushed_out": reference.pushed,
        }
    ) + Counter({"after_wait": len(reference.placed) - expected.count("at_once")})


# -- every replica's queue: the fleet's count -------------------------------------------------


def test_shared_the_fleets_waiting_count_is_all_ahead_and_the_refusal_is_503() -> None:
    clock = Clock()
    rates = warmed(clock, 10.0)
    ticket = targeted("a", 1000)
    assert fleet_refusal(rates, ticket, 0) is None  # (nothing waits: it goes if it can)
    assert fleet_refusal(rates, ticket, 5) is None  # (0.5 s + 0.05)
    refused = fleet_refusal(rates, ticket, 15)
    assert refused is not None and refused.code == ErrorCode.TTFT_UNREACHABLE
    assert fleet_refusal(rates, targeted("a", 1000, miss="serve"), 15) is None
    assert fleet_refusal(rates, targeted("a", None), 15) is None
    late = fleet_too_late(rates, ticket, 3)
    assert (late.code, late.retry_after) == (ErrorCode.TTFT_UNREACHABLE, 1.0)
    assert fleet_too_late(Rates(clock), ticket, 3).code == ErrorCode.TTFT_UNREACHABLE


def test_predictions_are_calibrated_by_how_late_first_tokens_came_against_them() -> None:
    """What the model cannot see (those that arrive later and go first by their tenant's
    share, decode's own scheduling) is measured: the 90th percentile of first tokens over
    their predictions multiplies every prediction, once 16 are measured."""
    clock = Clock()
    rates = Rates(clock)
    for _ in range(16):
        clock.advance(0.1)
        rates.ended(None, legs(), True)
    plain = rates.predict(None, 4, 1, 0.5, 1000)
    assert plain is not None and plain.seconds == plain.base
    assert rates.calibration(None, 1000) == 1.0
    for _ in range(14):  # (first tokens at 1.5 times their predictions, then two at 3)
        rates.ended(None, legs(predicted=0.4, actual=0.6), True)
    rates.ended(None, legs(predicted=0.4, actual=1.2), True)
    assert rates.calibration(None, 1000) == 1.0  # (15: not yet)
    rates.ended(None, legs(predicted=0.4, actual=1.2), True)
    assert rates.calibration(None, 1000) == pytest.approx(3.0)  # (16: the 90th is a 3)
    for _ in range(16):
        rates.ended(None, legs(predicted=0.4, actual=0.6), True)
    assert rates.calibration(None, 1000) == pytest.approx(1.5)
    assert rates.calibration(None, 10_000) == 1.0  # (a patient target's error is its own)
    calibrated = rates.predict(None, 4, 1, 0.5, 1000)
    assert calibrated is not None and calibrated.seconds == pytest.approx(calibrated.base * 1.5)
    for _ in range(64):  # (early first tokens: never below half the prediction)
        rates.ended(None, legs(predicted=0.4, actual=0.1), True)
    assert rates.calibration(None, 1000) == 0.5


def test_a_prompts_prefill_is_predicted_from_its_own_length_once_measured() -> None:
    """Prompts of 250 and 1,000 tokens at 0.8 ms a token: the mean of their prefills says
    0.35 s for both, the tokens 0.2 and 0.8 s; unknown lengths keep the mean."""
    clock = Clock()
    rates = Rates(clock)
    for n in range(16):
        clock.advance(0.1)
        tokens = 1000 if n % 4 == 0 else 250
        rates.ended(None, legs(prefill=tokens * 0.0008, first_byte=0.0, prompt=tokens), True)
    short = rates.predict(None, 0, 0, 1.0, 1000, prompt=250)
    long = rates.predict(None, 0, 0, 1.0, 1000, prompt=1000)
    unknown = rates.predict(None, 0, 0, 1.0, 1000)
    assert short is not None and long is not None and unknown is not None
    assert (short.seconds, long.seconds) == (pytest.approx(0.2), pytest.approx(0.8))
    assert unknown.seconds == pytest.approx(rates.prefill_seconds(None))
