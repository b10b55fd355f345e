"""Backend URLs and round-robin rotation."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
from twisted.internet.task import Clock
from twisted.logger import ILogObserver, formatEvent, globalLogPublisher
from zope.interface import provider

from nixl_twisted.backends.health import BACKOFF_MAX, State, Thresholds
from nixl_twisted.backends.pools import BackendPool, NoHealthyInstance
from nixl_twisted.backends.routing import Routing
from nixl_twisted.config.values import InvalidValue, backend_url


def test_round_robin_in_order_and_wraps() -> None:
    pool = BackendPool("decode", ["http://a:1", "http://b:2", "http://c:3"], Clock())
    assert [pool.choose()[0].url for _ in range(7)] == [
        "http://a:1",
        "http://b:2",
        "http://c:3",
        "http://a:1",
        "http://b:2",
        "http://c:3",
        "http://a:1",
    ]
    assert len(pool) == 3


def test_a_pool_that_only_discovers_starts_empty_and_refuses_legs() -> None:
    pool = BackendPool("prefill", [], Clock())
    with pytest.raises(NoHealthyInstance):
        pool.choose()
    assert not pool.ready()


def test_a_source_adds_its_instances_and_drains_only_those_it_listed() -> None:
    pool = BackendPool("decode", ["http://static:1"], Clock(), checked=True)
    joined, leaving = pool.discovered(
        "dns+http://d.test:1", ["http://10.0.0.1:1", "http://static:1"]
    )
    assert [i.url for i in joined] == ["http://10.0.0.1:1"]  # static was serving already
    assert leaving == []
    assert {i.url: i.source for i in pool.instances} == {
        "http://static:1": "static",
        "http://10.0.0.1:1": "dns",
    }
    # Listed no more: the discovered one drains; the static one stays, still given.
    joined, leaving = pool.discovered("dns+http://d.test:1", [])
    assert joined == [] and [i.url for i in leaving] == ["http://10.0.0.1:1"]
    assert pool.given == ("http://static:1",)
    # Back again: taken back, with no other instance touched.
    joined, _ = pool.discovered("dns+http://d.test:1", ["http://10.0.0.1:1"])
    assert [i.url for i in joined] == ["http://10.0.0.1:1"] and not joined[0].draining


def test_an_instance_two_sources_list_stays_until_both_drop_it() -> None:
    pool = BackendPool("decode", [], Clock())
    pool.discovered("dns+http://a.test:1", ["http://10.0.0.1:1"])
    pool.discovered("kubernetes:ns/app=x", ["http://10.0.0.1:1"])
    _, leaving = pool.discovered("dns+http://a.test:1", [])
    assert leaving == []
    assert pool.instances[0].source == "kubernetes" and not pool.instances[0].draining
    _, leaving = pool.discovered("kubernetes:ns/app=x", [])
    assert [i.url for i in leaving] == ["http://10.0.0.1:1"]


def test_a_discovered_instance_waits_for_its_check_while_a_checked_one_serves() -> None:
    pool = BackendPool("decode", ["http://static:1"], Clock(), checked=True)
    pool.record_success(pool.instances[0])
    (new,), _ = pool.discovered("dns+http://d.test:1", ["http://10.0.0.1:1"])
    assert new.state is State.PENDING
    assert {pool.choose()[0].url for _ in range(4)} == {"http://static:1"}
    pool.record_success(new)
    assert {pool.choose()[0].url for _ in range(4)} == {"http://static:1", "http://10.0.0.1:1"}


def test_a_reload_keeps_discovered_instances_and_may_leave_only_them() -> None:
    pool = BackendPool("decode", ["http://static:1"], Clock())
    pool.discovers = True
    pool.discovered("dns+http://d.test:1", ["http://10.0.0.1:1"])
    pool.update([])
    assert [(i.url, i.draining) for i in pool.instances] == [("http://10.0.0.1:1", False)]


@pytest.mark.parametrize(
    ("url", "normal"),
    [
        ("http://10.0.0.1:8100", "http://10.0.0.1:8100"),
        ("http://p1:8100/", "http://p1:8100"),
        ("https://p1.example/vllm/", "https://p1.example/vllm"),
        ("http://[::1]:8100", "http://[::1]:8100"),
        ("http://bücher.example:8100", "http://bücher.example:8100"),
        ("http://p1:8100/#dp=02", "http://p1:8100#dp=2"),
        ("http://p1:8100#rank=1", "http://p1:8100#rank=1"),
        ("http://p1:8100#dp=1024", "http://p1:8100#dp=1024"),
        ("http://p1:8100#rank=001023", "http://p1:8100#rank=1023"),
    ],
)
def test_valid_urls(url: str, normal: str) -> None:
    assert backend_url(url) == normal


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("p1:8100", "http:// or https://"),
        ("ftp://p1", "http:// or https://"),
        ("http://", "no host"),
        ("http://p1:port", "not a valid URL"),
        ("http://p1:99999", "not a valid URL"),
        ("http://p1:8100?x=1", "query"),
        ("http://p1:8100#top", "the fragment is #dp=N"),
        ("http://p1:8100#dp=0", "at least 1"),
        ("http://p1:8100#dp=1025", "at most 1024 ranks"),
        ("http://p1:8100#dp=" + "9" * 5000, "the fragment is #dp=N"),
        ("http://p1:8100#rank=1024", "below 1024"),
        ("http://p1:8100#dp=\u0663", "the fragment is #dp=N"),  # an Arabic-Indic 3
        ("http://user:pw@p1:8100", "credentials"),
        ("http://p1:8100/\r\nX-Injected: 1", "whitespace or control characters"),
        ("http://p1:81\t00", "whitespace or control characters"),
        (" http://p1:8100", "whitespace or control characters"),
        ("http://p1:8100/a b", "whitespace or control characters"),
        ("http://p1:8100/\x00", "whitespace or control characters"),
        ("http://p1:8100/\x7f", "whitespace or control characters"),
        ("http://p1:8100/\u2028", "whitespace or control characters"),
    ],
)
def test_invalid_urls_say_why(url: str, why: str) -> None:
    with pytest.raises(InvalidValue, match=why):
        backend_url(url)


def test_a_data_parallel_instance_is_one_instance_per_rank() -> None:
    pool = BackendPool("decode", ["http://d:1#dp=2", "http://e:1"], Clock())
    assert pool.urls == ("http://d:1#rank=0", "http://d:1#rank=1", "http://e:1")
    assert [(i.base, i.rank) for i in pool.instances] == [
        ("http://d:1", 0),
        ("http://d:1", 1),
        ("http://e:1", None),
    ]
    removed = pool.remove("http://d:1#dp=2")
    assert [i.url for i in removed] == ["http://d:1#rank=0", "http://d:1#rank=1"]
    assert pool.urls == ("http://e:1",)


def lines_run(work: Callable[[], object]) -> int:
    """How many lines of Python ``work`` runs: its cost, counted rather than timed."""
    lines = 0

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal lines
        lines += event == "line"
        return trace

    before = sys.gettrace()
    sys.settrace(trace)
    try:
        work()
    finally:
        sys.settrace(before)
    return lines


def test_adding_updating_or_removing_n_ranks_costs_in_proportion_to_n() -> None:
    def adding(ranks: int) -> int:
        pool = BackendPool("decode", [f"http://e:1#dp={ranks}"], Clock())
        return lines_run(lambda: pool.add(f"http://d:1#dp={ranks}"))

    def updating(ranks: int) -> int:
        pool = BackendPool("decode", [f"http://e:1#dp={ranks}"], Clock())
        return lines_run(lambda: pool.update([f"http://d:1#dp={ranks}"]))

    def removing(ranks: int) -> int:
        pool = BackendPool("decode", [f"http://d:1#dp={ranks}", f"http://e:1#dp={ranks}"], Clock())
        return lines_run(lambda: pool.remove(f"http://d:1#dp={ranks}"))

    for cost in (adding, updating, removing):
        # Four times the ranks: four times the work when linear, sixteen when quadratic.
        assert cost(512) < 5 * cost(128), cost.__name__


def test_an_update_keeps_the_listed_drains_the_rest_and_takes_back_a_draining_one() -> None:
    pool, _ = pool_of("http://a:1", "http://b:1", "http://c:1#dp=2")
    a, b, c0, c1 = pool.instances
    lease = pool.lease(c1)
    pool.drain("http://a:1")
    assert pool.urls == ("http://b:1", "http://c:1#rank=0", "http://c:1#rank=1")
    pool.update(["http://c:1#rank=1", "http://a:1", "http://d:1#dp=2"])
    assert pool.urls == (
        "http://c:1#rank=1",
        "http://a:1",
        "http://d:1#rank=0",
        "http://d:1#rank=1",
    )
    assert pool.instances[1] is not a  # drained and gone: a new instance for it
    assert (b.draining, c0.draining, c1.draining) == (True, True, False)
    pool.update(["http://a:1"])
    assert c1.draining and c1 in pool.instances  # its leg goes on
    lease.release()
    assert pool.urls == ("http://a:1",)


def pool_of(*urls: str, checked: bool = False) -> tuple[BackendPool, Clock]:
    clock = Clock()
    return BackendPool("prefill", list(urls), clock, Thresholds(3, 2), checked), clock


def test_one_failure_ejects_nothing_three_in_a_row_do() -> None:
    pool, _ = pool_of("http://a:1", "http://b:2")
    a, b = pool.instances
    pool.record_failure(a, "timed out")
    pool.record_failure(a, "timed out")
    assert a.state is State.UP and a.failures == 2
    pool.record_success(a)  # a success in between starts the count again
    for _ in range(2):
        pool.record_failure(a, "timed out")
    assert a.state is State.UP
    pool.record_failure(a, "connection refused")
    assert a.state is State.DOWN and a.last_error == "connection refused"
    assert [pool.choose()[0] for _ in range(3)] == [b, b, b]
    assert not pool.panicking


def test_a_down_instance_needs_two_successes_in_a_row_to_come_back() -> None:
    pool, _ = pool_of("http://a:1")
    (a,) = pool.instances
    for _ in range(3):
        pool.record_failure(a, "refused")
    pool.record_success(a)
    assert a.state is State.DOWN
    pool.record_failure(a, "refused")
    pool.record_success(a)
    assert a.state is State.DOWN
    pool.record_success(a)
    assert a.state is State.UP and a.failures == 0 and a.last_error is None


def test_a_new_instance_is_pending_until_its_first_check_decides() -> None:
    pool, _ = pool_of("http://a:1", "http://b:2", checked=True)
    a, b = pool.instances
    assert (a.state, b.state) == (State.PENDING, State.PENDING)
    assert not pool.ready()  # nothing is known to be up yet
    pool.record_failure(a, "refused")  # the first answer decides: no threshold
    pool.record_success(b)
    assert (a.state, b.state) == (State.DOWN, State.UP)
    assert pool.ready()
    assert pool.add("http://c:3")[0].state is State.PENDING


def test_without_health_checks_instances_start_up() -> None:
    pool, _ = pool_of("http://a:1")
    assert pool.instances[0].state is State.UP and pool.ready()


def test_past_its_backoff_a_down_instance_gets_a_trial_leg() -> None:
    pool, clock = pool_of("http://a:1", "http://b:2")
    a, b = pool.instances
    for _ in range(3):
        pool.record_failure(a, "refused")
    assert [pool.available(i) for i in (a, b)] == [False, True]
    clock.advance(1.0)
    assert {pool.choose()[0], pool.choose()[0]} == {a, b}
    assert pool.ready()  # b is up


def test_backoff_doubles_with_each_failure_past_the_threshold_and_is_capped() -> None:
    pool, clock = pool_of("http://a:1", "http://b:2")
    a, _ = pool.instances
    for _ in range(2):
        pool.record_failure(a, "refused")
    waits = []
    for _ in range(8):
        pool.record_failure(a, "refused")
        waits.append(pool.retry_after())
        clock.advance(waits[-1])
    assert waits == [1, 2, 4, 8, 16, BACKOFF_MAX, BACKOFF_MAX, BACKOFF_MAX]


def test_panic_when_every_instance_is_down_legs_still_go_to_them() -> None:
    pool, clock = pool_of("http://a:1", "http://b:2")
    a, b = pool.instances
    for instance in (a, b):
        for _ in range(3):
            pool.record_failure(instance, "refused")
    assert not pool.ready()  # /healthcheck: not ready, and it stays so
    assert [pool.choose()[0], pool.choose()[0], pool.choose()[0]] == [a, b, a]
    assert pool.panicking
    with pytest.raises(NoHealthyInstance) as caught:
        pool.choose([a, b])[0]  # every one already tried for this leg
    assert caught.value.role == "prefill"
    for _ in range(2):
        pool.record_success(b)
    clock.advance(0.1)
    assert pool.choose()[0] is b and not pool.panicking


def test_a_models_instances_in_panic_are_said_once_while_the_others_serve() -> None:
    pool, _ = pool_of("http://a:1", "http://b:2")
    a, b = pool.instances
    a.named, b.named = frozenset({"llama"}), frozenset({"qwen"})
    for _ in range(3):
        pool.record_failure(a, "refused")
    said: list[str] = []

    @provider(ILogObserver)
    def observer(event: dict[str, Any]) -> None:
        if event.get("log_namespace") == "nixl_twisted.backends.pools":
            said.append(formatEvent(event))

    globalLogPublisher.addObserver(observer)
    try:
        for _ in range(3):
            assert pool.choose(routing=Routing(model="llama"))[0] is a and pool.panicking
            assert pool.choose(routing=Routing(model="qwen"))[0] is b and not pool.panicking
        for _ in range(2):
            pool.record_success(a)
        pool.choose(routing=Routing(model="llama"))
    finally:
        globalLogPublisher.removeObserver(observer)
    assert said == [
        "prefill pool in panic: every instance serving 'llama' is down, legs go to them anyway",
        "prefill instance http://a:1 is back",
        "prefill pool out of panic (serving 'llama')",
    ]


def test_draining_instances_are_not_used_even_in_panic() -> None:
    pool, _ = pool_of("http://a:1", "http://b:2")
    a, b = pool.instances
    a.in_flight = 1
    pool.drain(a.url)
    for _ in range(3):
        pool.record_failure(b, "refused")
    assert [pool.choose()[0], pool.choose()[0]] == [b, b]


def test_a_worker_pool_reports_outcomes_and_adopts_the_verdict() -> None:
    supervisor, _ = pool_of("http://a:1")
    worker, _ = pool_of("http://a:1")
    reports: list[tuple[str, str, str | None]] = []
    worker.report = lambda *outcome: reports.append(outcome)
    changes: list[dict[str, object]] = []
    supervisor.on_change = lambda instance: changes.append(instance.health())
    (mine,) = worker.instances
    worker.record_success(mine)  # up, no failures: nothing worth a message
    worker.record_failure(mine, "refused")
    assert reports == [("prefill", "http://a:1", "refused")]
    assert mine.failures == 0  # not judged here
    (theirs,) = supervisor.instances
    for _ in range(3):
        supervisor.record_failure(theirs, "refused")
    worker.adopt(changes[-1])
    assert mine.state is State.DOWN and mine.failures == 3
    worker.record_success(mine)  # now worth reporting: it may bring the instance back
    assert reports[-1] == ("prefill", "http://a:1", None)


def test_next_skips_instances_already_tried() -> None:
    pool, _ = pool_of("http://a:1", "http://b:2")
    a, b = pool.instances
    assert pool.choose([a])[0] is b
    assert pool.choose([a])[0] is b
    with pytest.raises(NoHealthyInstance):
        pool.choose([a, b])[0]


def test_a_reload_says_once_that_an_instance_drains_and_a_removal_is_said_too() -> None:
    pool, _ = pool_of("http://a:1", "http://b:1")
    b = pool.instances[1]
    lease = pool.lease(b)  # b's leg keeps it draining through every reload
    said: list[str] = []

    @provider(ILogObserver)
    def observer(event: dict[str, Any]) -> None:
        if event.get("log_namespace") in (
            "nixl_twisted.backends.pools",
            "nixl_twisted.backends.roster",
        ):
            said.append(formatEvent(event))

    globalLogPublisher.addObserver(observer)
    try:
        for _ in range(3):
            pool.update(["http://a:1"])
        pool.remove("http://b:1")
    finally:
        globalLogPublisher.removeObserver(observer)
    assert said == ["prefill instance http://b:1 draining", "prefill instance http://b:1 removed"]
    lease.release()


def test_an_instance_the_admin_api_drained_stays_out_while_its_source_lists_it() -> None:
    pool = BackendPool("decode", [], Clock())
    source = "dns+http://d.test:1"
    pool.discovered(source, ["http://10.0.0.1:1", "http://10.0.0.2:1"])
    pool.drain("http://10.0.0.1:1")  # idle: gone at once
    pool.discovered(source, ["http://10.0.0.1:1", "http://10.0.0.2:1", "http://10.0.0.3:1"])
    assert [i.url for i in pool.instances] == ["http://10.0.0.2:1", "http://10.0.0.3:1"]
    # Its source stops listing it, then lists it again: it is back.
    pool.discovered(source, ["http://10.0.0.2:1", "http://10.0.0.3:1"])
    (back,), _ = pool.discovered(source, ["http://10.0.0.1:1", "http://10.0.0.2:1"])
    assert back.url == "http://10.0.0.1:1" and not back.draining


def test_a_retired_source_keeps_the_pools_last_instances_until_another_joins() -> None:
    pool = BackendPool("decode", [], Clock())
    pool.discovers = True
    pool.discovered("kubernetes:ns/app=x", ["http://10.0.0.1:1"])
    # The selector was renamed by a reload: the old source's instances are the last.
    _, leaving = pool.discovered("kubernetes:ns/app=x", [], retire=True)
    assert leaving == [] and not pool.instances[0].draining
    assert pool.choose()[0].url == "http://10.0.0.1:1"
    (joined,), _ = pool.discovered("kubernetes:ns/app=x,tier=gpu", ["http://10.0.0.9:1"])
    assert [(i.url, i.draining) for i in pool.instances] == [("http://10.0.0.9:1", False)]
    assert joined.url == "http://10.0.0.9:1"


def test_a_reload_from_urls_to_a_name_keeps_the_urls_until_the_name_answers() -> None:
    pool = BackendPool("decode", ["http://static:1"], Clock())
    pool.discovers = True
    pool.update([])
    assert [(i.url, i.draining) for i in pool.instances] == [("http://static:1", False)]
    assert pool.instances[0].source == "static"
    pool.discovered("dns+http://d.test:1", ["http://10.0.0.1:1"])
    assert [(i.url, i.draining) for i in pool.instances] == [("http://10.0.0.1:1", False)]


def test_marked_down_after_one_failure_says_one_failure() -> None:
    """An unhealthy threshold of 1 said "after 1 failures in a row"."""
    said: list[str] = []

    @provider(ILogObserver)
    def observer(event: dict[str, Any]) -> None:
        if event.get("log_namespace") == "nixl_twisted.backends.pools":
            said.append(formatEvent(event))

    pool = BackendPool("decode", ["http://a:1", "http://b:2"], Clock(), Thresholds(1, 2), False)
    a, _ = pool.instances
    globalLogPublisher.addObserver(observer)
    try:
        pool.record_failure(a, "refused")
    finally:
        globalLogPublisher.removeObserver(observer)
    assert said == ["decode instance http://a:1 marked down after 1 failure in a row: refused"]
