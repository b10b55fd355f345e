"""``FakeDns``: a DNS server on loopback whose records tests change while it runs.

For tests of DNS discovery: the proxy resolves names against it as it would
against a cluster's DNS (``twisted.names.client.Resolver(servers=[("127.0.0.1",
port)])``, over UDP or TCP), and a test changes, empties, removes or breaks a
name between two resolutions, then waits for the next one with
:meth:`FakeDns.asked` instead of sleeping. The wire is Twisted Names' own
server; the answers come from this module's table alone, never from the
proxy's code, so a discovery bug cannot hide on both sides of a test.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from typing import Any, TypeAlias

from twisted.internet.defer import Deferred, fail, gatherResults, maybeDeferred, succeed
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IListeningPort
from twisted.names import dns
from twisted.names.common import ResolverBase
from twisted.names.server import DNSServerFactory
from twisted.python.failure import Failure

Record: TypeAlias = "dns.Record_A | dns.Record_AAAA | dns.Record_SRV"
Sections: TypeAlias = "tuple[list[dns.RRHeader], list[dns.RRHeader], list[dns.RRHeader]]"

#: Tries at finding a UDP port whose TCP twin is free too.
LISTEN_ATTEMPTS = 5


def name_key(name: str | bytes) -> str:
    """A name as the table keeps it: DNS compares names without case or the root's dot."""
    if isinstance(name, bytes):
        name = name.decode("ascii", "backslashreplace")
    return name.rstrip(".").lower()


def type_name(kind: int) -> str:
    """A record type as tests write it: ``"A"``, ``"AAAA"``, ``"SRV"``."""
    return dns.QUERY_TYPES.get(kind) or dns.EXT_QUERIES.get(kind) or str(kind)


class _Failing(Exception):
    """A name set to fail: answered SERVFAIL, and not logged as the fake's own error."""


class _Zone(ResolverBase):
    """The records tests set, answered as an authoritative server answers."""

    def __init__(self) -> None:
        super().__init__()
        # A name present with no records is the empty record set (NODATA for every type).
        self.records: dict[str, list[Record]] = {}
        self.failing: set[str] = set()

    def replace(self, name: str, kinds: set[int], records: list[Record]) -> None:
        """Give ``name`` these records in place of those of ``kinds`` it had."""
        kept = [r for r in self.records.get(name, []) if r.TYPE not in kinds]
        self.records[name] = kept + records

    def _lookup(self, name: bytes, cls: int, type: int, timeout: Any) -> Deferred[Sections]:
        key = name_key(name)
        if key in self.failing:
            return fail(_Failing(key))
        records = self.records.get(key)
        if records is None:
            return fail(dns.AuthoritativeDomainError(key))
        answers = [
            dns.RRHeader(name, record.TYPE, dns.IN, record.ttl, record, auth=True)
            for record in records
            if type in (record.TYPE, dns.ALL_RECORDS)
        ]
        return succeed((answers, [], []))


class _Server(DNSServerFactory):
    """Twisted Names' server, telling the fake each query it answered."""

    def __init__(self, zone: _Zone, answered: Any) -> None:
        super().__init__(authorities=[zone])
        self._answered = answered
        self._drained: list[Deferred[None]] = []

    def sendReply(self, protocol: Any, message: dns.Message, address: Any) -> None:
        # Twisted sets AA only when an answer is authoritative; an authoritative
        # server sets it on its NXDOMAIN and NODATA answers too.
        if message.answer and message.rCode in (dns.OK, dns.ENAME):
            message.auth = True
        super().sendReply(protocol, message, address)

    def gotResolverResponse(
        self, response: Sections, protocol: Any, message: dns.Message, address: Any
    ) -> None:
        super().gotResolverResponse(response, protocol, message, address)
        self._answered(message.queries[0])

    def gotResolverError(
        self, failure: Failure, protocol: Any, message: dns.Message, address: Any
    ) -> None:
        if failure.check(_Failing):
            reply = self._responseFromMessage(message=message, rCode=dns.ESERVER)
            self.sendReply(protocol, reply, address)
        else:  # NXDOMAIN, or a bug of the fake's own, which Twisted logs and the test sees
            super().gotResolverError(failure, protocol, message, address)
        self._answered(message.queries[0])

    def connectionLost(self, protocol: Any) -> None:
        super().connectionLost(protocol)
        if not self.connections:
            drained, self._drained = self._drained, []
            for waiting in drained:
                waiting.callback(None)

    def close_connections(self) -> Deferred[None]:
        """Close the TCP connections clients left open; fires once all are gone."""
        if not self.connections:
            return succeed(None)
        drained: Deferred[None] = Deferred()
        self._drained.append(drained)
        for protocol in list(self.connections):
            protocol.transport.loseConnection()
        return drained


class FakeDns:
    """A DNS server on loopback whose answers tests change while it runs."""

    def __init__(self, ttl: int = 1) -> None:
        #: TTL of records set without one, in seconds.
        self.ttl = ttl
        #: Every ``(name, type)`` answered, in order; the name lowercased, without its dot.
        self.queries: list[tuple[str, str]] = []
        #: ``"127.0.0.1:PORT"`` and ``PORT``, once listening (UDP and TCP share the port).
        self.address = ""
        self.port = 0
        self._zone = _Zone()
        self._server = _Server(self._zone, self._answered)
        self._ports: list[IListeningPort] = []
        self._asking: dict[str, list[Deferred[str]]] = {}

    async def listen(self, reactor: Any = None) -> str:
        """Serve UDP and TCP on one free loopback port; return ``"127.0.0.1:PORT"``."""
        if reactor is None:
            from twisted.internet import reactor as default_reactor

            reactor = default_reactor
        if self._ports:
            raise RuntimeError(f"FakeDns already listens on {self.address}")
        for attempt in range(LISTEN_ATTEMPTS):
            protocol = dns.DNSDatagramProtocol(self._server, reactor=reactor)
            udp = reactor.listenUDP(0, protocol, interface="127.0.0.1")
            port = udp.getHost().port
            try:
                tcp = reactor.listenTCP(port, self._server, interface="127.0.0.1")
            except CannotListenError:
                # Port 0 found a free UDP port, not a free TCP one: try another.
                await maybeDeferred(udp.stopListening)
                if attempt == LISTEN_ATTEMPTS - 1:
                    raise
                continue
            self._ports = [udp, tcp]
            self.port = port
            self.address = f"127.0.0.1:{port}"
            return self.address
        raise AssertionError("unreachable: the last attempt raises")

    def stop(self) -> Deferred[None]:
        """Stop both listeners and close open TCP connections; again is harmless."""
        ports, self._ports = self._ports, []
        stopping: list[Deferred[Any]] = [maybeDeferred(port.stopListening) for port in ports]
        stopping.append(self._server.close_connections())
        return gatherResults(stopping).addCallback(lambda _: None)

    def set_addresses(self, name: str, addresses: Sequence[str], ttl: int | None = None) -> None:
        """Answer ``name`` with A records for the IPv4 ``addresses`` and AAAA for the IPv6.

        Both families are replaced (a list of IPv4 alone leaves no AAAA);
        the name's SRV records stay.
        """
        ttl = self._ttl(ttl)
        records: list[Record] = []
        for text in addresses:
            address = ipaddress.ip_address(text)  # a typo fails here, not as a silent NXDOMAIN
            if address.version == 4:
                records.append(dns.Record_A(str(address), ttl))
            else:
                records.append(dns.Record_AAAA(str(address), ttl))
        self._zone.replace(name_key(name), {dns.A, dns.AAAA}, records)

    def set_services(
        self,
        name: str,
        targets: Sequence[tuple[str, int] | tuple[str, int, int, int]],
        ttl: int | None = None,
    ) -> None:
        """Answer ``name`` with SRV records: ``(target, port)``, priority and weight 0,
        or ``(target, port, priority, weight)``. Replaces the name's SRV set only;
        targets need not resolve.
        """
        ttl = self._ttl(ttl)
        records: list[Record] = []
        for target in targets:
            host, port, priority, weight = (*target, 0, 0) if len(target) == 2 else target
            records.append(dns.Record_SRV(priority, weight, port, host.rstrip("."), ttl))
        self._zone.replace(name_key(name), {dns.SRV}, records)

    def set_empty(self, name: str) -> None:
        """``name`` exists with no records of any type: NOERROR and no answers."""
        self._zone.records[name_key(name)] = []

    def remove(self, name: str) -> None:
        """NXDOMAIN for ``name`` from now on, even if it was failing."""
        key = name_key(name)
        self._zone.records.pop(key, None)
        self._zone.failing.discard(key)

    def fail(self, name: str, failing: bool = True) -> None:
        """SERVFAIL for ``name`` while ``failing``; its records wait for it to recover."""
        key = name_key(name)
        if failing:
            self._zone.failing.add(key)
        else:
            self._zone.failing.discard(key)

    def asked(self, name: str) -> Deferred[str]:
        """Fires with the type asked (``"A"``, ``"AAAA"``, ``"SRV"``) once the next
        query for ``name`` has been answered: the reply is written to the client's
        socket, which may not have read it yet.
        """
        key = name_key(name)

        def cancel(waiting: Deferred[str]) -> None:
            self._asking[key].remove(waiting)

        waiting: Deferred[str] = Deferred(cancel)
        self._asking.setdefault(key, []).append(waiting)
        return waiting

    def _ttl(self, ttl: int | None) -> int:
        ttl = self.ttl if ttl is None else ttl
        if ttl < 0:
            raise ValueError(f"a TTL is 0 or more seconds, not {ttl}")
        return ttl

    def _answered(self, query: dns.Query) -> None:
        key = name_key(query.name.name)
        kind = type_name(query.type)
        self.queries.append((key, kind))
        for waiting in self._asking.pop(key, []):
            waiting.callback(kind)
