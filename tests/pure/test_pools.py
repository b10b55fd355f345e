"""Backend URLs and round-robin rotation."""

from __future__ import annotations

import pytest
from twisted.internet.task import Clock

from nixl_twisted.pools import BACKOFF_MAX, BackendPool, NoHealthyInstance
from nixl_twisted.settings import InvalidValue, backend_url


def test_round_robin_in_order_and_wraps() -> None:
    pool = BackendPool("decode", ["http://a:1", "http://b:2", "http://c:3"], Clock())
    assert [pool.next().url for _ in range(7)] == [
        "http://a:1",
        "http://b:2",
        "http://c:3",
        "http://a:1",
        "http://b:2",
        "http://c:3",
        "http://a:1",
    ]
    assert len(pool) == 3


def test_a_pool_needs_an_instance() -> None:
    with pytest.raises(ValueError, match="at least one"):
        BackendPool("prefill", [], Clock())


@pytest.mark.parametrize(
    ("url", "normal"),
    [
        ("http://10.0.0.1:8100", "http://10.0.0.1:8100"),
        ("http://p1:8100/", "http://p1:8100"),
        ("https://p1.example/vllm/", "https://p1.example/vllm"),
        ("http://[::1]:8100", "http://[::1]:8100"),
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
        ("http://user:pw@p1:8100", "credentials"),
    ],
)
def test_invalid_urls_say_why(url: str, why: str) -> None:
    with pytest.raises(InvalidValue, match=why):
        backend_url(url)


def pool_of(*urls: str) -> tuple[BackendPool, Clock]:
    clock = Clock()
    return BackendPool("prefill", list(urls), clock), clock


def test_an_instance_marked_down_is_skipped_until_its_backoff_ends() -> None:
    pool, clock = pool_of("http://a:1", "http://b:2")
    a, b = pool.instances
    pool.mark_failed(a, "connection refused")
    assert [pool.next() for _ in range(3)] == [b, b, b]
    assert [pool.available(i) for i in (a, b)] == [False, True]
    assert pool.has_available()
    clock.advance(1.0)
    # Past its backoff it gets one more chance (half-open).
    assert {pool.next(), pool.next()} == {a, b}


def test_backoff_doubles_with_each_failure_and_is_capped() -> None:
    pool, clock = pool_of("http://a:1")
    (a,) = pool.instances
    waits = []
    for _ in range(8):
        pool.mark_failed(a, "refused")
        waits.append(pool.retry_after())
        clock.advance(waits[-1])
    assert waits == [1, 2, 4, 8, 16, BACKOFF_MAX, BACKOFF_MAX, BACKOFF_MAX]
    pool.mark_ok(a)
    assert a.healthy and a.failures == 0 and a.last_error is None


def test_no_healthy_instance_is_said_at_once_with_retry_after() -> None:
    pool, clock = pool_of("http://a:1", "http://b:2")
    pool.mark_failed(pool.instances[0], "refused")
    clock.advance(0.5)
    pool.mark_failed(pool.instances[1], "refused")
    with pytest.raises(NoHealthyInstance) as caught:
        pool.next()
    assert caught.value.role == "prefill"
    assert caught.value.retry_after == pytest.approx(0.5)


def test_next_skips_instances_already_tried() -> None:
    pool, _ = pool_of("http://a:1", "http://b:2")
    a, b = pool.instances
    assert pool.next(exclude=[a]) is b
    assert pool.next(exclude=[a]) is b
    with pytest.raises(NoHealthyInstance):
        pool.next(exclude=[a, b])
