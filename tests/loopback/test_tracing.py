"""Traces with the proxy's own OTLP exporter: sampling, a silent collector, the flush at stop.

Spans of requests, read from the SDK's in-memory exporter, are proved in
memory (``tests/memory/test_tracing.py``).
"""

from __future__ import annotations

import logging
import os

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from twisted.internet.task import Clock

from nixl_twisted.config import ProxyConfig, Traces
from nixl_twisted.observe import tracing
from nixl_twisted.testing import FakeCollector
from tests.support import CHAT, ProxyCase

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


def sdk_logs_routed() -> bool:
    sdk = logging.getLogger(tracing.SDK_LOGGER)
    return not sdk.propagate and any(isinstance(h, tracing.SDKLogs) for h in sdk.handlers)


class SamplingTests(ProxyCase):
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

    def finished(self) -> list[ReadableSpan]:
        return list(self.spans.get_finished_spans())

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
