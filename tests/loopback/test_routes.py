"""Backend and client connections: reused, kept idle, retired, with Nagle off.

Request ids, headers, authorization and the one-leg routes are proved in
memory (``tests/memory/test_routes.py``).
"""

from __future__ import annotations

from twisted.internet import reactor
from twisted.internet.defer import gatherResults
from twisted.internet.interfaces import ITCPTransport

from tests.support import CHAT, ChunkCollector, ProxyCase


class ConnectionTests(ProxyCase):
    async def test_backend_connections_are_reused(self) -> None:
        await self.start()
        for _ in range(5):
            response = await self.post("/v1/chat/completions", CHAT)
            await response.content()
        self.assertEqual(len(self.prefill.requests), 5)
        self.assertEqual(self.prefill.site.connections_accepted, 1)
        self.assertEqual(self.decode.site.connections_accepted, 1)

    async def test_more_than_two_idle_connections_are_kept_per_instance(self) -> None:
        # Twisted's default pool keeps 2; a burst of 8 streams must not
        # leave 6 sockets to be opened again on the next burst.
        await self.start(tokens=2)

        async def burst() -> None:
            self.decode.hold_streams_after(1)
            held = self.decode.stream_held()
            collectors = []
            for _ in range(8):
                response = await self.post("/v1/chat/completions", dict(CHAT, stream=True))
                collector = ChunkCollector()
                response.deliverBody(collector)
                collectors.append(collector)
            await held
            self.decode.release()
            await gatherResults([c.done for c in collectors])

        await burst()
        self.assertEqual(self.decode.site.connections_accepted, 8)
        await burst()
        self.assertEqual(self.decode.site.connections_accepted, 8)

    async def test_idle_backend_connections_are_retired_after_the_idle_timeout(self) -> None:
        await self.start(proxy=dict(backend_idle_timeout=0.2))
        response = await self.post("/v1/chat/completions", CHAT)
        await response.content()
        (channel,) = self.decode.site.channels()
        # The proxy closes the idle connection itself, long before vLLM would.
        await self.decode.site.connection_lost(channel)
        self.assertEqual(self.decode.site.channels(), [])

    async def test_backend_sockets_have_nagle_off(self) -> None:
        await self.start()
        response = await self.post("/v1/chat/completions", CHAT)
        await response.content()
        for fake in (self.prefill, self.decode):
            (channel,) = fake.site.channels()
            proxy_end = channel.transport.getPeer()  # type: ignore[union-attr]
            (socket,) = [
                reader
                for reader in reactor.getReaders()
                if ITCPTransport.providedBy(reader) and reader.getHost() == proxy_end
            ]
            self.assertTrue(socket.getTcpNoDelay())

    async def test_client_sockets_have_nagle_off(self) -> None:
        await self.start()
        response = await self.post("/v1/chat/completions", CHAT)
        await response.content()
        site = self.proxy.site
        (channel,) = site.channels()
        assert ITCPTransport.providedBy(channel.transport)
        self.assertTrue(channel.transport.getTcpNoDelay())
