"""Unhandled errors fail plain pytest tests too (trial TestCases do this themselves)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from twisted.logger import ILogObserver, globalLogPublisher
from twisted.trial.unittest import SynchronousTestCase
from zope.interface import provider


@pytest.fixture(autouse=True)
def fail_on_logged_failures(request: pytest.FixtureRequest) -> Iterator[None]:
    if isinstance(request.instance, SynchronousTestCase):
        yield
        return
    failures: list[dict[str, Any]] = []

    @provider(ILogObserver)
    def observe(event: dict[str, Any]) -> None:
        if "log_failure" in event:
            failures.append(event)

    globalLogPublisher.addObserver(observe)
    try:
        yield
    finally:
        globalLogPublisher.removeObserver(observe)
    assert not failures, [str(event["log_failure"]) for event in failures]
