"""One DNS query and what it came to: its records, or why it failed, in words.

A name's A and AAAA queries succeed or fail each on its own (dnsmasq with
no upstream answers A from its hosts file and refuses AAAA). Twisted Names
fails a query with an exception that holds the whole reply
(``DNSQueryRefusedError(<Message ... rCode=5 ...>)``); the log and
``/healthcheck`` say instead "AAAA query for NAME refused by the server
(REFUSED)". Its resolver's chatter (four lines for each UDP query: the port
and the protocol starting and stopping) is logged at debug, not info, and
its timers (each try's timeout) run on the proxy's clock, as every other
timeout of the proxy does.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from twisted.internet import defer, udp
from twisted.internet.error import ConnectError
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.logger import LogLevel
from twisted.names import dns
from twisted.names.error import (
    DNSFormatError,
    DNSNameError,
    DNSNotImplementedError,
    DNSQueryRefusedError,
    DNSServerError,
    DNSUnknownError,
    DomainError,
    ResolverError,
)
from twisted.python import log as legacy_log
from twisted.python.failure import Failure

#: Each answer's error code, as the words after "A query for NAME".
_REFUSALS: tuple[tuple[type[Exception], str], ...] = (
    (DNSQueryRefusedError, "refused by the server (REFUSED)"),
    (DNSServerError, "failed at the server (SERVFAIL)"),
    (DNSFormatError, "refused as malformed by the server (FORMERR)"),
    (DNSNotImplementedError, "not supported by the server (NOTIMP)"),
    (DNSNameError, "answered: no such name (NXDOMAIN)"),
)

#: The log context of Twisted Names' per-query lines: debug (syslog's LOG_DEBUG, 7),
#: under its own namespace, so that ``--log-level info`` leaves them out.
_CHATTER = {"log_level": LogLevel.debug, "log_namespace": "twisted.names", "syslogPriority": 7}

#: (address, TTL) records of one type, as a query gave them.
Records = tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class Asked:
    """One query for one name: its records (none for NXDOMAIN or NODATA), or why it failed."""

    kind: str
    name: str
    records: Records = ()
    why: str | None = None

    def __str__(self) -> str:
        return f"{self.kind} query for {self.name} {self.why or 'answered'}"


def why(failure: Failure) -> str:
    """Why a query failed, in the words that follow "A query for NAME"."""
    error = failure.value
    for kind, words in _REFUSALS:
        if isinstance(error, kind):
            return words
    if isinstance(error, DNSUnknownError):
        reply = error.args[0] if error.args else None
        return f"failed with the server's error code {getattr(reply, 'rCode', '?')}"
    if isinstance(error, (defer.TimeoutError, TimeoutError)):
        return "got no answer in time (timed out)"
    if isinstance(error, ConnectError):
        return f"could not reach the server ({error.__class__.__name__})"
    if isinstance(error, (DomainError, ResolverError, OSError)):
        return f"could not be asked ({error.__class__.__name__}: {error})"
    return f"failed ({error.__class__.__name__}: {error})"


async def ask_addresses(resolver: Any, name: str) -> tuple[Asked, Asked]:
    """``name``'s A and AAAA queries, asked together, each answered or failed on its own."""
    asked = [resolver.lookupAddress(name), resolver.lookupIPV6Address(name)]
    results = await defer.DeferredList(asked, consumeErrors=True)
    (a_ok, a_result), (aaaa_ok, aaaa_result) = results
    return (
        _asked("A", name, a_ok, a_result),
        _asked("AAAA", name, aaaa_ok, aaaa_result),
    )


def _asked(kind: str, name: str, ok: bool, result: Any) -> Asked:
    if not ok:
        assert isinstance(result, Failure)
        if result.check(DNSNameError):
            return Asked(kind, name)  # the name exists nowhere: authoritatively none
        return Asked(kind, name, why=why(result))
    answers, _, _ = result
    found: list[tuple[str, float]] = []
    for record in answers:
        if record.type == dns.A and kind == "A":
            found.append((record.payload.dottedQuad(), float(record.ttl)))
        elif record.type == dns.AAAA and kind == "AAAA":
            address = socket.inet_ntop(socket.AF_INET6, record.payload.address)
            found.append((address, float(record.ttl)))
    return Asked(kind, name, tuple(found))


def query_reactor(reactor: Any, clock: IReactorTime) -> Any:
    """The reactor Twisted Names' client is given: ``reactor``'s UDP, ``clock``'s time,
    its query ports' lines at debug."""
    return _QueryReactor(reactor, clock)


def _chatter(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return legacy_log.callWithContext(_CHATTER, call, *args, **kwargs)


class _QueryReactor:
    """The reactor, but for time and the UDP port each query opens.

    Time is the clock's: a try's timeout (``QUERY_TIMEOUT``) and the system
    resolver's re-reading of resolv.conf are timers like the proxy's others
    (in production the clock is the reactor; in a test, a ``Clock`` the test
    advances). The port and its protocol log at debug: the protocol's
    "Starting protocol" and "Stopping protocol" go with ``noisy = False``;
    the port logs "starting on N" and "(UDP Port N Closed)" whatever it is
    told, so it is opened in the debug context and closes (a ``callLater``
    of its reactor) in it too.
    """

    def __init__(self, reactor: Any, clock: IReactorTime) -> None:
        self._reactor = reactor
        self._clock = clock
        self._ports = _PortReactor(reactor)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reactor, name)

    def seconds(self) -> float:
        return self._clock.seconds()

    def callLater(
        self, delay: float, call: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> IDelayedCall:
        return self._clock.callLater(delay, call, *args, **kwargs)

    def listenUDP(
        self, port: int, protocol: Any, interface: str = "", maxPacketSize: int = 8192
    ) -> udp.Port:
        protocol.noisy = False
        # (What PosixReactorBase.listenUDP does, with the port's reactor ours.)
        listening = udp.Port(port, protocol, interface, maxPacketSize, self._ports)
        _chatter(listening.startListening)
        return listening


class _PortReactor:
    """The reactor of a query's UDP port: what it calls later runs in the debug context.

    Its time stays the reactor's: the port closes a turn of the reactor after
    its query ends, which no test's ``Clock`` would ever advance to.
    """

    def __init__(self, reactor: Any) -> None:
        self._reactor = reactor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reactor, name)

    def callLater(self, delay: float, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self._reactor.callLater(delay, _chatter, call, *args, **kwargs)
