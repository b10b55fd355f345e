"""What needs real TCP: raw bytes on a socket, slow clients and connection limits, a drain.

Admission limits, slots given back, overload logging and secrets are proved
in memory (``tests/memory/test_limits.py``).
"""

from __future__ import annotations

import json

from twisted.internet import reactor
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.error import ConnectionRefusedError
from twisted.internet.protocol import Protocol
from twisted.python.failure import Failure
from twisted.web.client import ResponseFailed

from tests.support import CHAT, ProxyCase, sse_events

STREAM = dict(CHAT, stream=True)


class RawClient(Protocol):
    """Sends bytes as they are and collects the raw answer until close."""

    def __init__(self) -> None:
        self.received = b""
        self.closed: Deferred[bytes] = Deferred()
        self._waiting: list[tuple[bytes, Deferred[None]]] = []

    def dataReceived(self, data: bytes) -> None:
        self.received += data
        for marker, waiting in [w for w in self._waiting if w[0] in self.received]:
            self._waiting.remove((marker, waiting))
            waiting.callback(None)

    def answered(self, marker: bytes) -> Deferred[None]:
        """Fires once ``marker`` has arrived."""
        waiting: Deferred[None] = Deferred()
        self._waiting.append((marker, waiting))
        self.dataReceived(b"")
        return waiting

    def connectionLost(self, reason: Failure | None = None) -> None:
        self.closed.callback(self.received)


class RawCase(ProxyCase):
    async def connect_raw(self, data: bytes) -> RawClient:
        """A connection to the proxy that sends ``data`` as it is."""
        host, port = self.proxy.url.removeprefix("http://").rsplit(":", 1)
        client = RawClient()
        await connectProtocol(TCP4ClientEndpoint(reactor, host, int(port)), client)
        client.transport.write(data)  # type: ignore[union-attr]
        return client

    async def raw(self, data: bytes) -> bytes:
        """What the proxy answers ``data``, up to its close."""
        return await (await self.connect_raw(data)).closed


class AbuseTests(RawCase):
    async def test_a_body_over_the_limit_is_413_before_it_is_read(self) -> None:
        await self.start(proxy=dict(max_body_size=1000))
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 50000000\r\n\r\n"
        )
        answer = await self.raw(head + b'{"prompt": "')  # 50 MB announced, 12 bytes sent
        status, _, body = answer.partition(b"\r\n\r\n")
        self.assertTrue(status.startswith(b"HTTP/1.1 413 "), status)
        self.assertEqual(json.loads(body)["error"]["code"], "request_too_large")
        self.assertEqual(self.prefill.requests, [])

    async def test_a_chunked_body_over_the_limit_is_413(self) -> None:
        await self.start(proxy=dict(max_body_size=1000))
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        chunk = b"%x\r\n%s\r\n" % (600, b"x" * 600)
        answer = await self.raw(head + chunk + chunk)
        self.assertTrue(answer.startswith(b"HTTP/1.1 413 "), answer[:40])
        self.assertEqual(self.prefill.requests, [])

    async def test_huge_headers_odd_methods_and_paths_get_4xx(self) -> None:
        await self.start()
        long_line = b"GET /healthcheck HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n"
        answer = await self.raw(long_line)
        self.assertTrue(answer.startswith(b"HTTP/1.1 431 "), answer[:60])
        many = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 100) for i in range(200))
        answer = await self.raw(b"GET /healthcheck HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
        self.assertTrue(answer.startswith(b"HTTP/1.1 431 "), answer[:60])
        for method in (b"BREW", b"DELETE", b"PUT"):
            answer = await self.raw(
                method + b" /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
            self.assertTrue(answer.startswith(b"HTTP/1.1 405 "), answer[:40])
        answer = await self.raw(b"GET /%ff%fe HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        self.assertTrue(answer.startswith(b"HTTP/1.1 4"), answer[:40])
        # ... and the proxy serves on.
        response = await self.post("/v1/completions", {"model": "m", "prompt": "x"})
        self.assertEqual(response.code, 200)
        await response.content()


class SlowClientTests(RawCase):
    async def test_two_slow_uploads_block_nobody_and_are_closed_at_their_deadline(self) -> None:
        await self.start(proxy=dict(max_buffered_bodies=1024 * 1024))
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: 33554432\r\n\r\n"
        )
        slow = [await self.connect_raw(head) for _ in range(2)]
        for client in slow:  # the proxy has their heads: their bodies' clocks run
            await client.answered(b"100 Continue\r\n\r\n")
            client.transport.write(b"{")  # type: ignore[union-attr]
        for _ in range(3):  # 64 MiB announced, 2 bytes held: every other body is served
            response = await self.post("/v1/completions", {"model": "m", "prompt": "x" * 1000})
            self.assertEqual(response.code, 200)
            await response.content()
        self.clock.advance(31)  # --body-timeout, 30 s: a byte now and then earns nothing
        for client in slow:
            answer = (await client.closed).removeprefix(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.assertTrue(answer.startswith(b"HTTP/1.1 408 "), answer[:40])
            self.assertIn(b'"body_timeout"', answer)

    async def test_slowloris_connections_are_closed_at_the_header_deadline(self) -> None:
        await self.start()
        loris = [await self.connect_raw(b"GET /healthcheck HTTP/1.1\r\nX-A: ") for _ in range(20)]
        self.clock.advance(9)
        for client in loris:
            client.transport.write(b"a")  # type: ignore[union-attr]
        response = await self.http.get(self.proxy.url + "/healthcheck")
        self.assertEqual(response.code, 200)  # the others are served meanwhile
        await response.content()
        # Accepted in order, so all 20 before the health check: each awaits its head.
        waiting = [c for c in self.proxy.site.channels() if c._deadlines.awaiting]  # type: ignore[attr-defined]
        self.assertEqual(len(waiting), 20)
        gone = gatherResults([self.proxy.site.connection_lost(c) for c in waiting])
        self.clock.advance(1)  # --header-timeout: 10 s
        for client in loris:
            answer = await client.closed
            self.assertTrue(answer.startswith(b"HTTP/1.1 408 "), answer[:40])
        await gone
        self.assertEqual(len(self.proxy.site.channels()), 1)  # the keep-alive client's

    async def test_past_max_connections_a_clear_refusal(self) -> None:
        await self.start(proxy=dict(max_connections=3))
        held = [await self.connect_raw(b"") for _ in range(3)]
        refused = await self.connect_raw(b"")
        answer = await refused.closed
        self.assertTrue(answer.startswith(b"HTTP/1.1 503 "), answer[:40])
        self.assertIn(b'"too_many_connections"', answer)
        for client in held:
            client.transport.loseConnection()  # type: ignore[union-attr]
            await client.closed
        response = await self.post("/v1/completions", {"model": "m", "prompt": "x"})
        self.assertEqual(response.code, 200)
        await response.content()


class DrainTests(RawCase):
    async def raw_connect(self) -> None:
        host, port = self.proxy.url.removeprefix("http://").rsplit(":", 1)
        await connectProtocol(TCP4ClientEndpoint(reactor, host, int(port)), Protocol())

    async def test_stopping_closes_idle_connections_and_lets_requests_in_flight_finish(
        self,
    ) -> None:
        await self.start(tokens=3)
        # A load balancer's kept-alive connection, idle after a health check.
        idle = await self.connect_raw(b"GET /healthcheck HTTP/1.1\r\nHost: x\r\n\r\n")
        await idle.answered(b"\r\n\r\n")
        self.assertNotIn(b"Connection: close", idle.received)  # kept alive before the stop
        collector = await self.held_stream()

        stopped = self.proxy.stop()
        self.assertFalse(stopped.called)
        self.assertTrue(self.proxy.app.admission.draining)
        answered = idle.received
        self.assertEqual(await idle.closed, answered)  # closed by the proxy, nothing more said
        await self.proxy.service.when_ports_closed()
        # No new connection is accepted; the stream in flight goes on.
        with self.assertRaises(ConnectionRefusedError):
            await self.raw_connect()
        self.decode.release()
        events = sse_events(b"".join(await collector.done))
        self.assertEqual(events[-1], "[DONE]")
        await stopped
        self.assertEqual(self.proxy.site.channels(), [])

    async def test_past_the_drain_timeout_each_request_is_told_then_closed(self) -> None:
        events = self.access_events()
        await self.start()
        collector = await self.held_stream()
        self.prefill.hold_answers()
        held = self.prefill.stream_held()
        waiting = self.ensure(self.post_json("/v1/chat/completions", CHAT))
        await held  # in prefill: nothing sent to its client yet
        stopped = self.proxy.stop()
        await self.proxy.service.when_ports_closed()
        self.clock.advance(30)
        with self.assertRaises(ResponseFailed):  # closed short: never passed off as complete
            await collector.done
        (error,) = [e for e in sse_events(collector.body) if isinstance(e, dict) and "error" in e]
        self.assertEqual(error["error"]["code"], "shutting_down")
        response, answer = await waiting  # not started yet: a plain 503
        self.assertError(response, answer, 503, "shutting_down")
        await stopped
        self.assertEqual(self.proxy.site.channels(), [])
        # The proxy's doing, not the clients': counted and logged as such.
        self.assertEqual(sorted(e.get("ended") for e in events), ["shutting_down"] * 2)
        self.decode.release()

    async def test_shutdown_delay_keeps_serving_while_saying_not_ready(self) -> None:
        await self.start(proxy=dict(shutdown_delay=5))
        stopped = self.proxy.stop()
        health = await self.http.get(self.proxy.url + "/healthcheck")
        self.assertEqual(health.code, 503)
        report = json.loads(await health.content())
        self.assertEqual((report["ready"], report["shutting_down"]), (False, True))
        response, _ = await self.post_json("/v1/chat/completions", CHAT)  # still accepted
        self.assertEqual(response.code, 200)
        self.assertFalse(self.proxy.service.when_ports_closed().called)
        self.clock.advance(5)
        await self.proxy.service.when_ports_closed()
        with self.assertRaises(ConnectionRefusedError):
            await self.raw_connect()
        await stopped


class OverloadTests(ProxyCase):
    async def test_stopping_serves_what_waits_in_the_drain_window(self) -> None:
        await self.start(proxy={"decode_max_in_flight": 1})
        self.decode.hold_answers()
        held = self.decode.stream_held()
        first = self.ensure(self.post_json("/v1/chat/completions", CHAT))
        await held  # (the one decode slot taken)
        slots = self.proxy.app.serving.legs.slots
        assert slots is not None
        entered = slots.entered()
        waiting = self.ensure(self.post_json("/v1/chat/completions", CHAT))
        await entered
        stopped = self.proxy.stop()
        await self.proxy.service.when_ports_closed()
        self.assertFalse(waiting.called)  # it keeps its place: not refused for the stop
        self.decode.release()
        for answered in (first, waiting):
            response, _ = await answered
            self.assertEqual(response.code, 200)  # (each closing its connection: test_drain)
        self.assertEqual(len(self.decode.requests), 2)
        await stopped
