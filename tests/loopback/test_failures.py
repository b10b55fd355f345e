"""Backpressure through real sockets: a slow client pauses decode, the proxy buffers little.

The rest of never hanging and never leaking is proved in memory
(``tests/memory/test_failures.py``, ``test_exchange_table.py``).
"""

from __future__ import annotations

import json
import socket
from typing import Any, cast

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IPushProducer
from twisted.logger import ILogObserver, globalLogPublisher
from zope.interface import provider

from nixl_twisted.exchange import relay
from tests.support import CHAT, ChunkCollector, ProxyCase

STREAM = dict(CHAT, stream=True)


class BackpressureTests(ProxyCase):
    async def test_a_slow_client_pauses_decode_and_the_proxy_buffers_little(self) -> None:
        await self.start()
        total = 32 * 1024 * 1024
        self.decode.firehose(event_bytes=64 * 1024, total_bytes=total)
        paused = self.decode.firehose_paused()
        response = await self.post("/v1/chat/completions", STREAM)
        collector = ChunkCollector()
        response.deliverBody(collector)
        cast(IPushProducer, collector.transport).pauseProducing()  # the client stops reading

        await paused
        # Backpressure reached decode long before it wrote everything ...
        self.assertLess(self.decode.firehose_written, total // 8)
        # ... and what the proxy holds for this stream is a socket buffer's worth.
        (channel,) = self.proxy.site.channels()
        transport = channel.transport
        buffered = len(transport.dataBuffer) + transport._tempDataLen  # type: ignore[union-attr]
        self.assertLess(buffered, 1024 * 1024)

        cast(IPushProducer, collector.transport).resumeProducing()
        chunks = await collector.done
        self.assertEqual(b"".join(chunks)[-14:], b"data: [DONE]\n\n")
        self.assertEqual(sum(map(len, chunks)), total + 14)

    async def test_a_client_that_stops_reading_ends_as_its_own_doing_and_nothing_moves(
        self,
    ) -> None:
        # Two decode instances and a move allowed: without the client's pause told apart,
        # decode held paused past --stream-idle-timeout looked silent and the answer moved.
        await self.start(decodes=2, proxy={"stream_idle_timeout": 5.0, "decode_migrations": 1})
        ended = self._access_event()
        logged = self.logged()
        for decode in self.decodes:
            decode.firehose(event_bytes=64 * 1024, total_bytes=32 * 1024 * 1024)
        paused: Deferred[None] = Deferred()
        pause = relay._Paced.pauseProducing

        def pausing(producer: relay._Paced) -> None:
            pause(producer)
            if not paused.called:
                paused.callback(None)

        self.patch(relay._Paced, "pauseProducing", pausing)
        # Kernel buffers smaller than one event: the first pause is for good.
        (listening, *_) = self.proxy.service.ports()
        server = listening.socket  # type: ignore[attr-defined]
        server.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # (accepted ones inherit)
        client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.addCleanup(client.close)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", listening.getHost().port))  # type: ignore[attr-defined]
        body = json.dumps(STREAM).encode()
        client.sendall(  # ... and then reads nothing
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        await paused

        self.clock.advance(4.9)  # (past it since decode's last byte, for all the proxy knows)
        self.assertFalse(ended.called)
        self.clock.advance(0.2)
        event = await ended
        self.assertEqual(event["ended"], "client_slow")
        self.assertNotIn("migrated", event)
        self.assertNotIn("migration", event)
        requests = sum(len(decode.requests_for("decode")) for decode in self.decodes)
        self.assertEqual(requests, 1)  # (no continuation, no fresh prefill)
        self.assertEqual(sum(len(p.requests_for("prefill")) for p in self.prefills), 1)
        said = [e for e in logged if "client_slow" in str(e.get("log_format", ""))]
        self.assertEqual([e["log_level"].name for e in said], ["info"])
        levels = [e["log_level"].name for e in logged if e.get("log_level") is not None]
        self.assertNotIn("error", levels)
        self.assertNotIn("critical", levels)
        for instance in self.proxy.app.backends.decode.instances:  # (nothing held against it)
            self.assertEqual((instance.state.value, instance.failures), ("up", 0))
        scraped = await (await self.http.get(self.proxy.url + "/metrics")).text()
        counted = [line for line in scraped.splitlines() if 'status="client_slow"' in line]
        self.assertEqual(len(counted), 1, counted)
        self.assertTrue(counted[0].startswith("nixlproxy_requests_total{"), counted)

    def _access_event(self) -> Deferred[dict[str, Any]]:
        """Fires with the next access event's fields."""
        fired: Deferred[dict[str, Any]] = Deferred()

        @provider(ILogObserver)
        def observe(event: dict[str, Any]) -> None:
            if event.get("log_namespace") == "nixlproxy.access" and not fired.called:
                fired.callback(event["access"])

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)
        return fired
