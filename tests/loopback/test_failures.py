"""Backpressure through real sockets: a slow client pauses decode, the proxy buffers little.

The rest of never hanging and never leaking is proved in memory
(``tests/memory/test_failures.py``, ``test_exchange_table.py``).
"""

from __future__ import annotations

from typing import cast

from twisted.internet.interfaces import IPushProducer

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
        self.assertEqual(sum(map(len, chunks)), total)
