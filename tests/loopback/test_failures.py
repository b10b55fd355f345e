"""Never hang, never leak: disconnects, timeouts, backpressure, slow and dead backends."""

from __future__ import annotations

from typing import cast

from twisted.internet.interfaces import IPushProducer
from twisted.web.client import ResponseFailed

from nixl_twisted.config import ProxyConfig
from tests.support import CHAT, ChunkCollector, ProxyCase, sse_events

STREAM = dict(CHAT, stream=True)
#: The default timeouts, which these tests run with.
TIMEOUTS = ProxyConfig.create(prefill=["http://p:1"], decode=["http://d:1"]).timeouts


class ClientLeavesTests(ProxyCase):
    async def leave(self, collector: ChunkCollector) -> None:
        cast(IPushProducer, collector.transport).stopProducing()
        with self.assertRaises(ResponseFailed):
            await collector.done

    async def test_during_prefill_cancels_prefill_and_sends_no_decode(self) -> None:
        await self.start()
        self.prefill.hold_answers()
        held = self.prefill.stream_held()
        sent = self.post("/v1/chat/completions", CHAT)
        await held
        (prefill_channel,) = self.prefill.site.channels()
        prefill_closed = self.prefill.site.connection_lost(prefill_channel)
        (client_channel,) = self.proxy.site.channels()
        client_channel.transport.abortConnection()  # type: ignore[union-attr]
        with self.assertRaises(ResponseFailed):
            await sent
        await prefill_closed
        self.assertEqual(self.prefill.disconnects, 1)
        self.assertEqual(self.decode.requests, [])
        self.assertEqual(self.proxy.app.in_flight, 0)

    async def test_after_prefill_answered_decode_is_still_sent_to_free_blocks(self) -> None:
        await self.start()
        self.prefill.hold_answers_midway()  # prefill has answered, its body not all here
        held = self.prefill.stream_held()
        sent = self.post("/v1/chat/completions", STREAM)
        await held
        (exchange,) = self.proxy.app.exchanges
        await exchange.reached("handoff")  # the proxy has prefill's headers
        (client_channel,) = self.proxy.site.channels()
        client_lost = self.proxy.site.connection_lost(client_channel)
        client_channel.transport.abortConnection()  # type: ignore[union-attr]
        with self.assertRaises(ResponseFailed):
            await sent
        await client_lost

        self.decode.hold_streams_after(1)
        decode_held = self.decode.stream_held()
        self.prefill.release()
        await decode_held
        # Decode got the leg with prefill's params: it will free prefill's blocks ...
        (decode_request,) = self.decode.requests
        self.assertEqual(self.ledger.redeemed, [decode_request.body["kv_transfer_params"]])  # type: ignore[index]
        # ... and once it answers, the proxy drops it: nobody is left to read it.
        (decode_channel,) = self.decode.site.channels()
        await self.decode.site.connection_lost(decode_channel)
        self.decode.release()
        self.assertEqual(self.decode.disconnects, 1)
        self.assertEqual(self.proxy.app.in_flight, 0)

    async def test_while_decode_streams_closes_the_decode_connection(self) -> None:
        await self.start(tokens=5)
        collector = await self.held_stream()
        (decode_channel,) = self.decode.site.channels()
        decode_closed = self.decode.site.connection_lost(decode_channel)
        await self.leave(collector)
        await decode_closed
        self.assertEqual(self.decode.disconnects, 1)
        self.assertEqual(self.proxy.app.in_flight, 0)


class TimeoutTests(ProxyCase):
    async def test_prefill_that_does_not_answer_is_504_and_its_connection_closed(self) -> None:
        await self.start()
        self.prefill.hold_answers()
        held = self.prefill.stream_held()
        sent = self.ensure(self.post_json("/v1/chat/completions", CHAT))
        await held
        (channel,) = self.prefill.site.channels()
        closed = self.prefill.site.connection_lost(channel)
        self.clock.advance(TIMEOUTS.prefill)
        response, answer = await sent
        self.assertError(response, answer, 504, "prefill_timeout")
        self.assertIn(self.prefill.url, answer["error"]["message"])
        await closed
        self.assertEqual(self.decode.requests, [])

    async def test_decode_that_does_not_answer_is_504(self) -> None:
        await self.start()
        self.decode.hold_answers()
        held = self.decode.stream_held()
        sent = self.ensure(self.post_json("/v1/chat/completions", CHAT))
        await held
        (channel,) = self.decode.site.channels()
        closed = self.decode.site.connection_lost(channel)
        self.clock.advance(TIMEOUTS.decode)
        response, answer = await sent
        self.assertError(response, answer, 504, "decode_timeout")
        await closed  # vLLM aborts the request and frees its blocks

    async def test_a_silent_stream_ends_with_an_error_event(self) -> None:
        await self.start(tokens=5)
        collector = await self.held_stream(after=2)
        await collector.received(b'"content": "Hello "')
        self.clock.advance(TIMEOUTS.stream_idle)
        with self.assertRaises(ResponseFailed):
            await collector.done
        events = sse_events(collector.body)
        self.assertEqual(events[-1]["error"]["code"], "decode_timeout")
        self.assertNotIn("[DONE]", events)

    async def test_a_long_generation_that_keeps_producing_is_never_cut(self) -> None:
        await self.start(tokens=6)
        self.decode.clock = self.clock  # the fake's tokens come on the same clock
        self.decode.token_interval = TIMEOUTS.stream_idle * 0.9
        response = await self.post("/v1/completions", {"model": "m", "prompt": "x", "stream": True})
        collector = ChunkCollector()
        response.deliverBody(collector)
        words = ["Hello ", "from ", "the ", "fake ", "decode ", "instance: "]
        for word in words:
            await collector.received(word.encode())  # the proxy has relayed it
            self.clock.advance(self.decode.token_interval)
        chunks = await collector.done
        events = sse_events(b"".join(chunks))
        self.assertEqual([e["choices"][0]["text"] for e in events[:-1]], words)
        self.assertEqual(events[-1], "[DONE]")


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
