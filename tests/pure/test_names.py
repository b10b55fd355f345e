"""A backend's host name to its addresses: every lookup completes, whatever it raised."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.error import DNSLookupError
from twisted.internet.interfaces import IAddress, IHostResolution, IResolutionReceiver
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import ILogObserver, formatEvent, globalLogPublisher
from twisted.python.failure import Failure
from twisted.web.client import HTTPConnectionPool
from twisted.web.http_headers import Headers
from zope.interface import implementer, provider

from nixl_twisted.backends.names import BackendResolver, Found
from nixl_twisted.backends.upstream import Upstream, backend_agent

IDNA = LookupError("unknown encoding: idna")
ANSWERS: Found = [
    (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.7", 8100)),
    (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::7", 8100, 0, 0)),
]


@pytest.fixture
def warnings() -> Iterator[list[str]]:
    said: list[str] = []

    @provider(ILogObserver)
    def observe(event: dict[str, Any]) -> None:
        if event.get("log_namespace") == "nixl_twisted.backends.names":
            said.append(formatEvent(event))

    globalLogPublisher.addObserver(observe)
    yield said
    globalLogPublisher.removeObserver(observe)


@implementer(IResolutionReceiver)
class Receiver:
    def __init__(self) -> None:
        self.began = False
        self.addresses: list[IAddress] = []
        self.complete = False

    def resolutionBegan(self, resolutionInProgress: IHostResolution) -> None:
        self.began = True

    def addressResolved(self, address: IAddress) -> None:
        self.addresses.append(address)

    def resolutionComplete(self) -> None:
        self.complete = True


def resolve(answer: Any, types: Any = None) -> Receiver:
    """Resolve ``backend`` with a lookup whose answer is ``answer`` (raised: an exception)."""

    def lookup(host: str, port: int, family: int) -> Deferred[Found]:
        if isinstance(answer, Exception):
            raise answer
        return answer

    receiver = Receiver()
    BackendResolver(lookup).resolveHostName(receiver, "backend", 8100, types)
    return receiver


@pytest.mark.parametrize("raised", [False, True], ids=["failed", "raised"])
def test_any_error_completes_the_lookup_with_no_address_and_says_why(
    raised: bool, warnings: list[str]
) -> None:
    receiver = resolve(IDNA if raised else fail(IDNA))
    assert (receiver.began, receiver.addresses, receiver.complete) == (True, [], True)
    assert warnings == ["looking up backend failed: unknown encoding: idna"]


def test_no_such_host_completes_the_lookup_quietly(warnings: list[str]) -> None:
    receiver = resolve(fail(socket.gaierror(socket.EAI_NONAME, "Name or service not known")))
    assert (receiver.addresses, receiver.complete) == ([], True)
    assert warnings == []


def test_the_addresses_found_of_the_types_asked() -> None:
    assert resolve(succeed(ANSWERS)).addresses == [
        IPv4Address("TCP", "10.0.0.7", 8100),
        IPv6Address("TCP", "fd00::7", 8100),
    ]
    assert resolve(succeed(ANSWERS), [IPv6Address]).addresses == [
        IPv6Address("TCP", "fd00::7", 8100)
    ]


def _upstream(answer: Any) -> tuple[Upstream, MemoryReactorClock]:
    reactor = MemoryReactorClock()
    resolver = BackendResolver(lambda host, port, family: answer)
    agent = backend_agent(reactor, HTTPConnectionPool(reactor), 10.0, resolver=resolver)
    return Upstream(agent), reactor


def test_a_lookup_that_fails_with_anything_fails_the_backend_call_at_once(
    warnings: list[str],
) -> None:
    """Not left waiting for the leg's timeout: the leg ends as unreachable."""
    upstream, _ = _upstream(fail(IDNA))
    results: list[object] = []
    upstream.get("http://backend:8100/health", Headers()).addBoth(results.append)
    (failure,) = results
    assert isinstance(failure, Failure) and failure.check(DNSLookupError)
    assert warnings == ["looking up backend failed: unknown encoding: idna"]


def test_the_addresses_found_are_connected_to() -> None:
    upstream, reactor = _upstream(succeed(ANSWERS[:1]))
    upstream.get("http://backend:8100/health", Headers())
    ((host, port, *_),) = reactor.tcpClients
    assert (host, port) == ("10.0.0.7", 8100)
