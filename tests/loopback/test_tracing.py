"""Traces of real requests through the proxy, read from the SDK's in-memory exporter."""

from __future__ import annotations

import logging
import os
from typing import Any, cast

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IPushProducer
from twisted.internet.task import Clock
from twisted.logger import LogLevel
from twisted.web.client import ResponseFailed
from twisted.web.http_headers import Headers

from nixl_twisted.config import ProxyConfig, Traces
from nixl_twisted.observe import tracing
from nixl_twisted.testing import FakeCollector
from tests.loopback.test_failures import TIMEOUTS
from tests.support import CHAT, ChunkCollector, ProxyCase, closed_port_url

STREAM = dict(CHAT, stream=True)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
#: What a traced client sends: its trace, sampled.
CLIENT_CONTEXT = {
    "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01",
    "tracestate": "vendor=opaque",
    "baggage": "tenant=acme",
}


def traces(**settings: object) -> Traces:
    """Tracing as these settings make it, the table's defaults for the rest."""
    return ProxyConfig.create(prefill=["http://p:1"], decode=["http://d:1"], **settings).traces


def hex_id(number: int, digits: int) -> str:
    return format(number, f"0{digits}x")


def sdk_logs_routed() -> bool:
    sdk = logging.getLogger(tracing.SDK_LOGGER)
    return not sdk.propagate and any(isinstance(h, tracing.SDKLogs) for h in sdk.handlers)


class TracedCase(ProxyCase):
    """A proxy whose spans go to an in-memory exporter, each as it ends."""

    async def start_traced(self, **options: Any) -> None:
        self.spans = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.spans))
        proxy = cast(dict[str, object], options.pop("proxy", {}))
        await self.start(proxy={"tracer_provider": provider, **proxy}, **options)

    def finished(self) -> list[ReadableSpan]:
        return list(self.spans.get_finished_spans())

    def only(self, name: str) -> ReadableSpan:
        (span,) = [s for s in self.finished() if s.name == name]
        return span

    def server(self) -> ReadableSpan:
        (span,) = [s for s in self.finished() if s.kind is SpanKind.SERVER]
        return span

    def client_gone(self) -> Deferred[None]:
        """Fires once the proxy has seen its one client connection close (maybe already)."""
        channels = self.proxy.site.channels()
        return self.proxy.site.connection_lost(channels[0]) if channels else succeed(None)

    def assertChild(self, span: ReadableSpan, parent: ReadableSpan) -> None:
        assert span.parent is not None and span.context is not None
        assert parent.context is not None
        self.assertEqual(span.context.trace_id, parent.context.trace_id)
        self.assertEqual(span.parent.span_id, parent.context.span_id)

    def assertFailed(self, span: ReadableSpan, *words: str) -> None:
        self.assertIs(span.status.status_code, StatusCode.ERROR)
        for word in words:
            self.assertIn(word, span.status.description or "")


class SpanTests(TracedCase):
    async def test_a_completion_is_a_server_span_with_a_client_span_per_leg(self) -> None:
        await self.start_traced()
        response = await self.post("/v1/chat/completions", STREAM)
        await response.content()
        server, prefill, decode = (
            self.server(), self.only("prefill"), self.only("decode")
        )  # fmt: skip
        self.assertEqual(server.name, "POST /v1/chat/completions")
        request_id = response.headers.getRawHeaders(b"x-request-id")[0].decode()
        attributes: dict[str, Any] = dict(server.attributes or {})
        self.assertEqual(attributes["nixlproxy.request_id"], request_id)
        self.assertEqual(attributes["gen_ai.request.model"], "fake-model")
        self.assertEqual(attributes["http.route"], "/v1/chat/completions")
        self.assertEqual(attributes["http.response.status_code"], 200)
        self.assertIs(attributes["nixlproxy.stream"], True)
        self.assertEqual(attributes["nixlproxy.ended"], "answered")
        for figure in ("prefill", "handoff_gap", "decode_first_byte", "time_to_first_byte",
                       "total"):  # fmt: skip
            self.assertGreaterEqual(attributes[f"nixlproxy.{figure}_seconds"], 0)
        self.assertIs(server.status.status_code, StatusCode.UNSET)
        for leg, fake in ((prefill, self.prefill), (decode, self.decode)):
            self.assertIs(leg.kind, SpanKind.CLIENT)
            self.assertChild(leg, server)
            leg_attributes = dict(leg.attributes or {})
            self.assertEqual(leg_attributes["nixlproxy.instance"], fake.url)
            self.assertEqual(leg_attributes["server.address"], "127.0.0.1")
            self.assertEqual(f"http://127.0.0.1:{leg_attributes['server.port']}", fake.url)
            self.assertEqual(leg_attributes["url.full"], fake.url + "/v1/chat/completions")
            self.assertEqual(leg_attributes["nixlproxy.policy"], "round-robin")
            self.assertEqual(leg_attributes["nixlproxy.decision"], "next")
            self.assertEqual(leg_attributes["nixlproxy.attempt"], 1)
            self.assertEqual(leg_attributes["http.response.status_code"], 200)
            self.assertNotIn("nixlproxy.dp_rank", leg_attributes)
        # A new trace: the client sent none.
        assert server.parent is None

    async def test_each_leg_sends_vllm_its_own_traceparent_in_the_clients_trace(self) -> None:
        await self.start_traced()
        response = await self.post("/v1/chat/completions", CHAT, CLIENT_CONTEXT)
        self.assertEqual(response.code, 200)
        await response.content()
        server = self.server()
        assert server.parent is not None and server.context is not None
        self.assertEqual(hex_id(server.context.trace_id, 32), TRACE_ID)
        self.assertEqual(hex_id(server.parent.span_id, 16), CLIENT_SPAN)
        for role, fake in (("prefill", self.prefill), ("decode", self.decode)):
            leg = self.only(role)
            assert leg.context is not None
            (received,) = fake.requests
            self.assertEqual(
                received.headers.getRawHeaders(b"traceparent"),
                [f"00-{TRACE_ID}-{hex_id(leg.context.span_id, 16)}-01".encode()],
            )
            self.assertEqual(received.headers.getRawHeaders(b"tracestate"), [b"vendor=opaque"])
            self.assertEqual(received.headers.getRawHeaders(b"baggage"), [b"tenant=acme"])

    async def test_a_trace_header_that_is_not_utf8_starts_a_new_trace_not_a_500(self) -> None:
        await self.start_traced()
        events = self.logged()
        response = await self.http.post(
            self.proxy.url + "/v1/chat/completions",
            json=CHAT,
            headers=Headers({b"traceparent": [b"00-\xff"]}),
        )
        self.assertEqual(response.code, 200)
        await response.content()
        self.assertIsNone(self.server().parent)
        self.assertEqual([e for e in events if e["log_level"] >= LogLevel.warn], [])

    async def test_a_retry_is_a_sibling_span_that_failed(self) -> None:
        await self.start_traced()
        dead = await closed_port_url()
        self.proxy = self.start_proxy(
            [dead, self.prefill.url], [self.decode.url],
            tracer_provider=self.spans_provider(),
        )  # fmt: skip
        response, _ = await self.post_json("/v1/chat/completions", CHAT)
        self.assertEqual(response.code, 200)
        first, second = sorted(
            (s for s in self.finished() if s.name == "prefill"),
            key=lambda s: cast(int, dict(s.attributes or {})["nixlproxy.attempt"]),
        )
        server = self.server()
        self.assertChild(first, server)
        self.assertChild(second, server)
        self.assertEqual(dict(first.attributes or {})["nixlproxy.instance"], dead)
        self.assertFailed(first, "another instance is tried")
        self.assertIs(second.status.status_code, StatusCode.UNSET)
        self.assertIs(server.status.status_code, StatusCode.UNSET)

    def spans_provider(self) -> TracerProvider:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.spans))
        return provider

    async def test_a_data_parallel_rank_is_on_its_leg(self) -> None:
        await self.start_traced()
        self.proxy = self.start_proxy(
            [self.prefill.url], [self.decode.url + "#dp=2"],
            tracer_provider=self.spans_provider(),
        )  # fmt: skip
        response, _ = await self.post_json("/v1/chat/completions", CHAT)
        self.assertEqual(response.code, 200)
        decode = self.only("decode")
        attributes = dict(decode.attributes or {})
        self.assertEqual(attributes["nixlproxy.dp_rank"], 0)
        self.assertEqual(attributes["nixlproxy.instance"], self.decode.url + "#rank=0")

    async def test_a_batch_is_one_trace_with_legs_per_prompt(self) -> None:
        await self.start_traced()
        body = {"model": "fake-model", "prompt": ["one", "two"], "max_tokens": 3}
        response, _ = await self.post_json("/v1/completions", body)
        self.assertEqual(response.code, 200)
        server = self.server()
        legs = [s for s in self.finished() if s.kind is SpanKind.CLIENT]
        self.assertEqual(sorted(s.name for s in legs), ["decode", "decode", "prefill", "prefill"])
        for leg in legs:
            self.assertChild(leg, server)

    async def test_a_single_leg_route_is_traced_too(self) -> None:
        await self.start_traced()
        headers: dict[bytes | str, bytes | str] = {k: v for k, v in CLIENT_CONTEXT.items()}
        response = await self.http.get(self.proxy.url + "/v1/models", headers=headers)
        await response.content()
        server, decode = self.server(), self.only("decode")
        self.assertEqual(server.name, "GET /v1/models")
        self.assertChild(decode, server)
        self.assertEqual((decode.attributes or {})["url.full"], self.decode.url + "/v1/models")
        (received,) = self.decode.requests
        assert decode.context is not None
        self.assertIn(hex_id(decode.context.span_id, 16).encode(),
                      received.headers.getRawHeaders(b"traceparent", [b""])[0])  # fmt: skip

    async def test_health_checks_and_scrapes_are_not_traced(self) -> None:
        await self.start_traced()
        for path in ("/healthcheck", "/metrics"):
            response = await self.http.get(self.proxy.url + path)
            await response.content()
        self.assertEqual(self.finished(), [])

    async def test_a_refused_request_is_a_span_without_error(self) -> None:
        await self.start_traced()
        response = await self.post("/v1/chat/completions", b"{not json")
        self.assertEqual(response.code, 400)
        await response.content()
        server = self.server()
        self.assertEqual(dict(server.attributes or {})["http.response.status_code"], 400)
        self.assertIs(server.status.status_code, StatusCode.UNSET)  # a client's error


class FailureSpanTests(TracedCase):
    async def test_a_client_that_leaves_during_prefill(self) -> None:
        await self.start_traced()
        self.prefill.hold_answers()
        held = self.prefill.stream_held()
        sent = self.post("/v1/chat/completions", CHAT)
        await held
        (channel,) = self.proxy.site.channels()
        gone = self.proxy.site.connection_lost(channel)
        channel.transport.abortConnection()  # type: ignore[union-attr]
        with self.assertRaises(ResponseFailed):
            await sent
        await gone
        server = self.server()
        self.assertFailed(server, "client left during prefill")
        self.assertEqual(dict(server.attributes or {})["nixlproxy.phase"], "prefill")
        self.assertEqual(dict(server.attributes or {})["nixlproxy.ended"], "client_left")
        self.assertNotIn("http.response.status_code", dict(server.attributes or {}))
        self.assertFailed(self.only("prefill"), "client left during prefill")
        self.assertEqual([s.name for s in self.finished() if s.name == "decode"], [])

    async def test_a_client_that_leaves_during_the_handoff(self) -> None:
        await self.start_traced()
        self.decode.hold_answers()  # decode has the leg, and has not answered yet
        decode_held = self.decode.stream_held()
        sent = self.post("/v1/chat/completions", CHAT)
        await decode_held
        (exchange,) = self.proxy.app.exchanges
        self.assertEqual(exchange.phase.value, "handoff")
        gone = self.client_gone()
        cast(Any, self.proxy.site.channels()[0].transport).abortConnection()
        with self.assertRaises(ResponseFailed):
            await sent
        await gone
        server = self.server()
        self.assertFailed(server, "client left during handoff")
        # Decode (which alone can free prefill's blocks) is let finish: its span
        # lasts until it has answered and its answer was dropped.
        self.assertEqual([s.name for s in self.finished() if s.name == "decode"], [])
        (decode_channel,) = self.decode.site.channels()
        dropped = self.decode.site.connection_lost(decode_channel)
        self.decode.release()
        await dropped
        decode = self.only("decode")
        self.assertFailed(decode, "client left during handoff: decode's answer abandoned")
        assert decode.end_time is not None and server.end_time is not None
        self.assertGreater(decode.end_time, server.end_time)
        self.assertChild(decode, server)

    async def test_a_client_that_leaves_during_the_relay(self) -> None:
        await self.start_traced(tokens=5)
        collector = await self.held_stream()
        gone = self.client_gone()
        cast(IPushProducer, collector.transport).stopProducing()
        with self.assertRaises(ResponseFailed):
            await collector.done
        await gone
        self.assertFailed(self.server(), "client left during relay")
        self.assertFailed(self.only("decode"), "client left during relay")
        self.assertIs(self.only("prefill").status.status_code, StatusCode.UNSET)

    async def test_a_prefill_timeout(self) -> None:
        await self.start_traced()
        self.prefill.hold_answers()
        held = self.prefill.stream_held()
        sent = self.ensure(self.post_json("/v1/chat/completions", CHAT))
        await held
        self.clock.advance(TIMEOUTS.prefill)
        response, _ = await sent
        self.assertEqual(response.code, 504)
        server = self.server()
        self.assertFailed(server, "did not answer within")
        self.assertEqual(dict(server.attributes or {})["nixlproxy.phase"], "prefill")
        self.assertEqual(dict(server.attributes or {})["http.response.status_code"], 504)
        self.assertFailed(self.only("prefill"), "did not answer within")

    async def test_a_decode_timeout(self) -> None:
        await self.start_traced()
        self.decode.hold_answers()
        held = self.decode.stream_held()
        sent = self.ensure(self.post_json("/v1/chat/completions", CHAT))
        await held
        self.clock.advance(TIMEOUTS.decode)
        response, _ = await sent
        self.assertEqual(response.code, 504)
        self.assertFailed(self.server(), "decode", "did not answer within")
        self.assertEqual(dict(self.server().attributes or {})["nixlproxy.phase"], "handoff")
        self.assertFailed(self.only("decode"), "did not answer within")

    async def test_a_broken_stream(self) -> None:
        await self.start_traced(tokens=5)
        self.decode.break_next(after_events=2)
        response = await self.post("/v1/chat/completions", STREAM)
        gone = self.client_gone()
        collector = ChunkCollector()
        response.deliverBody(collector)
        with self.assertRaises(ResponseFailed):
            await collector.done
        await gone
        server = self.server()
        self.assertFailed(server, "decode closed the stream early")
        self.assertEqual(dict(server.attributes or {})["nixlproxy.ended"], "broken")
        self.assertEqual(dict(server.attributes or {})["nixlproxy.phase"], "relay")
        self.assertFailed(self.only("decode"), "broke off")

    async def test_a_silent_stream(self) -> None:
        await self.start_traced(tokens=5)
        collector = await self.held_stream(after=2)
        await collector.received(b'"content": "Hello "')
        gone = self.client_gone()
        self.clock.advance(TIMEOUTS.stream_idle)
        with self.assertRaises(ResponseFailed):
            await collector.done
        await gone
        self.assertFailed(self.server(), "decode went silent mid-stream")
        self.assertFailed(self.only("decode"), "no data from the backend")
        self.decode.release()

    async def test_prefill_refusing_the_request(self) -> None:
        await self.start_traced()
        self.prefill.refuse_next(400, "prompt too long")
        response, _ = await self.post_json("/v1/chat/completions", CHAT)
        self.assertEqual(response.code, 400)
        self.assertIs(self.server().status.status_code, StatusCode.UNSET)
        self.assertFailed(self.only("prefill"), "HTTP 400")


class SamplingTests(TracedCase):
    """``--otel-sampling-ratio`` as the proxy builds it: parent-based."""

    async def start_sampled(self, ratio: float) -> FakeCollector:
        collector = FakeCollector()
        await collector.listen()
        self.addCleanup(collector.stop)
        provider = tracing.provider_for(
            traces(otlp_traces_endpoint=collector.url, otel_sampling_ratio=ratio), None
        )
        self.spans = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(self.spans))
        await self.start(proxy={"tracer_provider": provider})
        return collector

    async def test_ratio_zero_records_no_new_trace_and_tells_vllm_so(self) -> None:
        await self.start_sampled(0.0)
        response, _ = await self.post_json("/v1/chat/completions", CHAT)
        self.assertEqual(response.code, 200)
        self.assertEqual(self.finished(), [])
        (received,) = self.decode.requests
        traceparent = received.headers.getRawHeaders(b"traceparent", [b""])[0]
        flags = int(traceparent.rsplit(b"-", 1)[1], 16)
        self.assertEqual(flags & 1, 0, traceparent)  # not sampled

    async def test_a_sampled_client_trace_is_always_followed(self) -> None:
        await self.start_sampled(0.0)
        response, _ = await self.post_json("/v1/chat/completions", CHAT, CLIENT_CONTEXT)
        self.assertEqual(response.code, 200)
        self.assertEqual(
            sorted(s.name for s in self.finished()),
            ["POST /v1/chat/completions", "decode", "prefill"],
        )


class TracingOffTests(ProxyCase):
    async def test_off_the_clients_trace_headers_pass_through_untouched(self) -> None:
        await self.start()
        response, _ = await self.post_json("/v1/chat/completions", CHAT, CLIENT_CONTEXT)
        self.assertEqual(response.code, 200)
        for fake in (self.prefill, self.decode):
            (received,) = fake.requests
            self.assertEqual(
                received.headers.getRawHeaders(b"traceparent"),
                [CLIENT_CONTEXT["traceparent"].encode()],
            )
        self.assertFalse(self.proxy.app.tracing.enabled)


class CollectorTests(ProxyCase):
    """The proxy's own provider, exporting over OTLP/HTTP from the SDK's thread."""

    async def start_exporting(self, collector_url: str) -> None:
        # The batch processor exports every 50 ms here, not every 5 s.
        os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "50"
        self.addCleanup(os.environ.pop, "OTEL_BSP_SCHEDULE_DELAY", None)
        await self.start(proxy={"otlp_traces_endpoint": collector_url})
        self.assertTrue(self.proxy.app.tracing.enabled)

    async def test_a_collector_that_does_not_answer_never_holds_a_request(self) -> None:
        collector = FakeCollector()
        await collector.listen()
        self.addCleanup(collector.stop)
        collector.hold_answers()
        await self.start_exporting(collector.url)
        await self.post_json("/v1/chat/completions", CHAT)
        # An export is out, and unanswered: the collector holds it ...
        await collector.received(lambda spans: len(spans) >= 1)
        # ... served by this very reactor, which a blocking export would stall.
        for _ in range(5):
            response, _ = await self.post_json("/v1/chat/completions", CHAT)
            self.assertEqual(response.code, 200)
        self.assertEqual(collector.exports, 1)
        collector.release()
        stopping = self.proxy.stop()
        await collector.received(lambda spans: len(spans) >= 18)  # the rest, at stop
        await stopping


class FlushTests(ProxyCase):
    async def test_a_silent_collector_holds_the_stop_for_the_flush_timeout_at_most(self) -> None:
        from twisted.internet import reactor

        collector = FakeCollector()
        await collector.listen()
        self.addCleanup(collector.stop)
        collector.hold_answers()
        clock = Clock()
        provider = tracing.provider_for(traces(otlp_traces_endpoint=collector.url), None)
        self.addCleanup(tracing.unroute_sdk_logs)
        self.assertTrue(sdk_logs_routed())
        provider.get_tracer("test").start_span("queued").end()
        service = tracing.Tracing(provider, reactor, clock)
        service.startService()
        logged = self.logged()
        stopping = service.stopService()
        assert stopping is not None
        await collector.received(lambda spans: len(spans) == 1)  # and not answered
        clock.advance(tracing.FLUSH_TIMEOUT)
        await stopping
        self.assertFalse(sdk_logs_routed())  # the SDK's records are the root logger's again
        self.assertIn("traces not all sent", " ".join(str(e.get("log_format", "")) for e in logged))
        # Answered now, the exporter's thread finishes: it closes its connection as it shuts down.
        (exporting,) = collector.site.channels()
        closed = collector.site.connection_lost(exporting)
        collector.release()
        await closed
