"""SIGHUP's reload through the service: the file's pools, or nothing changed and the key logged."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import ILogObserver, globalLogPublisher
from zope.interface import provider

from nixl_twisted.config import resolve
from nixl_twisted.service import ProxyService, build


def proxy_from(path: Path) -> ProxyService:
    config = resolve({"health-interval": 0}, str(path), {})
    return build(config, MemoryReactorClock(), clock=Clock(), take_signals=False)


@pytest.fixture
def logged() -> Iterator[list[dict[str, Any]]]:
    events: list[dict[str, Any]] = []

    @provider(ILogObserver)
    def observer(event: dict[str, Any]) -> None:
        events.append(event)

    globalLogPublisher.addObserver(observer)
    yield events
    globalLogPublisher.removeObserver(observer)


def test_a_reload_makes_the_pools_what_the_file_says(tmp_path: Path) -> None:
    path = tmp_path / "nixlproxy.toml"
    path.write_text('prefill = ["http://p1:1"]\ndecode = ["http://d1:1"]\n')
    service = proxy_from(path)
    path.write_text('prefill = ["http://p1:1", "http://p2:1"]\ndecode = ["http://d2:1"]\n')
    service.reload_pools()
    assert service.backends.prefill.urls == ("http://p1:1", "http://p2:1")
    assert service.backends.decode.urls == ("http://d2:1",)  # d1 had no leg: gone at once
    assert service.config.pools.decode == ("http://d2:1",)


def test_a_reload_that_fails_leaves_the_pools_alone_and_logs_the_key(
    tmp_path: Path, logged: list[dict[str, Any]]
) -> None:
    path = tmp_path / "nixlproxy.toml"
    path.write_text('prefill = ["http://p1:1"]\ndecode = ["http://d1:1"]\n')
    service = proxy_from(path)
    path.write_text('prefill = ["http://p9:1"]\ndecode = ["d9:1"]\n')
    service.reload_pools()
    assert service.backends.prefill.urls == ("http://p1:1",)  # not half applied
    assert service.backends.decode.urls == ("http://d1:1",)
    (error,) = [e for e in logged if e.get("log_format", "").startswith("SIGHUP: pools not")]
    assert error["key"] == "decode"
    assert "'d9:1' must start with http://" in error["error"]


def test_a_reload_changes_the_policies_too(tmp_path: Path) -> None:
    path = tmp_path / "nixlproxy.toml"
    path.write_text('prefill = ["http://p1:1"]\ndecode = ["http://d1:1"]\n')
    service = proxy_from(path)
    assert service.backends.prefill.policy_name == "round-robin"
    path.write_text(
        'prefill = ["http://p1:1"]\ndecode = ["http://d1:1"]\n'
        'prefill-policy = "cache-aware"\ndecode-policy = "least-loaded"\n'
    )
    service.reload_pools()
    pools = service.backends
    assert (pools.prefill.policy_name, pools.decode.policy_name) == ("cache-aware", "least-loaded")
    path.write_text('prefill = ["http://p1:1"]\ndecode = ["http://d1:1"]\nprefill-policy = "x"\n')
    service.reload_pools()  # refused, named; the policy stays
    assert pools.prefill.policy_name == "cache-aware"
