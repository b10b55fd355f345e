"""What the in-memory tests observe of the proxy's log."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from twisted.logger import ILogObserver, globalLogPublisher
from zope.interface import provider


def _observing(keep: Callable[[dict[str, Any]], Any | None]) -> Iterator[list[Any]]:
    """What ``keep`` makes of each log event of the test (``None``: nothing), in order."""
    kept: list[Any] = []

    @provider(ILogObserver)
    def observer(event: dict[str, Any]) -> None:
        value = keep(event)
        if value is not None:
            kept.append(value)

    globalLogPublisher.addObserver(observer)
    try:
        yield kept
    finally:
        globalLogPublisher.removeObserver(observer)


@pytest.fixture
def logged() -> Iterator[list[dict[str, Any]]]:
    """Every log event of the test, as emitted."""
    yield from _observing(lambda event: event)


@pytest.fixture
def access_events() -> Iterator[list[dict[str, Any]]]:
    """The fields of each access event of the test."""
    yield from _observing(
        lambda event: event["access"] if event.get("log_namespace") == "nixlproxy.access" else None
    )
