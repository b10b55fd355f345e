"""Traces of requests through the proxy, read from the SDK's in-memory exporter."""

from __future__ import annotations

import json
from typing import Any, cast
from urllib.parse import urlsplit

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from twisted.logger import LogLevel

from tests.memory.migrations import STREAMS
from tests.memory.support import FULL_CHAT, TIMEOUTS, Setup

STREAM = dict(FULL_CHAT, stream=True)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
#: What a traced client sends: its trace, sampled.
CLIENT_CONTEXT = {
    "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01",
    "tracestate": "vendor=opaque",
    "baggage": "tenant=acme",
}


def hex_id(number: int, digits: int) -> str:
    return format(number, f"0{digits}x")


class Traced(Setup):
    """A proxy whose spans go to an in-memory exporter, each as it ends."""

    def __init__(self, **options: Any) -> None:
        self.spans = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.spans))
        super().__init__(tracer_provider=provider, **options)

    def finished(self) -> list[ReadableSpan]:
        return list(self.spans.get_finished_spans())

    def only(self, name: str) -> ReadableSpan:
        (span,) = [s for s in self.finished() if s.name == name]
        return span

    def server(self) -> ReadableSpan:
        (span,) = [s for s in self.finished() if s.kind is SpanKind.SERVER]
        return span


def attributes(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def assert_child(span: ReadableSpan, parent: ReadableSpan) -> None:
    assert span.parent is not None and span.context is not None
    assert parent.context is not None
    assert span.context.trace_id == parent.context.trace_id
    assert span.parent.span_id == parent.context.span_id


def assert_failed(span: ReadableSpan, *words: str) -> None:
    assert span.status.status_code is StatusCode.ERROR
    for word in words:
        assert word in (span.status.description or "")


# -- spans -----------------------------------------------------------------------


def test_a_decode_only_completion_is_a_server_span_with_only_its_decode_span() -> None:
    setup = Traced(decode_only_below=64)
    assert setup.post("/v1/chat/completions", STREAM).answer().status == 200
    found = attributes(setup.server())
    assert (found["nixlproxy.mode"], found["nixlproxy.decided_by"]) == (
        "decode_only",
        "short_prompt",
    )
    assert "nixlproxy.prefill_seconds" not in found
    assert "nixlproxy.handoff_gap_seconds" not in found
    assert [s.name for s in setup.finished() if s.kind is SpanKind.CLIENT] == ["decode"]
    assert_child(setup.only("decode"), setup.server())


def test_a_completion_is_a_server_span_with_a_client_span_per_leg() -> None:
    setup = Traced()
    answer = setup.post("/v1/chat/completions", STREAM).answer()
    server, prefill, decode = setup.server(), setup.only("prefill"), setup.only("decode")
    assert server.name == "POST /v1/chat/completions"
    (request_id,) = answer.values("x-request-id")
    found = attributes(server)
    assert found["nixlproxy.request_id"] == request_id
    assert found["gen_ai.request.model"] == "fake-model"
    assert found["http.route"] == "/v1/chat/completions"
    assert found["http.response.status_code"] == 200
    assert found["nixlproxy.stream"] is True
    assert found["nixlproxy.ended"] == "answered"
    assert (found["nixlproxy.mode"], found["nixlproxy.decided_by"]) == ("pd", "always")
    for figure in ("prefill", "handoff_gap", "decode_first_byte", "time_to_first_byte", "total"):
        assert found[f"nixlproxy.{figure}_seconds"] >= 0
    assert server.status.status_code is StatusCode.UNSET
    for leg, fake in ((prefill, setup.prefill), (decode, setup.decode)):
        assert leg.kind is SpanKind.CLIENT
        assert_child(leg, server)
        leg_attributes = attributes(leg)
        assert leg_attributes["nixlproxy.instance"] == fake.url
        url = urlsplit(fake.url)
        assert leg_attributes["server.address"] == url.hostname
        assert leg_attributes["server.port"] == (url.port or 80)
        assert leg_attributes["url.full"] == fake.url + "/v1/chat/completions"
        assert leg_attributes["nixlproxy.policy"] == "round-robin"
        assert leg_attributes["nixlproxy.decision"] == "next"
        assert leg_attributes["nixlproxy.attempt"] == 1
        assert leg_attributes["http.response.status_code"] == 200
        assert "nixlproxy.dp_rank" not in leg_attributes
    # A new trace: the client sent none.
    assert server.parent is None


def test_each_leg_sends_vllm_its_own_traceparent_in_the_clients_trace() -> None:
    setup = Traced()
    assert setup.post("/v1/chat/completions", FULL_CHAT, CLIENT_CONTEXT).answer().status == 200
    server = setup.server()
    assert server.parent is not None and server.context is not None
    assert hex_id(server.context.trace_id, 32) == TRACE_ID
    assert hex_id(server.parent.span_id, 16) == CLIENT_SPAN
    for role, fake in (("prefill", setup.prefill), ("decode", setup.decode)):
        leg = setup.only(role)
        assert leg.context is not None
        (received,) = fake.requests
        assert received.headers.getRawHeaders(b"traceparent") == [
            f"00-{TRACE_ID}-{hex_id(leg.context.span_id, 16)}-01".encode()
        ]
        assert received.headers.getRawHeaders(b"tracestate") == [b"vendor=opaque"]
        assert received.headers.getRawHeaders(b"baggage") == [b"tenant=acme"]


def test_a_trace_header_that_is_not_utf8_starts_a_new_trace_not_a_500(
    logged: list[dict[str, Any]],
) -> None:
    setup = Traced()
    body = json.dumps(FULL_CHAT).encode()
    client = setup.proxy.connect()
    client.send(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\ntraceparent: 00-\xff\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    )
    assert client.answer().status == 200
    assert setup.server().parent is None
    assert [e for e in logged if e["log_level"] >= LogLevel.warn] == []


def test_a_retry_is_a_sibling_span_that_failed() -> None:
    dead = "http://prefill-dead.memory"  # no fake serves it: the connection is refused
    setup = Traced(prefill=[dead, "http://prefill-0.memory"])
    assert setup.post("/v1/chat/completions", FULL_CHAT).answer().status == 200
    first, second = sorted(
        (s for s in setup.finished() if s.name == "prefill"),
        key=lambda s: cast(int, attributes(s)["nixlproxy.attempt"]),
    )
    server = setup.server()
    assert_child(first, server)
    assert_child(second, server)
    assert attributes(first)["nixlproxy.instance"] == dead
    assert_failed(first, "another instance is tried")
    assert second.status.status_code is StatusCode.UNSET
    assert server.status.status_code is StatusCode.UNSET


def test_a_data_parallel_rank_is_on_its_leg() -> None:
    setup = Traced(decode=["http://decode-0.memory#dp=2"])
    assert setup.post("/v1/chat/completions", FULL_CHAT).answer().status == 200
    found = attributes(setup.only("decode"))
    assert found["nixlproxy.dp_rank"] == 0
    assert found["nixlproxy.instance"] == setup.decode.url + "#rank=0"


def test_a_batch_is_one_trace_with_legs_per_prompt() -> None:
    setup = Traced()
    body = {"model": "fake-model", "prompt": ["one", "two"], "max_tokens": 3}
    assert setup.post("/v1/completions", body).answer().status == 200
    server = setup.server()
    legs = [s for s in setup.finished() if s.kind is SpanKind.CLIENT]
    assert sorted(s.name for s in legs) == ["decode", "decode", "prefill", "prefill"]
    for leg in legs:
        assert_child(leg, server)


def test_a_single_leg_route_is_traced_too() -> None:
    setup = Traced()
    setup.get("/v1/models", CLIENT_CONTEXT).answer()
    server, decode = setup.server(), setup.only("decode")
    assert server.name == "GET /v1/models"
    assert_child(decode, server)
    assert attributes(decode)["url.full"] == setup.decode.url + "/v1/models"
    (received,) = setup.decode.requests
    assert decode.context is not None
    traceparent = received.headers.getRawHeaders(b"traceparent", [b""])[0]
    assert hex_id(decode.context.span_id, 16).encode() in traceparent


def test_health_checks_and_scrapes_are_not_traced() -> None:
    setup = Traced()
    for path in ("/healthcheck", "/metrics"):
        setup.get(path).answer()
    assert setup.finished() == []


def test_a_refused_request_is_a_span_without_error() -> None:
    setup = Traced()
    assert setup.post("/v1/chat/completions", b"{not json").answer().status == 400
    server = setup.server()
    assert attributes(server)["http.response.status_code"] == 400
    assert server.status.status_code is StatusCode.UNSET  # a client's error


# -- what failed, and in which phase ---------------------------------------------


def test_a_client_that_leaves_during_prefill() -> None:
    setup = Traced()
    setup.prefill.hold_answers()
    held = setup.prefill.stream_held()
    client = setup.post("/v1/chat/completions", FULL_CHAT)
    assert held.called
    client.disconnect()
    server = setup.server()
    assert_failed(server, "client left during prefill")
    assert attributes(server)["nixlproxy.phase"] == "prefill"
    assert attributes(server)["nixlproxy.ended"] == "client_left"
    assert "http.response.status_code" not in attributes(server)
    assert_failed(setup.only("prefill"), "client left during prefill")
    assert [s.name for s in setup.finished() if s.name == "decode"] == []


def test_a_client_that_leaves_during_the_handoff() -> None:
    setup = Traced()
    setup.decode.hold_answers()  # decode has the leg, and has not answered yet
    decode_held = setup.decode.stream_held()
    client = setup.post("/v1/chat/completions", FULL_CHAT)
    assert decode_held.called
    assert setup.phase() == "handoff"
    client.disconnect()
    server = setup.server()
    assert_failed(server, "client left during handoff")
    # Decode (which alone can free prefill's blocks) is let finish: its span
    # lasts until it has answered and its answer was dropped.
    assert [s.name for s in setup.finished() if s.name == "decode"] == []
    setup.decode.release()
    setup.proxy.flush()
    decode = setup.only("decode")
    assert_failed(decode, "client left during handoff: decode's answer abandoned")
    assert decode.end_time is not None and server.end_time is not None
    assert decode.end_time > server.end_time
    assert_child(decode, server)


def test_a_client_that_leaves_during_the_relay() -> None:
    setup = Traced(tokens=5)
    client = setup.held_stream(body=STREAM)
    client.disconnect()
    assert_failed(setup.server(), "client left during relay")
    assert_failed(setup.only("decode"), "client left during relay")
    assert setup.only("prefill").status.status_code is StatusCode.UNSET


def test_a_prefill_timeout() -> None:
    setup = Traced()
    setup.prefill.hold_answers()
    held = setup.prefill.stream_held()
    client = setup.post("/v1/chat/completions", FULL_CHAT)
    assert held.called
    setup.proxy.advance(TIMEOUTS.prefill)
    assert client.answer().status == 504
    server = setup.server()
    assert_failed(server, "did not answer within")
    assert attributes(server)["nixlproxy.phase"] == "prefill"
    assert attributes(server)["http.response.status_code"] == 504
    assert_failed(setup.only("prefill"), "did not answer within")


def test_a_decode_timeout() -> None:
    setup = Traced()
    setup.decode.hold_answers()
    held = setup.decode.stream_held()
    client = setup.post("/v1/chat/completions", FULL_CHAT)
    assert held.called
    setup.proxy.advance(TIMEOUTS.decode)
    assert client.answer().status == 504
    assert_failed(setup.server(), "decode", "did not answer within")
    assert attributes(setup.server())["nixlproxy.phase"] == "handoff"
    assert_failed(setup.only("decode"), "did not answer within")


def test_a_broken_stream() -> None:
    setup = Traced(tokens=5, decode_migrations=0)
    setup.decode.break_next(after_events=2)
    client = setup.post("/v1/chat/completions", STREAM)
    assert not client.answer().complete and client.lost
    server = setup.server()
    assert_failed(server, "decode closed the stream early")
    assert attributes(server)["nixlproxy.ended"] == "broken"
    assert attributes(server)["nixlproxy.phase"] == "relay"
    assert_failed(setup.only("decode"), "broke off")


def test_a_silent_stream() -> None:
    setup = Traced(tokens=5, decode_migrations=0)
    client = setup.held_stream(after=2, body=STREAM)
    assert b'"content":"Hello "' in client.received()
    setup.proxy.advance(TIMEOUTS.stream_idle)
    assert not client.answer().complete and client.lost
    assert_failed(setup.server(), "decode went silent mid-stream")
    assert_failed(setup.only("decode"), "no data from the backend")
    setup.decode.release()


def test_prefill_refusing_the_request() -> None:
    setup = Traced()
    setup.prefill.refuse_next(400, "prompt too long")
    assert setup.post("/v1/chat/completions", FULL_CHAT).answer().status == 400
    assert setup.server().status.status_code is StatusCode.UNSET
    assert_failed(setup.only("prefill"), "HTTP 400")


# -- tracing off -----------------------------------------------------------------


def test_off_the_clients_trace_headers_pass_through_untouched() -> None:
    setup = Setup()
    assert setup.post("/v1/chat/completions", FULL_CHAT, CLIENT_CONTEXT).answer().status == 200
    for fake in (setup.prefill, setup.decode):
        (received,) = fake.requests
        assert received.headers.getRawHeaders(b"traceparent") == [
            CLIENT_CONTEXT["traceparent"].encode()
        ]
    assert not setup.proxy.app.tracing.enabled


def test_a_decode_lost_once_it_had_the_request_moves_as_a_failed_attempt() -> None:
    """Its attempt fails once (its span, its count), its slot is given back, and the
    continuation's decode is a sibling span that served: the move is not the leg's retry."""
    setup = Traced(tokens=4, decodes=2)
    first = setup.decodes[0]
    first.die_after_next(0)  # (the connection closes once decode has the request)
    assert setup.post("/v1/completions", STREAMS["/v1/completions"]).answer().complete
    lost, again = sorted(
        (s for s in setup.finished() if s.name == "decode"),
        key=lambda s: s.start_time or 0,
    )
    assert attributes(lost)["nixlproxy.instance"] == "http://decode-0.memory"
    assert_failed(lost, "moving to another decode instance")
    assert again.status.status_code is StatusCode.UNSET
    assert setup.server().status.status_code is StatusCode.UNSET
    samples = setup.scrape()
    counted = {
        dict(labels)["outcome"]: value
        for (name, labels), value in samples.items()
        if name == "nixlproxy_backend_requests_total" and dict(labels)["pool"] == "decode"
    }
    assert counted == {"unreachable": 1.0, "answered": 1.0}
    assert not [v for (n, _), v in samples.items() if n == "nixlproxy_retries_total" and v]
    assert [i.in_flight for i in setup.proxy.service.backends.decode.instances] == [0, 0]
