"""``FakeCollector``: an OTLP/HTTP trace receiver on loopback, for tests of tracing.

It takes what an OTLP/HTTP exporter sends (``POST /v1/traces``, protobuf,
gzip or not), decodes it with ``opentelemetry-proto`` as a real collector
does, answers as one, and keeps each span as a ``ReceivedSpan``. It shares
no code with the proxy's tracing: it reads the wire format alone.
"""

from __future__ import annotations

import gzip
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from twisted.internet.address import IPv4Address, IPv6Address
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import serverFromString
from twisted.internet.interfaces import IListeningPort
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from nixl_twisted.testing.site import FakeSite, netloc

#: OTLP's span kinds, by their protobuf number.
KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
#: OTLP's status codes, by their protobuf number.
STATUSES = {0: "unset", 1: "ok", 2: "error"}


@dataclass
class ReceivedSpan:
    """One span as the collector decoded it; ids in lowercase hex, as in ``traceparent``."""

    name: str
    trace_id: str
    span_id: str
    parent_span_id: str | None
    kind: str
    status: str
    status_message: str
    attributes: dict[str, Any]
    resource: dict[str, Any]
    events: list[str] = field(default_factory=list)


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return None if kind is None else getattr(value, kind)


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs if isinstance(pair, KeyValue)}


def decode_export(body: bytes) -> list[ReceivedSpan]:
    """The spans of one OTLP ``ExportTraceServiceRequest``."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans: list[ReceivedSpan] = []
    for resource_spans in request.resource_spans:
        resource = _attributes(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex() or None,
                        kind=KINDS.get(span.kind, str(span.kind)),
                        status=STATUSES.get(span.status.code, str(span.status.code)),
                        status_message=span.status.message,
                        attributes=_attributes(span.attributes),
                        resource=resource,
                        events=[event.name for event in span.events],
                    )
                )
    return spans


class _Traces(Resource):
    isLeaf = True

    def __init__(self, collector: FakeCollector) -> None:
        super().__init__()
        self._collector = collector

    def render_POST(self, request: Request) -> bytes | int:
        content_type = request.getHeader(b"content-type") or b""
        if request.path != b"/v1/traces" or content_type != b"application/x-protobuf":
            request.setResponseCode(415 if request.path == b"/v1/traces" else 404)
            return b"OTLP/HTTP protobuf at /v1/traces only\n"
        assert request.content is not None
        body = request.content.read()
        if request.getHeader(b"content-encoding") == b"gzip":
            body = gzip.decompress(body)
        self._collector._received(decode_export(body))
        request.setHeader(b"Content-Type", b"application/x-protobuf")
        answer = bytes(ExportTraceServiceResponse().SerializeToString())
        if not self._collector.holding:
            return answer
        self._collector._held.append((request, answer))
        return NOT_DONE_YET


class FakeCollector:
    """Receives OTLP/HTTP trace exports on loopback and keeps their spans."""

    def __init__(self) -> None:
        #: Every span received, in the order they arrived.
        self.spans: list[ReceivedSpan] = []
        #: Export requests received.
        self.exports = 0
        self.site = FakeSite(_Traces(self))
        self._port: IListeningPort | None = None
        self._waiting: list[tuple[Callable[[list[ReceivedSpan]], bool], Deferred[None]]] = []
        #: Where an exporter sends: ``http://127.0.0.1:PORT/v1/traces``, once listening.
        self.url = ""
        #: Exports are read, their spans kept, and their answers held back.
        self.holding = False
        self._held: list[tuple[Request, bytes]] = []

    async def listen(
        self, description: str = "tcp:0:interface=127.0.0.1", reactor: Any = None
    ) -> str:
        """Serve on a Twisted endpoint; return the traces URL."""
        if reactor is None:
            from twisted.internet import reactor as default_reactor

            reactor = default_reactor
        self._port = await serverFromString(reactor, description).listen(self.site)
        host = self._port.getHost()
        assert isinstance(host, IPv4Address | IPv6Address)
        self.url = f"http://{netloc(host)}/v1/traces"
        return self.url

    def received(self, enough: Callable[[list[ReceivedSpan]], bool]) -> Deferred[None]:
        """Fires once the spans received so far satisfy ``enough``."""
        waiting: Deferred[None] = Deferred()
        if enough(self.spans):
            waiting.callback(None)
        else:
            self._waiting.append((enough, waiting))
        return waiting

    def hold_answers(self) -> None:
        """Keep every export's answer back (a collector that takes, and never answers)."""
        self.holding = True

    def release(self) -> None:
        """Answer the exports held, and every one from now on."""
        self.holding = False
        held, self._held = self._held, []
        for request, answer in held:
            if not request._disconnected:
                request.write(answer)
                request.finish()

    def named(self, name: str) -> list[ReceivedSpan]:
        return [span for span in self.spans if span.name == name]

    def _received(self, spans: list[ReceivedSpan]) -> None:
        self.exports += 1
        self.spans.extend(spans)
        ready = [w for w in self._waiting if w[0](self.spans)]
        self._waiting = [w for w in self._waiting if w not in ready]
        for _, waiting in ready:
            waiting.callback(None)

    def stop(self) -> Deferred[Any]:
        """Stop listening and close open connections."""
        self.release()
        port, self._port = self._port, None
        return self.site.stop(port)
