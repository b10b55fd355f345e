"""Backend URLs and round-robin rotation."""

from __future__ import annotations

import pytest

from nixl_twisted.pools import BackendPool, InvalidBackendURL, normalize_backend_url


def test_round_robin_in_order_and_wraps() -> None:
    pool = BackendPool("decode", ["http://a:1", "http://b:2", "http://c:3"])
    assert [pool.next() for _ in range(7)] == [
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
        BackendPool("prefill", [])


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
    assert normalize_backend_url(url) == normal


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
    with pytest.raises(InvalidBackendURL, match=why):
        normalize_backend_url(url)
