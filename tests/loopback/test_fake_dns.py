"""``FakeDns`` asked by Twisted's own resolver over real loopback UDP and TCP.

Each test reads answers as the proxy will, through
``twisted.names.client.Resolver``; the resolver's UDP sockets close after each
answer, and its TCP connections are closed and waited for before the server
stops, so no test leaves a socket behind. The order of a reply and
``asked()`` is checked in memory, where the written bytes can be looked at.
"""

from __future__ import annotations

import errno
import socket
from typing import Any, Literal, cast

from twisted.internet import reactor
from twisted.internet.address import IPv4Address
from twisted.internet.defer import CancelledError, Deferred, succeed
from twisted.internet.error import CannotListenError, ConnectionDone, ConnectionRefusedError
from twisted.internet.interfaces import IReactorUDP
from twisted.internet.protocol import DatagramProtocol, ServerFactory
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.names import client, dns
from twisted.names.error import DNSNameError, DNSServerError
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase

from nixl_twisted.testing.dns import LISTEN_ATTEMPTS, FakeDns


class Resolver(client.Resolver):
    """Twisted's resolver, able to close its TCP connections and say when they are gone."""

    def __init__(self, fake: FakeDns) -> None:
        super().__init__(servers=[("127.0.0.1", fake.port)], timeout=(1,))
        self._closed: list[Deferred[None]] = []

    def connectionLost(self, protocol: dns.DNSProtocol) -> None:
        super().connectionLost(protocol)
        if not self.connections:
            closed, self._closed = self._closed, []
            for waiting in closed:
                waiting.callback(None)

    def closed(self) -> Deferred[None]:
        """Fires once every TCP connection is gone (at once if none is open)."""
        if not self.connections:
            return succeed(None)
        waiting: Deferred[None] = Deferred()
        self._closed.append(waiting)
        return waiting

    def close(self) -> Deferred[None]:
        for protocol in list(self.connections):
            protocol.transport.loseConnection()
        return self.closed()


def addresses(answers: list[dns.RRHeader]) -> list[tuple[str, str, int]]:
    """Each answer's type, address and TTL."""
    found = []
    for answer in answers:
        payload: Any = answer.payload
        family = socket.AF_INET if answer.type == dns.A else socket.AF_INET6
        address = socket.inet_ntop(family, payload.address)
        found.append((dns.QUERY_TYPES[answer.type], address, answer.ttl))
    return found


def services(answers: list[dns.RRHeader]) -> list[tuple[str, int, int, int, int]]:
    """Each SRV answer's target, port, priority, weight and TTL."""
    records: list[tuple[Any, int]] = [(answer.payload, answer.ttl) for answer in answers]
    return [(r.target.name.decode(), r.port, r.priority, r.weight, ttl) for r, ttl in records]


class FakeDnsTests(TestCase):
    timeout = 10  # seconds; each test takes a few milliseconds

    async def serving(self, ttl: int = 1) -> tuple[FakeDns, Resolver]:
        """A fake listening, and a resolver asking it; both closed after the test."""
        fake = FakeDns(ttl=ttl)
        address = await fake.listen()
        self.assertEqual(address, f"127.0.0.1:{fake.port}")
        self.assertEqual(fake.address, address)
        self.addCleanup(fake.stop)
        resolver = Resolver(fake)
        self.addCleanup(resolver.close)  # runs before fake.stop: cleanups are last in, first out
        return fake, resolver

    async def test_a_and_aaaa_answers_carry_each_address_and_its_ttl(self) -> None:
        fake, resolver = await self.serving(ttl=7)
        fake.set_addresses("Backend.Test.", ["10.0.0.1", "fd00::1", "10.0.0.2"])
        fake.set_addresses("other.test", ["10.9.9.9"], ttl=300)

        answers, authority, additional = await resolver.lookupAddress("backend.TEST")
        self.assertEqual(addresses(answers), [("A", "10.0.0.1", 7), ("A", "10.0.0.2", 7)])
        self.assertEqual((authority, additional), ([], []))
        self.assertTrue(all(answer.auth for answer in answers))
        answers, _, _ = await resolver.lookupIPV6Address("backend.test.")
        self.assertEqual(addresses(answers), [("AAAA", "fd00::1", 7)])
        answers, _, _ = await resolver.lookupAddress("other.test")
        self.assertEqual(addresses(answers), [("A", "10.9.9.9", 300)])

        message = await resolver.queryUDP([dns.Query("backend.test", dns.A)])
        self.assertEqual((message.rCode, message.auth), (dns.OK, True))
        self.assertEqual(
            fake.queries,
            [
                ("backend.test", "A"),
                ("backend.test", "AAAA"),
                ("other.test", "A"),
                ("backend.test", "A"),
            ],
        )

    async def test_srv_answers_carry_targets_ports_priorities_and_weights(self) -> None:
        fake, resolver = await self.serving()
        fake.set_services(
            "_http._tcp.decode.test",
            [("decode-0.decode.test.", 8000), ("decode-1.decode.test", 8001, 10, 5)],
            ttl=30,
        )
        answers, _, _ = await resolver.lookupService("_http._tcp.decode.test")
        self.assertEqual(
            services(answers),
            [("decode-0.decode.test", 8000, 0, 0, 30), ("decode-1.decode.test", 8001, 10, 5, 30)],
        )
        # The targets were never set: a real cluster's DNS may lag the same way.
        with self.assertRaises(DNSNameError):
            await resolver.lookupAddress("decode-0.decode.test")

    async def test_a_type_the_name_lacks_is_nodata_and_an_unknown_name_nxdomain(self) -> None:
        fake, resolver = await self.serving()
        fake.set_addresses("backend.test", ["10.0.0.1"])
        fake.set_empty("empty.test")

        self.assertEqual(await resolver.lookupIPV6Address("backend.test"), ([], [], []))
        self.assertEqual(await resolver.lookupService("backend.test"), ([], [], []))
        for kind in (dns.A, dns.AAAA, dns.SRV, dns.ALL_RECORDS):
            message = await resolver.queryUDP([dns.Query("empty.test", kind)])
            self.assertEqual((message.rCode, message.auth, message.answers), (dns.OK, True, []))

        with self.assertRaises(DNSNameError):
            await resolver.lookupAddress("never-set.test")
        with self.assertRaises(DNSNameError):
            await resolver.lookupService("never-set.test")
        message = await resolver.queryUDP([dns.Query("never-set.test", dns.A)])
        self.assertEqual((message.rCode, message.auth), (dns.ENAME, True))

        fake.remove("backend.test")
        with self.assertRaises(DNSNameError):
            await resolver.lookupAddress("backend.test")
        fake.remove("empty.test")
        with self.assertRaises(DNSNameError):
            await resolver.lookupAddress("empty.test")

    async def test_a_failing_name_is_servfail_until_it_recovers(self) -> None:
        fake, resolver = await self.serving()
        fake.set_addresses("backend.test", ["10.0.0.1"])
        fake.fail("Backend.Test.")

        with self.assertRaises(DNSServerError):
            await resolver.lookupAddress("backend.test")
        with self.assertRaises(DNSServerError):
            await resolver.lookupService("backend.test")
        fake.fail("never-set.test")
        with self.assertRaises(DNSServerError):
            await resolver.lookupAddress("never-set.test")
        message = await resolver.queryUDP([dns.Query("backend.test", dns.A)])
        self.assertEqual((message.rCode, message.auth), (dns.ESERVER, False))

        fake.fail("backend.test", False)
        answers, _, _ = await resolver.lookupAddress("backend.test")
        self.assertEqual(addresses(answers), [("A", "10.0.0.1", 1)])
        fake.remove("never-set.test")  # NXDOMAIN from now on, failing or not
        with self.assertRaises(DNSNameError):
            await resolver.lookupAddress("never-set.test")

    async def test_a_changed_record_is_answered_anew_at_the_next_query(self) -> None:
        fake, resolver = await self.serving()
        fake.set_addresses("backend.test", ["10.0.0.1", "fd00::1"])
        fake.set_services("_http._tcp.backend.test", [("a.test", 80)])
        answers, _, _ = await resolver.lookupAddress("backend.test")
        self.assertEqual(addresses(answers), [("A", "10.0.0.1", 1)])

        fake.set_addresses("backend.test", ["10.0.0.2", "10.0.0.3"], ttl=5)
        answers, _, _ = await resolver.lookupAddress("backend.test")
        self.assertEqual(addresses(answers), [("A", "10.0.0.2", 5), ("A", "10.0.0.3", 5)])
        # Setting addresses replaces both families.
        self.assertEqual(await resolver.lookupIPV6Address("backend.test"), ([], [], []))

        fake.set_services("_http._tcp.backend.test", [("b.test", 81)])
        fake.set_addresses("_http._tcp.backend.test", ["10.0.0.4"])  # a name may have both
        answers, _, _ = await resolver.lookupService("_http._tcp.backend.test")
        self.assertEqual(services(answers), [("b.test", 81, 0, 0, 1)])
        answers, _, _ = await resolver.lookupAddress("_http._tcp.backend.test")
        self.assertEqual(addresses(answers), [("A", "10.0.0.4", 1)])

        fake.set_empty("backend.test")
        self.assertEqual(await resolver.lookupAddress("backend.test"), ([], [], []))

    async def test_asked_fires_at_the_next_answered_query_of_its_name(self) -> None:
        fake, resolver = await self.serving()
        fake.set_addresses("backend.test", ["10.0.0.1"])
        await resolver.lookupAddress("backend.test")

        asked = fake.asked("Backend.Test.")
        other = fake.asked("other.test")
        self.assertNoResult(asked)  # the query before it does not count
        answer = resolver.lookupService("backend.test")
        self.assertEqual(await asked, "SRV")
        self.assertEqual(await answer, ([], [], []))
        self.assertNoResult(other)

        fake.fail("other.test")
        failed = resolver.lookupAddress("other.test")
        self.assertEqual(await other, "A")  # a SERVFAIL answers too
        with self.assertRaises(DNSServerError):
            await failed

        cancelled = fake.asked("backend.test")
        cancelled.cancel()
        self.failureResultOf(cancelled, CancelledError)
        asked = fake.asked("backend.test")
        await resolver.lookupIPV6Address("backend.test")  # the cancelled one is not fired again
        self.assertEqual(self.successResultOf(asked), "AAAA")

    async def test_tcp_queries_are_answered_as_udp_ones(self) -> None:
        fake, resolver = await self.serving()
        fake.set_addresses("backend.test", ["10.0.0.1", "fd00::1"])
        asked = fake.asked("backend.test")
        message = await resolver.queryTCP([dns.Query("backend.test", dns.AAAA)])
        self.assertEqual((message.rCode, message.auth), (dns.OK, True))
        self.assertEqual(addresses(message.answers), [("AAAA", "fd00::1", 1)])
        self.assertEqual(self.successResultOf(asked), "AAAA")
        message = await resolver.queryTCP([dns.Query("gone.test", dns.A)])
        self.assertEqual((message.rCode, message.auth), (dns.ENAME, True))
        self.assertEqual(len(resolver.connections), 1)  # one connection for both

    async def test_stop_frees_both_ports_closes_tcp_connections_and_is_idempotent(self) -> None:
        fake, resolver = await self.serving()
        fake.set_addresses("backend.test", ["10.0.0.1"])
        await resolver.queryTCP([dns.Query("backend.test", dns.A)])
        closed = resolver.closed()
        self.assertNoResult(closed)

        await fake.stop()
        await closed  # the server hung up on the client's open connection
        await fake.stop()

        with self.assertRaises(ConnectionRefusedError):
            await resolver.queryTCP([dns.Query("backend.test", dns.A)])
        # Both ports are free again: a stopped fake holds neither.
        udp = cast(IReactorUDP, reactor).listenUDP(fake.port, DatagramProtocol(), "127.0.0.1", 8192)
        self.addCleanup(udp.stopListening)
        tcp = reactor.listenTCP(fake.port, ServerFactory(), interface="127.0.0.1")
        self.addCleanup(tcp.stopListening)


class Datagrams:
    """A UDP transport in memory: what is written, and where to."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Any]] = []

    def write(self, data: bytes, address: Any) -> None:
        self.sent.append((data, address))


class Port:
    """A listening port in memory."""

    def __init__(self, kind: Literal["TCP", "UDP"], number: int) -> None:
        self.address = IPv4Address(kind, "127.0.0.1", number)
        self.listening = True

    def getHost(self) -> IPv4Address:
        return self.address

    def stopListening(self) -> None:
        self.listening = False


class Reactor(MemoryReactorClock):
    """A memory reactor with UDP, whose first ``taken`` TCP ports are already in use."""

    def __init__(self, taken: int = 0) -> None:
        super().__init__()
        self.taken = taken
        self.udp: list[tuple[Port, DatagramProtocol]] = []
        self.tcp: list[Port] = []

    def listenUDP(
        self, port: int, protocol: DatagramProtocol, interface: str = "", maxPacketSize: int = 8192
    ) -> Port:
        listening = Port("UDP", 5300 + len(self.udp))
        self.udp.append((listening, protocol))
        return listening

    def listenTCP(self, port: int, factory: Any, backlog: int = 50, interface: str = "") -> Port:
        self.tcpServers.append((port, factory, backlog, interface))
        if len(self.tcpServers) <= self.taken:
            raise CannotListenError(interface, port, OSError(errno.EADDRINUSE, "in use"))
        listening = Port("TCP", port)
        self.tcp.append(listening)
        return listening


def query(name: str, kind: int) -> bytes:
    message = dns.Message(id=1234)
    message.queries = [dns.Query(name, kind)]
    return message.toStr()


class InMemoryTests(TestCase):
    """What the loopback tests cannot see: the order of writes, and a port taken."""

    async def test_asked_fires_after_the_reply_is_written(self) -> None:
        fake = FakeDns()
        memory = Reactor()
        self.assertEqual(await fake.listen(reactor=memory), "127.0.0.1:5300")
        fake.set_addresses("backend.test", ["10.0.0.1"])
        (_, protocol), transport = memory.udp[0], Datagrams()
        protocol.makeConnection(transport)  # type: ignore[arg-type]  # only write() is used

        written: list[int] = []
        asked = fake.asked("backend.test")
        asked.addCallback(lambda kind: written.append(len(transport.sent)))
        protocol.datagramReceived(query("backend.test", dns.A), ("127.0.0.1", 40000))
        self.assertEqual(written, [1])
        (reply, address), *_ = transport.sent
        message = dns.Message()
        message.fromStr(reply)
        self.assertEqual((message.id, message.rCode, address), (1234, dns.OK, ("127.0.0.1", 40000)))

        (_, factory, _, _), stream = memory.tcpServers[0], StringTransport()
        tcp = factory.buildProtocol(IPv4Address("TCP", "127.0.0.1", 40000))
        assert isinstance(tcp, dns.DNSProtocol)
        tcp.makeConnection(stream)
        asked = fake.asked("backend.test")
        asked.addCallback(lambda kind: written.append(len(stream.value())))
        data = query("backend.test", dns.SRV)
        tcp.dataReceived(len(data).to_bytes(2, "big") + data)
        self.assertGreater(written[1], 2)  # the length prefix and a reply, before asked fired
        stopped = fake.stop()
        self.assertNoResult(stopped)  # until the TCP connection it closed is gone
        self.assertTrue(stream.disconnecting)
        tcp.connectionLost(Failure(ConnectionDone()))
        self.successResultOf(stopped)

    async def test_a_taken_tcp_port_is_left_for_another_pair(self) -> None:
        fake = FakeDns()
        memory = Reactor(taken=2)
        self.assertEqual(await fake.listen(reactor=memory), "127.0.0.1:5302")
        self.assertEqual([port.listening for port, _ in memory.udp], [False, False, True])
        self.assertEqual([server[0] for server in memory.tcpServers], [5300, 5301, 5302])
        await fake.stop()
        self.assertFalse(memory.udp[2][0].listening or memory.tcp[0].listening)

    async def test_listening_fails_when_every_tcp_twin_is_taken(self) -> None:
        memory = Reactor(taken=LISTEN_ATTEMPTS)
        with self.assertRaises(CannotListenError):
            await FakeDns().listen(reactor=memory)
        self.assertEqual(len(memory.udp), LISTEN_ATTEMPTS)
        self.assertFalse(any(port.listening for port, _ in memory.udp))

    def test_a_bad_address_or_ttl_is_refused_when_set(self) -> None:
        fake = FakeDns()
        with self.assertRaises(ValueError):
            fake.set_addresses("backend.test", ["10.0.0.300"])
        with self.assertRaises(ValueError):
            fake.set_services("backend.test", [("a.test", 80)], ttl=-1)
