"""A real ``twistd nixlproxy`` exporting its traces over OTLP/HTTP to a collector on loopback."""

from __future__ import annotations

from nixl_twisted import __version__
from nixl_twisted.testing import FakeCollector, ReceivedSpan
from tests.process.support import TwistdCase
from tests.support import CHAT

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
#: The batch processor sends every 100 ms here, not every 5 s.
QUICK_BATCHES = {"OTEL_BSP_SCHEDULE_DELAY": "100"}


def placed(value: str, url: str) -> str:
    """``value`` with COLLECTOR_BASE (no path) or COLLECTOR (the traces URL) filled in."""
    return value.replace("COLLECTOR_BASE", url.removesuffix("/v1/traces")).replace("COLLECTOR", url)


def one_trace(spans: list[ReceivedSpan]) -> bool:
    return {"POST /v1/chat/completions", "prefill", "decode"} <= {s.name for s in spans}


class OTLPExportTests(TwistdCase):
    async def collector(self) -> FakeCollector:
        collector = FakeCollector()
        await collector.listen()
        self.addCleanup(collector.stop)
        return collector

    async def completion_traced_by(self, *args: str, env: dict[str, str]) -> FakeCollector:
        await self.start()
        collector = await self.collector()
        process = self.spawn(
            "--listen",
            "tcp:0:interface=127.0.0.1",
            "--prefill",
            self.prefill.url,
            "--decode",
            self.decode.url,
            *[arg.replace("COLLECTOR", collector.url) for arg in args],
            env={k: placed(v, collector.url) for k, v in env.items()},
        )
        url = f"http://{await process.listening}"
        headers: dict[bytes | str, bytes | str] = {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}
        response = await self.http.post(url + "/v1/chat/completions", json=CHAT, headers=headers)
        self.assertEqual(response.code, 200)
        await response.content()
        await collector.received(one_trace)
        await self.terminate(process)
        return collector

    async def test_spans_reach_the_collector_in_otlp_protobuf(self) -> None:
        collector = await self.completion_traced_by(
            "--otlp-traces-endpoint", "COLLECTOR", env=QUICK_BATCHES
        )
        (server,) = collector.named("POST /v1/chat/completions")
        (prefill,) = collector.named("prefill")
        (decode,) = collector.named("decode")
        self.assertEqual((server.kind, prefill.kind, decode.kind), ("server", "client", "client"))
        self.assertEqual(server.trace_id, TRACE_ID)
        self.assertEqual(server.parent_span_id, CLIENT_SPAN)
        for leg, fake in ((prefill, self.prefill), (decode, self.decode)):
            self.assertEqual((leg.trace_id, leg.parent_span_id), (TRACE_ID, server.span_id))
            self.assertEqual(leg.attributes["nixlproxy.instance"], fake.url)
            (received,) = fake.requests
            self.assertEqual(
                received.headers.getRawHeaders(b"traceparent"),
                [f"00-{TRACE_ID}-{leg.span_id}-01".encode()],
            )
        self.assertEqual(server.attributes["http.response.status_code"], 200)
        self.assertEqual(server.resource["service.name"], "nixl-twisted")
        self.assertEqual(server.resource["service.version"], __version__)
        self.assertEqual(server.status, "unset")

    async def test_the_sdks_own_variables_turn_it_on_and_name_the_service(self) -> None:
        collector = await self.completion_traced_by(
            env={
                **QUICK_BATCHES,
                # The generic endpoint: the exporter adds /v1/traces itself.
                "OTEL_EXPORTER_OTLP_ENDPOINT": "COLLECTOR_BASE",
                "OTEL_SERVICE_NAME": "edge-proxy",
            }
        )
        (server,) = collector.named("POST /v1/chat/completions")
        self.assertEqual(server.resource["service.name"], "edge-proxy")
