"""A backend's host name to its addresses, for the endpoints the upstream client connects with.

Twisted's own resolver runs ``getaddrinfo`` in a thread and takes only
``gaierror`` as "no address". Any other exception (``LookupError: unknown
encoding: idna``, when the codec cannot be loaded after ``twistd --uid``) is
left in an unhandled Deferred and the lookup never completes: the
connection, and its leg, would wait for the leg's timeout. Here every
failure completes the lookup with no address (so the connection fails with
``DNSLookupError``, and the leg as ``*_unreachable``), and one that is not
a plain "no such host" is logged with its reason.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from typing import Any

from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.defer import Deferred, fail
from twisted.internet.interfaces import (
    IAddress,
    IHostnameResolver,
    IHostResolution,
    IReactorPluggableNameResolver,
    IResolutionReceiver,
)
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

log = Logger()

#: What ``getaddrinfo`` answers: (family, type, proto, canonical name, address).
Found = list[tuple[Any, Any, int, str, tuple[Any, ...]]]
#: ``lookup(host, port, family)``: ``getaddrinfo``'s answer for TCP, or its failure.
Lookup = Callable[[str, int, int], "Deferred[Found]"]


def threaded_lookup(reactor: Any) -> Lookup:
    """``getaddrinfo`` in the reactor's thread pool, as Twisted's own resolver calls it."""

    def lookup(host: str, port: int, family: int) -> Deferred[Found]:
        pool = reactor.getThreadPool()
        return deferToThreadPool(
            reactor, pool, socket.getaddrinfo, host, port, family, socket.SOCK_STREAM
        )

    return lookup


@implementer(IHostResolution)
class _Resolution:
    def __init__(self, name: str) -> None:
        self.name = name

    def cancel(self) -> None:
        raise NotImplementedError("a lookup in a thread cannot be cancelled")


@implementer(IHostnameResolver)
class BackendResolver:
    """Resolves as Twisted does (for TCP), but every lookup completes, failed or not."""

    def __init__(self, lookup: Lookup) -> None:
        self._lookup = lookup

    def resolveHostName(
        self,
        resolutionReceiver: IResolutionReceiver,
        hostName: str,
        portNumber: int = 0,
        addressTypes: Sequence[type[IAddress]] | None = None,
        transportSemantics: str = "TCP",
    ) -> IHostResolution:
        resolution = _Resolution(hostName)
        resolutionReceiver.resolutionBegan(resolution)
        types = set(addressTypes or (IPv4Address, IPv6Address))
        family = (
            socket.AF_INET
            if types == {IPv4Address}
            else socket.AF_INET6
            if types == {IPv6Address}
            else socket.AF_UNSPEC
        )

        def found(answers: Found) -> None:
            for answer_family, _, _, _, address in answers:
                if answer_family == socket.AF_INET and IPv4Address in types:
                    resolutionReceiver.addressResolved(IPv4Address("TCP", *address))
                elif answer_family == socket.AF_INET6 and IPv6Address in types:
                    resolutionReceiver.addressResolved(IPv6Address("TCP", *address))

        def failed(failure: Failure) -> None:
            if not failure.check(socket.gaierror):
                log.warn(
                    "looking up {host} failed: {reason}",
                    host=hostName,
                    reason=failure.getErrorMessage(),
                )

        try:
            looking = self._lookup(hostName, portNumber, family)
        except Exception:
            looking = fail()
        looking.addCallback(found).addErrback(failed)
        looking.addCallback(lambda _: resolutionReceiver.resolutionComplete())
        return resolution


@implementer(IReactorPluggableNameResolver)
class ResolvingWith:
    """``reactor`` as a ``HostnameEndpoint`` sees it, its names resolved by ``resolver``.

    (A ``HostnameEndpoint`` takes no resolver: it asks its reactor for one.)
    """

    def __init__(self, reactor: Any, resolver: IHostnameResolver) -> None:
        self._reactor = reactor
        self.nameResolver = resolver

    def installNameResolver(self, resolver: IHostnameResolver) -> IHostnameResolver:
        previous, self.nameResolver = self.nameResolver, resolver
        return previous

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reactor, name)  # connectTCP, callLater, seconds, ...
