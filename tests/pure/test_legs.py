"""One leg over a pool: the prefill status table, retries, and the one lease per leg."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

import pytest
from twisted.internet.defer import CancelledError, Deferred, ensureDeferred, succeed
from twisted.internet.task import Clock

from nixl_twisted.backends.instances import Instance
from nixl_twisted.backends.pools import BackendPool, Lease
from nixl_twisted.backends.routing import NO_ROUTING
from nixl_twisted.exchange.prefill import PrefillVerdict, classify_prefill
from nixl_twisted.exchange.sending import Asked, ByPolicy, Retry, reason_of, send_leg
from nixl_twisted.observe.metrics import ProxyMetrics
from nixl_twisted.observe.spans import AttemptTrace
from nixl_twisted.protocol.codes import ErrorCode
from nixl_twisted.protocol.errors import ProxyError

DOWN = ErrorCode.PREFILL_UNREACHABLE


@pytest.mark.parametrize(
    ("status", "verdict"),
    [
        (200, PrefillVerdict.PARAMS),
        (201, PrefillVerdict.PARAMS),
        (502, PrefillVerdict.RETRY),
        (503, PrefillVerdict.RETRY),
        (504, PrefillVerdict.RETRY),
        (400, PrefillVerdict.REFUSED),
        (404, PrefillVerdict.REFUSED),
        (429, PrefillVerdict.REFUSED),
        (500, PrefillVerdict.FAILED),
        (501, PrefillVerdict.FAILED),
        (101, PrefillVerdict.FAILED),
        (302, PrefillVerdict.FAILED),
    ],
)
def test_what_a_prefill_status_means(status: int, verdict: PrefillVerdict) -> None:
    assert classify_prefill(status) is verdict


def pool(*names: str) -> BackendPool:
    return BackendPool("prefill", [f"http://{n}:1" for n in names], Clock())


def by_policy(pool: BackendPool, retries: int, metrics: ProxyMetrics | None = None) -> ByPolicy:
    """The pool's policy chooses, ``retries`` after the first."""
    return ByPolicy(pool, metrics or ProxyMetrics(), NO_ROUTING, retries)


def run(leg: Coroutine[Any, Any, tuple[Lease, str]]) -> Any:
    """The leg's result, or its Failure: every attempt here answers at once."""
    results: list[Any] = []
    ensureDeferred(leg).addBoth(results.append)
    (result,) = results
    return result


class SaidAnswered(ByPolicy):
    """The pool's policy, saying what each served attempt answered."""

    def __init__(self, pool: BackendPool, retries: int) -> None:
        super().__init__(pool, ProxyMetrics(), NO_ROUTING, retries)

    def answered(self, served: object) -> str:
        return f"answered_{served}"


def test_a_retry_goes_to_the_next_instance_and_gives_the_first_back() -> None:
    backends = pool("a", "b")
    seen: list[Instance] = []

    def attempt(instance: Instance, _: AttemptTrace) -> Deferred[str]:
        seen.append(instance)
        assert instance.in_flight == 1  # held while it serves
        if instance.url == "http://a:1":
            raise Retry(ProxyError(DOWN, "a is down"), "unreachable", "refused")
        return succeed("answer")

    lease, value = run(send_leg(backends, ProxyMetrics(), attempt, by_policy(backends, 2)))
    assert value == "answer" and lease.instance.url == "http://b:1"
    a, b = backends.instances
    assert (a.in_flight, b.in_flight) == (0, 1)  # b is the caller's until it releases
    assert a.failures == 1
    lease.release()
    lease.release()  # once only
    assert b.in_flight == 0


def test_when_every_instance_failed_the_last_error_is_the_answer() -> None:
    backends = pool("a", "b")

    def attempt(instance: Instance, _: AttemptTrace) -> Deferred[str]:
        raise Retry(ProxyError(DOWN, f"{instance.url} is down"), "x", "y")

    failure = run(send_leg(backends, ProxyMetrics(), attempt, by_policy(backends, 5)))
    assert "http://b:1 is down" in str(failure.value)
    assert [i.in_flight for i in backends.instances] == [0, 0]


def test_another_error_ends_the_leg_and_releases_the_instance() -> None:
    backends = pool("a", "b")

    def attempt(instance: Instance, _: AttemptTrace) -> Deferred[str]:
        raise ValueError("not the instance's fault")

    failure = run(send_leg(backends, ProxyMetrics(), attempt, by_policy(backends, 2)))
    assert failure.check(ValueError)
    assert [i.in_flight for i in backends.instances] == [0, 0]
    assert all(i.healthy for i in backends.instances)


def test_go_on_stops_the_retries() -> None:
    backends = pool("a", "b")
    calls: list[Instance] = []

    def attempt(instance: Instance, _: AttemptTrace) -> Deferred[str]:
        calls.append(instance)
        raise Retry(ProxyError(DOWN, "down"), "x", "y")

    failure = run(
        send_leg(
            backends,
            ProxyMetrics(),
            attempt,
            by_policy(backends, 2),
            Asked(go_on=lambda: not calls),
        )
    )
    assert failure.check(CancelledError)
    assert len(calls) == 1


def test_twisted_client_errors_are_said_by_their_messages_not_reprs() -> None:
    from twisted.internet.error import ConnectionDone
    from twisted.python.failure import Failure
    from twisted.web.client import ResponseFailed

    error = ResponseFailed([Failure(ConnectionDone()), Failure(ValueError("body short"))])
    said = reason_of(error)
    assert "<" not in said and "Failure" not in said
    assert said.startswith("Connection was closed cleanly") and said.endswith("; body short")


def test_a_handoff_gap_past_the_warning_is_counted_and_logged() -> None:
    from nixl_twisted.exchange.decode import note_handoff

    metrics = ProxyMetrics()
    assert not note_handoff(metrics, 0.002, 10.0, "r1", "http://d:1")
    assert note_handoff(metrics, 12.5, 10.0, "r2", "http://d:1")
    registry = metrics.registry
    assert registry.get_sample_value("nixlproxy_handoff_gap_seconds_count") == 2
    assert registry.get_sample_value("nixlproxy_handoff_gap_over_warning_total") == 1


def test_a_leg_sent_elsewhere_asks_the_next_and_counts_nothing_against_the_first() -> None:
    from nixl_twisted.exchange.sending import Elsewhere
    from nixl_twisted.observe.access import AccessRecord

    backends = pool("a", "b")
    record = AccessRecord()

    def attempt(instance: Instance, _: AttemptTrace) -> Deferred[str]:
        if instance.url == "http://a:1":
            raise Elsewhere("answered_404")
        return succeed("held here")

    lease, value = run(
        send_leg(backends, ProxyMetrics(), attempt, SaidAnswered(backends, 1), Asked(record=record))
    )
    assert value == "held here" and lease.instance.url == "http://b:1"
    a, _ = backends.instances
    assert (a.in_flight, a.failures, a.healthy) == (0, 0, True)
    assert record.attempts == [
        ("prefill", "http://a:1", "answered_404"),
        ("prefill", "http://b:1", "answered_held here"),
    ]
    assert record.retried


def test_a_leg_chooses_by_the_pools_policy_and_counts_each_choice() -> None:
    backends = pool("a", "b")
    metrics = ProxyMetrics()

    def attempt(instance: Instance, _: AttemptTrace) -> Deferred[str]:
        if instance.url == "http://a:1":
            raise Retry(ProxyError(DOWN, "a is down"), "unreachable", "refused")
        return succeed("answer")

    run(send_leg(backends, metrics, attempt, by_policy(backends, 1, metrics)))
    value = metrics.registry.get_sample_value
    assert value("nixlproxy_retries_total", {"pool": "prefill"}) == 1
    decided = {"pool": "prefill", "policy": "round-robin", "decision": "next"}
    assert value("nixlproxy_routing_decisions_total", decided) == 2


def test_a_leg_may_choose_its_own_instances_then_no_policy_or_retry_is_counted() -> None:
    from collections.abc import Sequence

    backends = pool("a", "b", "c")
    metrics = ProxyMetrics()
    seen: list[tuple[str, int]] = []

    class Backwards:
        retries = 1

        def __call__(self, tried: Sequence[Instance]) -> tuple[Instance, str]:
            return backends.instances[-1 - len(tried)], "mine"

        def answered(self, served: object) -> str:
            return "answered"

        def failed(self, instance: Instance) -> None:
            pass

    def attempt(instance: Instance, _: AttemptTrace) -> Deferred[str]:
        seen.append((instance.url, instance.in_flight))
        raise Retry(ProxyError(DOWN, f"{instance.url} is down"), "x", "y")

    failure = run(send_leg(backends, metrics, attempt, Backwards()))
    assert seen == [("http://c:1", 1), ("http://b:1", 1)]  # 1 + retries, in its order
    assert "http://b:1 is down" in str(failure.value)
    value = metrics.registry.get_sample_value
    assert value("nixlproxy_retries_total", {"pool": "prefill"}) is None
    assert not any(
        s.name == "nixlproxy_routing_decisions_total"
        for f in metrics.registry.collect()
        for s in f.samples
    )


def test_a_follow_up_asks_the_holder_first_then_every_instance_down_or_draining() -> None:
    from nixl_twisted.exchange.one_leg import HolderFirst

    backends = pool("a", "b", "c")
    a, b, c = backends.instances
    a.draining = True
    for _ in range(3):
        backends.record_failure(c, "refused")
    assert not c.healthy
    asking = HolderFirst(backends, "http://b:1")
    assert asking.retries == 2
    assert asking([]) == (b, "holder") and asking.left == 2
    assert asking([b]) == (a, "asked") and asking.left == 1
    assert asking([b, a]) == (c, "asked") and asking.left == 0
    unknown = HolderFirst(backends, None)
    assert [unknown(backends.instances[:n])[1] for n in range(3)] == ["asked"] * 3
