"""Two waits: a prefilled request waits in its model's ready lane, let go first, never refused;
prefill runs ahead of decode under a limit; the lease guard sends a ready one over the cap."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.task import Clock

from nixl_twisted.admission.fair_queue import FairQueue
from nixl_twisted.admission.outcomes import LEFT, READY_AFTER_WAIT, READY_AT_ONCE, TIMED_OUT
from nixl_twisted.admission.run_ahead import RunAhead, guard_at
from nixl_twisted.admission.slots import Slots
from nixl_twisted.admission.waiting import Claim, Pool
from nixl_twisted.backends.capacity import Caps
from nixl_twisted.backends.pools import BackendPool
from nixl_twisted.config import TenantRule
from nixl_twisted.protocol.targets import Target
from tests.pure.test_fair_queue import outcome

READY = Claim("a").ready()


class Decode:
    """Free decode slots, as a placement takes them."""

    def __init__(self, free: int = 0) -> None:
        self.free = free
        self.placed: list[str] = []

    def place(self, name: str) -> Any:
        def take() -> Any:
            if self.free <= 0:
                return Pool.DECODE
            self.free -= 1
            self.placed.append(name)
            return (name,)  # (not a str: a str is a full pool's name)

        return take


def queue(size: int = 100) -> tuple[FairQueue[Any], Clock, list[str]]:
    clock = Clock()
    said: list[str] = []
    return FairQueue(clock, size, 30.0, lambda o, w, t: said.append(str(o))), clock, said


def test_a_freed_slot_goes_to_a_ready_request_before_a_new_one() -> None:
    fair, _, said = queue()
    decode = Decode()
    new = fair.enter(Claim("a"), decode.place("new"))
    ready = fair.enter(READY, decode.place("ready"))
    assert isinstance(new, Deferred) and isinstance(ready, Deferred)
    decode.free = 1
    fair.pump()
    assert (outcome(ready), outcome(new)) == (("ready",), None)
    decode.free = 1
    fair.pump()
    assert outcome(new) == ("new",)
    assert said == [str(READY_AFTER_WAIT), "after_wait"]


def test_a_ready_request_goes_at_once_only_when_no_ready_one_of_its_model_is_ahead() -> None:
    fair, _, said = queue()
    decode = Decode()
    first = fair.enter(READY, decode.place("first"))
    decode.free = 1
    # A slot is free, but one ready request waits ahead (not pumped yet): this one waits.
    second = fair.enter(READY, decode.place("second"))
    assert isinstance(first, Deferred) and isinstance(second, Deferred)
    fair.pump()
    assert (outcome(first), outcome(second)) == (("first",), None)
    decode.free = 1
    assert fair.enter(Claim("b", model="other").ready(), decode.place("other")) == ("other",)
    assert said[-1] == str(READY_AT_ONCE)


def test_ready_requests_go_first_come_first_served_whatever_their_tenants_weights() -> None:
    """Fairness chose them at their prefill slot: weighed again for decode, the lighter
    tenant's prefilled requests would wait behind the heavier's that came after them."""
    fair, _, _ = queue()
    decode = Decode()
    heavy, light = TenantRule(weight=3), TenantRule(weight=1)
    came = [("b1", light), ("b2", light), ("a1", heavy), ("a2", heavy), ("b3", light)]
    for name, rule in came:
        assert isinstance(fair.enter(Claim(name[0], rule).ready(), decode.place(name)), Deferred)
    for _ in range(5):
        decode.free = 1
        fair.pump()
    assert decode.placed == ["b1", "b2", "a1", "a2", "b3"]


def test_ready_requests_with_targets_go_earliest_deadline_first_and_are_never_refused() -> None:
    """A prefilled request due sooner passes those ready before it; one with no target is
    due in 30 s (the KV lease), so that it is never passed for ever."""
    fair, clock, said = queue()
    decode = Decode()
    rates = fair.rates
    for _ in range(16):  # (measured: a prediction could refuse a waiting request)
        clock.advance(0.01)
        rates.ended(
            None,
            SimpleNamespace(
                prefill_seconds=0.5,
                decode_first_byte_seconds=0.5,
                ttft_predicted_base_seconds=None,
                time_to_first_byte_seconds=None,
                ttft_target=None,
                prompt_estimate=None,
            ),
            True,
        )
    came = [("none", None), ("ten", 10_000), ("one", 1_000), ("hour", 3_600_000)]
    for name, ms in came:
        target = None if ms is None else Target(ms, "x-slo-ttft-ms")
        claim = Claim(name, target=target).ready()
        assert isinstance(fair.enter(claim, decode.place(name)), Deferred)
    for _ in range(4):
        decode.free = 1
        fair.pump()
    assert decode.placed == ["one", "ten", "none", "hour"]
    assert "ttft_refused" not in said


def test_a_ready_request_is_never_refused_for_room_shed_or_timed_out() -> None:
    fair, clock, said = queue(size=1)
    decode = Decode()
    waiting = fair.enter(Claim("a"), decode.place("waiting"))
    sheddable = Claim("b", TenantRule(priority=-1)).ready()
    ready = [fair.enter(READY, decode.place("r1")), fair.enter(sheddable, decode.place("r2"))]
    assert all(isinstance(r, Deferred) for r in ready)
    assert (len(fair), said) == (3, [])
    clock.advance(31)
    assert isinstance(outcome(waiting), Exception) and said == [str(TIMED_OUT)]
    assert [outcome(r) for r in ready] == [None, None]
    decode.free = 2
    fair.pump()
    assert [outcome(r) for r in ready] == [("r1",), ("r2",)]


def test_a_ready_request_whose_client_leaves_is_taken_out() -> None:
    fair, _, said = queue()
    decode = Decode()
    ready = fair.enter(READY, decode.place("ready"))
    assert isinstance(ready, Deferred)
    ready.cancel()
    ready.addErrback(lambda _: None)
    decode.free = 1
    fair.pump()
    assert (decode.placed, said, len(fair)) == ([], [str(LEFT)], 0)


def pool(caps: dict[str, int]) -> BackendPool:
    decode = BackendPool(
        "decode", [f"http://{u}:1#max-in-flight={c}" for u, c in caps.items()], Clock()
    )
    decode.use_caps(Caps())
    return decode


def test_prefill_runs_ahead_at_most_the_decode_caps_or_the_limit_set() -> None:
    ahead = RunAhead(pool({"d1": 3, "d2": 2}))
    assert ahead.limit(None) == 5
    held = [ahead.hold(None) for _ in range(5)]
    assert not ahead.room(None)
    held[0]()
    held[0]()  # (given back once)
    assert ahead.room(None) and ahead.ahead(None) == 4
    ahead.set = 2
    assert ahead.limit(None) == 2 and not ahead.room(None)


def test_a_replica_holds_its_share_of_the_limit_and_an_uncapped_decode_has_none() -> None:
    assert RunAhead(pool({"d1": 8, "d2": 8}), lambda whole: whole // 3).limit(None) == 5
    uncapped = BackendPool("decode", ["http://d1:1#max-in-flight=4", "http://d2:1"], Clock())
    assert RunAhead(uncapped).limit(None) is None


def test_shared_a_replica_holds_the_fleets_limit_against_the_others_ahead() -> None:
    others: dict[str | None, int | None] = {"m": 1}
    ahead = RunAhead(pool({"d1": 4}), lambda whole: whole // 2, others=others.get)
    assert ahead.limit("m") == 4  # (the fleet's, not this replica's half)
    held = [ahead.hold("m") for _ in range(3)]  # (past its half: the others hold one)
    assert ahead.ahead("m") == 3 and not ahead.room("m")  # (3 + 1: the fleet's limit)
    others["m"] = 0
    assert ahead.room("m")
    others["m"] = 2  # (heard late: past the limit, no prefill starts)
    held[0]()
    assert not ahead.room("m")
    others["m"] = None  # (Redis away: its static share, 2, held against its own)
    assert ahead.limit("m") == 2 and not ahead.room("m")
    held[1]()
    held[2]()
    assert ahead.room("m")


class Rates:
    """A model's measured decode drain rate and prefill seconds (None: not yet)."""

    def __init__(self, rate: float | None = None, prefill: float | None = None) -> None:
        self.rate, self.prefill = rate, prefill

    def drain_rate(self, model: str | None) -> float | None:
        return self.rate

    def prefill_seconds(self, model: str | None) -> float | None:
        return self.prefill


def test_measured_rates_set_the_limit_to_what_keeps_decode_fed() -> None:
    rates = Rates()
    ahead = RunAhead(pool({"d1": 8, "d2": 8}), measured=rates)
    assert ahead.limit(None) == 16  # (nothing measured: one per decode slot)
    rates.rate, rates.prefill = 24.2, 0.66  # (16 slots freed in 0.66 s; prefill as long)
    # 24.2/s x 0.66 s x 1.25 = 19.97: 20 in prefill or ready, and one per decode instance.
    assert ahead.limit(None) == 22
    rates.prefill = 0.13  # (short prompts: 3.93, so 4 and 2; the rest wait to be ordered)
    assert ahead.limit(None) == 6
    rates.prefill = 0.66
    shared = RunAhead(pool({"d1": 8, "d2": 8}), lambda whole: whole // 2, measured=rates)
    assert shared.limit(None) == 11  # (a replica's share of the fleet's)
    ahead.set = 4
    assert ahead.limit(None) == 4  # (--prefill-run-ahead wins)


def test_giving_a_place_back_lets_the_queue_try_again() -> None:
    ahead = RunAhead(pool({"d1": 1}))
    tried: list[int] = []
    ahead.on_behind(lambda: tried.append(1))
    ahead.hold(None)()
    assert tried == [1]


def test_the_guard_fires_a_margin_before_the_lease_ends() -> None:
    assert guard_at(100.0, 30.0) == 120.0
    assert guard_at(100.0, 12.0) == 108.0  # (a third of a short lease)


class Backends:
    """What ``Slots`` reads of the pools."""

    def __init__(self, decode: BackendPool) -> None:
        self.decode = decode

    def pools(self) -> list[BackendPool]:
        return [self.decode]


def test_a_ready_request_near_its_lease_end_is_sent_over_the_cap() -> None:
    fair, clock, said = queue()
    assert said == []
    decode = Decode()
    guarded: list[Claim] = []
    slots = Slots(Backends(pool({"d1": 1})), clock, fair, guarded=guarded.append)  # type: ignore[arg-type]
    clock.advance(5)
    taken = slots.take_decode(Claim("a"), decode.place("waits"), 4.0, lambda: ("forced",))
    assert isinstance(taken, Deferred)
    clock.advance(18.9)  # (prefilled at 4 s: the guard at 24 s)
    assert outcome(taken) is None
    clock.advance(0.1)
    assert outcome(taken) == ("forced",)
    assert (len(fair), guarded, decode.placed, said) == (0, [READY], [], [])
    decode.free = 1
    fair.pump()
    assert decode.placed == []  # (it left the queue: nothing placed for it again)


def test_a_ready_request_let_go_before_its_guard_is_not_sent_twice() -> None:
    fair, clock, _ = queue()
    decode = Decode()
    guarded: list[Claim] = []
    slots = Slots(Backends(pool({"d1": 1})), clock, fair, guarded=guarded.append)  # type: ignore[arg-type]
    taken = slots.take_decode(Claim("a"), decode.place("waits"), 0.0, lambda: ("forced",))
    decode.free = 1
    fair.pump()
    assert outcome(taken) == ("waits",)
    clock.advance(60)
    assert guarded == []
